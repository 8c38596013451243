#include "dispatch/kept_outputs.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>

#include "dispatch/ivalue_tensors.h"
#include "dispatch/preserved_writes.h"
#include "dispatch/sac_key.h"
#include "dispatch/storage_copy.h"

namespace sac {

namespace {

c10::IValue detachedValue(const c10::IValue& value) {
  if (value.isTensor()) return detachedAlias(value.toTensor());
  if (value.isTensorList()) {
    c10::List<at::Tensor> copies;
    for (const at::Tensor& tensor : value.toTensorList().vec()) copies.push_back(detachedAlias(tensor));
    return copies;
  }
  return value;
}

// NOTE: [Versions of out= results]
// An out= op's result is its out= argument, and the ADInplaceOrView kernel above us bumps that
// tensor's version after we return. When that kernel is on the way (it excludes its own key
// from the thread-local set while it redispatches; InferenceMode excludes it too but runs no
// bump), the version to expect in the recompute is one more than what we read now.
int64_t pendingVersionBumps(const OpEntry& op) {
  bool in_place_kernel_above =
      c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::ADInplaceOrView) && !c10::InferenceMode::is_enabled();
  return op.traits.writes_out_arguments && in_place_kernel_above ? 1 : 0;
}

}  // namespace

std::string unitSuffix(UnitId unit, bool offloaded) {
  const char* how = offloaded ? "offloaded" : "kept";
  return unit == kNoUnit ? std::string(" (") + how + " by the op list)"
                         : std::string(" (") + how + " in unit '" + unitName(unit) + "')";
}

KeptOutputs* KeptOutputStore::store(const OpEntry& op, uint64_t call, UnitId unit, uint32_t ordinal, uint64_t position,
                                    const torch::jit::Stack& stack, size_t num_returns) {
  auto [it, inserted] = entries_.try_emplace(call);
  // Identities are unique within a pass; a repeat would be a 64-bit hash collision: keep the
  // first and let the second run again in the recompute.
  if (!inserted) return nullptr;
  KeptOutputs& kept = it->second;
  kept.op = &op;
  kept.unit = unit;
  kept.ordinal = ordinal != 0 ? ordinal : nextOrdinal(op);
  kept.position = position;
  kept.outputs.reserve(num_returns);
  const int64_t pending = pendingVersionBumps(op);
  for (size_t i = stack.size() - num_returns; i < stack.size(); ++i) {
    kept.outputs.push_back(detachedValue(stack[i]));
    forEachTensor(stack[i], [&](const at::Tensor& tensor) {
      int64_t version = versionOf(tensor);
      kept.versions.push_back(version < 0 ? version : version + pending);
      if (tensor.defined() && tensor.has_storage()) {
        storages_[tensor.storage().unsafeGetStorageImpl()].push_back(call);
      }
    });
  }
  return &kept;
}

void KeptOutputStore::preserveIn(const std::vector<WrittenStorage>& written) {
  for (const WrittenStorage& write : written) {
    auto found = storages_.find(write.storage.unsafeGetStorageImpl());
    if (found == storages_.end()) continue;
    if (!preserveBeforeWrite(found->first, found->second, entries_, offloaded_)) {
      for (uint64_t call : found->second) release(entries_.at(call));
    }
    storages_.erase(found);
  }
}

bool KeptOutputStore::serve(const OpEntry& op, uint64_t call, const c10::OperatorHandle& handle,
                            torch::jit::Stack* stack, bool consume, uint64_t pass) {
  auto it = entries_.find(call);
  if (it == entries_.end() || it->second.op != &op || it->second.released) return false;
  KeptOutputs& kept = it->second;
  const std::string& name = op.traits.qualified_name;
  TORCH_CHECK(!kept.consumed, "sac: the kept output of ", name, unitSuffix(kept.unit, !kept.offloaded.empty()),
              ", call ", kept.ordinal,
              " of this region, was already used by an earlier backward and freed. Trying to backward an "
              "extra time: a selectively checkpointed region supports a second backward only when the "
              "first runs with retain_graph=True");

  size_t position = 0;
  for (const c10::IValue& value : kept.outputs) {
    forEachTensor(value, [&](const at::Tensor& tensor) {
      checkServedVersion(kept, kept.versions[position++], versionOf(tensor));
    });
  }
  KeptValues* outputs = &kept.outputs;
  KeptValues with_offloaded;
  if (!kept.offloaded.empty()) {
    offloaded_.take(kept, /*keep_host=*/!consume, with_offloaded);
    outputs = &with_offloaded;
  }

  const c10::FunctionSchema& schema = handle.schema();
  const size_t num_arguments = schema.arguments().size();
  KeptValues results;
  if (op.traits.writes_out_arguments) {
    // An out= op must leave its result in the caller's out= tensors, which in the recompute are
    // fresh buffers: copy the kept values into them and return them (NOTE: [The plugin's own calls]).
    PluginCallGuard not_the_models;
    size_t first_argument = stack->size() - num_arguments;
    size_t out_index = 0;
    for (size_t i = 0; i < num_arguments; ++i) {
      if (!schema.arguments()[i].is_out()) continue;
      const c10::IValue& out = (*stack)[first_argument + i];
      const c10::IValue& value = outputs->at(out_index++);
      if (out.isTensor()) {
        out.toTensor().copy_(value.toTensor());
      } else if (out.isTensorList()) {
        auto targets = out.toTensorList().vec();
        auto sources = value.toTensorList().vec();
        for (size_t j = 0; j < targets.size(); ++j) targets[j].copy_(sources[j]);
      }
      results.push_back(out);
    }
  } else {
    // A backward that frees what it is served hands over the region's own detached aliases (or the
    // device copies of offloaded outputs), which are freed right after; one that keeps its graph
    // serves fresh aliases and keeps its own for the next backward.
    for (c10::IValue& value : *outputs) results.push_back(consume ? std::move(value) : detachedValue(value));
    // The recompute writes what it is served again: a backward that keeps its graph is served
    // this pass's copy (NOTE: [Kept outputs written in the forward] in preserved_writes.cpp).
    if (!consume) {
      for (auto& [slot, preserved] : kept.preserved) {
        results[slot] = aliasOver(preserved->workingFor(pass), kept.outputs[slot].toTensor());
      }
    }
  }
  // The outputs go after the arguments, which the engine drops: only it knows whether it owns
  // them (NOTE: [Hot ops skip boxing] in hot_op_kernels.cpp).
  for (c10::IValue& value : results) stack->push_back(std::move(value));

  if (consume) {
    drop(kept);
    kept.consumed = true;
  }
  --left_to_serve_;
  return true;
}

// NOTE: [Kept outputs the recompute never reaches]
// torch's non-reentrant checkpoint stops the recompute as soon as every tensor the forward saved
// for backward has been saved again (early stop). A kept call that ran after the forward's last
// save (the last projection of a block, whose input autograd saves before it runs) is never
// reached by the recompute, so its kept output would be held from the forward to the backward
// for nothing. The first forward of each checkpoint site is watched (sac_plugin/checkpointing.py:
// _SaveWatch notes the region's position at every save); at its end the region frees those
// outputs and tells the site their (op, ordinal), and later regions of the site decide the
// same calls as kept but do not hold them (the call pipeline asks Site::neverReached). Nothing is
// recomputed that was not before: the recompute never reaches these calls. With early_stop=False
// the whole recompute runs and nothing is released.
int64_t KeptOutputStore::releaseUnreached(int64_t last_saved_position, Site& site) {
  int64_t released = 0;
  for (auto& [call, kept] : entries_) {
    if (kept.position <= static_cast<uint64_t>(std::max<int64_t>(last_saved_position, 0)) || kept.released ||
        kept.outputs.empty()) {
      continue;
    }
    site.noteNeverReached(*kept.op, kept.ordinal);
    release(kept);
    ++released;
  }
  return released;
}

// NOTE: [The recompute after the last kept call]
// A recompute serves each kept output at most once. Counting what is left to serve lets the
// fallback stop naming calls once the count reaches zero: no later call of this pass can be
// served, so its identity and its outputs' records are never read. A consumed entry (an extra
// backward after one without retain_graph) keeps the count above zero, so that the call that
// would have been served still reaches serve() and is told that its output was freed.
void KeptOutputStore::beginRecompute() {
  left_to_serve_ = 0;
  bool any_consumed = false;
  for (const auto& [key, kept] : entries_) {
    left_to_serve_ += kept.outputs.empty() ? 0 : 1;
    any_consumed = any_consumed || (kept.consumed && !kept.released);
  }
  if (any_consumed) left_to_serve_ = SIZE_MAX;
}

// NOTE: [Served, or named]
// A kept (or offloaded) output costs memory from the forward to the backward; it pays for itself
// only when the recompute is served it. One the recompute never asked for (its call was named
// differently in the two passes: an argument came from a tensor the region cannot name, made
// outside its intercepted calls) was held for nothing and its call ran again. That must never
// pass in silence: at the end of every recompute that frees what it holds, each such output is
// counted (the audit's never_served calls and bytes, per op), and the first recompute of a
// checkpoint site that finds any leaves a warning naming the layer, each call, its unit and the
// bytes, which the scope closing the recompute issues as a HeldNeverServedWarning. Outputs the
// recompute never reaches by design (torch's early stop, NOTE: [Kept outputs the recompute never
// reaches]) are released before the backward and are not counted.
std::string KeptOutputStore::countNeverServed(Site& site) {
  // The unserved entries, by forward position: the message names them in the order they ran.
  std::vector<std::pair<uint64_t, const KeptOutputs*>> unserved;
  int64_t unserved_bytes = 0;
  for (auto& [key, kept] : entries_) {
    if (kept.consumed || kept.released || kept.outputs.empty()) continue;
    int64_t bytes = 0;
    for (const c10::IValue& value : kept.outputs) {
      forEachTensor(value, [&](const at::Tensor& tensor) {
        if (tensor.defined() && tensor.has_storage()) bytes += static_cast<int64_t>(tensor.storage().nbytes());
      });
    }
    for (const auto& [slot, offloaded] : kept.offloaded) bytes += offloaded.bytes();
    kept.op->counters.recordNeverServed(static_cast<uint64_t>(bytes));
    unserved.emplace_back(kept.position, &kept);
    unserved_bytes += bytes;
  }
  // The message is worded once per site: later recomputes only count.
  if (unserved.empty() || !site.claimNotice(Site::Notice::kHeldNeverServed)) return {};
  std::sort(unserved.begin(), unserved.end());
  std::string unserved_names;
  for (size_t i = 0; i < unserved.size() && i < 8; ++i) {
    const KeptOutputs& kept = *unserved[i].second;
    unserved_names += c10::str(i > 0 ? "; " : "", kept.op->traits.qualified_name, ", call ", kept.ordinal,
                               unitSuffix(kept.unit, !kept.offloaded.empty()));
  }
  return c10::str(
      "sac: ", site.label(), " held the outputs of ", unserved.size(), " call", unserved.size() > 1 ? "s" : "", " (",
      unserved_bytes,
      " bytes) from its forward to its backward, and its recompute never asked for them: ", unserved_names,
      unserved.size() > 8 ? "; ..." : "",
      ". Those calls ran again. The recompute named them differently from the forward: an argument came from a "
      "tensor the region cannot name, made outside its intercepted calls (a constant built without the "
      "dispatcher, a value a cache kept from the forward, a copy made outside the region). sac_plugin.audit() "
      "counts them per op (never_served); warned once per checkpoint site");
}

void KeptOutputStore::consumeAll() {
  for (auto& [key, kept] : entries_) {
    drop(kept);
    kept.consumed = true;
  }
  storages_.clear();
}

void KeptOutputStore::releaseAll() {
  for (auto& [call, kept] : entries_) drop(kept);
  entries_.clear();
  storages_.clear();
}

int64_t KeptOutputStore::bytes() const {
  HashSet<const void*> storages;
  int64_t bytes = 0;
  for (const at::Tensor& tensor : tensors()) {
    if (!tensor.has_storage()) continue;
    if (storages.insert(tensor.storage().unsafeGetStorageImpl()).second) {
      bytes += static_cast<int64_t>(tensor.storage().nbytes());
    }
  }
  return bytes;
}

std::vector<at::Tensor> KeptOutputStore::tensors() const {
  std::vector<at::Tensor> tensors;
  for (const auto& [key, kept] : entries_) {
    for (const c10::IValue& value : kept.outputs) {
      forEachTensor(value, [&](const at::Tensor& tensor) {
        if (tensor.defined()) tensors.push_back(tensor);
      });
    }
  }
  return tensors;
}

int64_t KeptOutputStore::calls() const {
  int64_t calls = 0;
  for (const auto& [key, kept] : entries_) calls += kept.outputs.empty() ? 0 : 1;
  return calls;
}

}  // namespace sac
