#include "dispatch/region.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

#include "dispatch/ivalue_tensors.h"
#include "dispatch/sac_key.h"
#include "dispatch/storage_copy.h"
#include "dispatch/thread_state.h"
#include "ops/hash_containers.h"
#include "ops/user_warning.h"
#include "policy/offload_rule.h"

// Declared here rather than through torch/csrc/autograd/graph_task.h, whose include tree
// would triple this file's build time; both are exported from libtorch_cpu.
namespace torch::autograd {
TORCH_API bool get_current_graph_task_keep_graph();
TORCH_API int get_current_graph_task_id();
}  // namespace torch::autograd

namespace sac {

bool inAutogradGraphTask() { return torch::autograd::get_current_graph_task_id() >= 0; }

bool currentBackwardKeepsGraph() {
  // Outside a graph task (a recompute forced by hand) there is no later backward to serve.
  return inAutogradGraphTask() && torch::autograd::get_current_graph_task_keep_graph();
}

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

std::string unitSuffix(UnitId unit, bool offloaded) {
  const char* how = offloaded ? "offloaded" : "kept";
  return unit == kNoUnit ? std::string(" (") + how + " by the op list)"
                         : std::string(" (") + how + " in unit '" + unitName(unit) + "')";
}

// The region on this thread whose forward offloaded something and ended last: the next region
// to offload links to it (Region::offloaded_before_). Weak: it keeps no resource alive.
thread_local std::optional<c10::weak_intrusive_ptr<Region>> last_offloading_region;

}  // namespace

namespace {
std::atomic<int64_t> live_regions{0};
}  // namespace

struct Region::WeakLink {
  c10::weak_intrusive_ptr<Region> region;
};

Region::Region(std::shared_ptr<Site> site) : site_(std::move(site)) {
  TORCH_CHECK(site_ != nullptr, "sac: a region needs a checkpoint site");
  // NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp): a policy that
  // keeps nothing still intercepts a layer that writes outside state, or may.
  intercepts_ = !site_->policy().keepsNothing() || site_->mayWriteOutside();
  live_regions.fetch_add(1, std::memory_order_relaxed);
}

Region::Region(std::shared_ptr<const Policy> policy) : Region(std::make_shared<Site>(std::move(policy))) {}

Region::Region(std::shared_ptr<const Policy> policy, std::shared_ptr<CallProfile> profile)
    : Region(std::make_shared<Site>(std::move(policy))) {
  profile_ = std::move(profile);
  intercepts_ = intercepts_ || profile_ != nullptr;
}

Region::~Region() { releaseHeld(); }

void Region::release_resources() { releaseHeld(); }

// NOTE: [A region owns what it holds]: everything goes at once, whichever way the region dies.
void Region::releaseHeld() {
  if (released_) return;
  released_ = true;
  for (auto& [call, kept] : kept_) drop(kept);
  kept_.clear();
  kept_storages_.clear();
  inputs_.drop(/*consumed=*/false);
  routing_.clear();
  outside_writes_.clear();
  offloaded_before_.reset();
  inputs_owner_.reset();
  enclosing_.reset();
  enclosing_in_recompute_.reset();
  names_for_nested_.clear();
  live_regions.fetch_sub(1, std::memory_order_relaxed);
}

int64_t Region::liveCount() { return live_regions.load(std::memory_order_relaxed); }

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

void Region::keep(const OpEntry& op, uint64_t call, const Decision& decision, const torch::jit::Stack& stack,
                  size_t num_returns, uint32_t ordinal) {
  const UnitId unit = decision.unit;
  auto [it, inserted] = kept_.try_emplace(call);
  // Identities are unique within a pass; a repeat would be a 64-bit hash collision: keep the
  // first and let the second run again in the recompute.
  if (!inserted) return;
  KeptOutputs& kept = it->second;
  kept.op = &op;
  kept.unit = unit;
  kept.ordinal = ordinal != 0 ? ordinal : nextKeptOrdinal(op);
  kept.position = forward_position_;
  kept.outputs.reserve(num_returns);
  const int64_t pending = pendingVersionBumps(op);
  for (size_t i = stack.size() - num_returns; i < stack.size(); ++i) {
    kept.outputs.push_back(detachedValue(stack[i]));
    forEachTensor(stack[i], [&](const at::Tensor& tensor) {
      int64_t version = versionOf(tensor);
      kept.versions.push_back(version < 0 ? version : version + pending);
      if (tensor.defined() && tensor.has_storage()) {
        kept_storages_[tensor.storage().unsafeGetStorageImpl()].push_back(call);
      }
    });
  }
  if (decision.outcome == Outcome::kOffload) offload(kept);
}

// NOTE: [Offloading a layer's inputs] (offload.cpp)
std::vector<bool> Region::holdInputs(const std::vector<at::Tensor>& inputs, const std::vector<std::string>& names,
                                     std::string* notice) {
  // NOTE: [A checkpoint replayed by the recompute around it holds nothing]: nothing recomputes it.
  // Its inputs are answered as offloaded, so that none is named as staying on its device.
  if (replays_only_) {
    TORCH_CHECK_VALUE(inputs.size() == names.size(), "sac: holding a region's inputs needs one name per input, got ",
                      inputs.size(), " inputs and ", names.size(), " names");
    return std::vector<bool>(inputs.size(), true);
  }
  std::vector<bool> offloaded = inputs_.hold(inputs, names, flow_, *site_, notice);
  any_offloaded_ = any_offloaded_ || inputs_.anyOffloaded();
  return offloaded;
}

std::vector<at::Tensor> Region::takeInputs() { return inputs_.take(flow_, !consume_served_); }

c10::intrusive_ptr<Region> Region::inputsOwner() {
  if (inputs_owner_ != nullptr) {
    c10::intrusive_ptr<Region> owner = inputs_owner_->region.lock();
    TORCH_CHECK(owner, "sac: the region that holds this region's inputs is gone");
    return owner;
  }
  return c10::intrusive_ptr<Region>::reclaim_copy(this);
}

Region* Region::decidingRegion() {
  if (inputs_owner_ == nullptr) return this;
  return inputs_owner_->region.lock().get();  // the dispatch-mode engine's region owns it meanwhile
}

void Region::delegateInputsTo(const c10::intrusive_ptr<Region>& owner) {
  if (owner.get() == this) return;
  inputs_owner_ = std::make_unique<WeakLink>(WeakLink{c10::weak_intrusive_ptr<Region>(owner)});
}

int64_t Region::offloadedInputBytes() const { return inputs_.offloadedBytes(); }

int64_t Region::offloadedInputs() const { return inputs_.offloadedCount(); }

// NOTE: [Kept outputs written in the forward]
// A kept output that the checkpointed function itself later writes, in place or as an out=
// argument (an in-place activation, a mask added into attention scores, an in-place collective
// on a buffer made inside a kept unit, x.view(...).add_(), torch.sin(y, out=y)), cannot be
// served as it is: the recompute would apply the write a second time to an already-written
// value. torch's SAC raises an error at backward. We preserve the value instead: before the
// writing kernel runs, the region copies the storage (once, made below every mode) and stores
// every kept output living in it as the same view of the copy, so outputs that shared the
// storage still share one; for an offloaded output it makes the compute stream wait until the
// copy to the host is done. The recompute is served the value the call made and applies the
// write again, so a backward that keeps its graph is served views of a copy of the region's
// copy, made once per pass. A write after the forward is another matter: serve() finds it by
// the version counter and raises, naming the op.
// Why preserve rather than recompute: whether the forward writes can depend on whether a
// Python mode is on. F.linear on a 3-D input adds its bias in place into its mm's output only
// without one (torch decomposes it out of place under any dispatch mode), so recomputing written
// outputs would make the native engine recompute an mm that the dispatch-mode engine, a trace
// or a user's FlopCounterMode sees served. Preserved, the same calls are served either way, and
// the copy holds the bytes the mode's out-of-place add holds.
// Outputs that cannot be copied this way (one in a tensor list, outputs of two element types in
// one storage, a tensor subclass) are not: their calls are released and recomputed. Nor is a
// storage a kept view op's output lives in: the view's call did not make it, and the forward
// may fill it by calls its recompute does not make again (FSDP2 all-gathers into the buffer its
// parameter views point into in the forward only), where a copy from before the write would
// serve what was never read; recomputed, the view reads the storage as the recompute finds it.

void Region::preserveKeptOutputsIn(const std::vector<WrittenStorage>& written) {
  for (const WrittenStorage& write : written) {
    auto found = kept_storages_.find(write.storage.unsafeGetStorageImpl());
    if (found == kept_storages_.end()) continue;
    if (!preserveBeforeWrite(found->first, found->second)) {
      for (uint64_t call : found->second) {
        KeptOutputs& kept = kept_.at(call);
        drop(kept);
        kept.released = true;
      }
    }
    kept_storages_.erase(found);
  }
}

bool Region::preserveBeforeWrite(const c10::StorageImpl* storage, c10::ArrayRef<uint64_t> calls) {
  // All checks first: a refusal changes nothing.
  struct DeviceSlot {
    KeptOutputs* kept;
    size_t slot;
    size_t version;  // index in kept->versions
  };
  std::vector<DeviceSlot> on_device;
  std::optional<caffe2::TypeMeta> element_type;            // of the device outputs: one copy, one view type
  std::vector<std::pair<KeptOutputs*, size_t>> offloaded;  // index in kept->offloaded
  HashSet<uint64_t> seen;
  auto in_storage = [storage](const at::Tensor& tensor) {
    return tensor.defined() && tensor.has_storage() && tensor.storage().unsafeGetStorageImpl() == storage;
  };
  for (uint64_t call : calls) {
    if (!seen.insert(call).second) continue;  // one entry per output in the storage
    KeptOutputs& kept = kept_.at(call);
    if (kept.op->traits.is_view) return false;
    size_t version = 0;
    for (size_t slot = 0; slot < kept.outputs.size(); ++slot) {
      const c10::IValue& value = kept.outputs[slot];
      if (value.isTensorList()) {
        bool listed = false;
        forEachTensor(value, [&](const at::Tensor& tensor) {
          listed = listed || in_storage(tensor);
          ++version;  // one stored version per tensor
        });
        if (listed) return false;
        continue;
      }
      if (!value.isTensor()) continue;
      const at::Tensor& tensor = value.toTensor();
      if (in_storage(tensor)) {
        if (!preservableFromWrites(tensor) || element_type.value_or(tensor.dtype()) != tensor.dtype()) return false;
        element_type = tensor.dtype();
        on_device.push_back({&kept, slot, version});
      }
      ++version;
    }
    for (size_t i = 0; i < kept.offloaded_storages.size(); ++i) {
      if (kept.offloaded_storages[i]._unsafe_get_target() == storage) offloaded.emplace_back(&kept, i);
    }
  }
  if (on_device.empty() && offloaded.empty()) return false;
  if (!on_device.empty()) {
    auto preserved = std::make_shared<PreservedStorage>();
    preserved->pristine = copyOfStorage(on_device.front().kept->outputs[on_device.front().slot].toTensor());
    for (const DeviceSlot& at : on_device) {
      at::Tensor view = aliasOver(preserved->pristine, at.kept->outputs[at.slot].toTensor());
      at.kept->versions[at.version] = versionOf(view);
      at.kept->outputs[at.slot] = std::move(view);
      at.kept->preserved.emplace_back(at.slot, preserved);
    }
  }
  if (!offloaded.empty()) {
    std::lock_guard<std::mutex> lock(offload_mutex_);
    for (auto& [kept, index] : offloaded) kept->offloaded[index].second.detachBeforeWrite();
  }
  return true;
}

bool Region::serve(const OpEntry& op, uint64_t call, const c10::OperatorHandle& handle, torch::jit::Stack* stack) {
  auto it = kept_.find(call);
  if (it == kept_.end() || it->second.op != &op || it->second.released) return false;
  KeptOutputs& kept = it->second;
  const std::string& name = op.traits.qualified_name;
  TORCH_CHECK(!kept.consumed, "sac: the kept output of ", name, unitSuffix(kept.unit, !kept.offloaded.empty()),
              ", call ", kept.ordinal,
              " of this region, was already used by an earlier backward and freed. Trying to backward an "
              "extra time: a selectively checkpointed region supports a second backward only when the "
              "first runs with retain_graph=True");

  auto check_version = [&](int64_t saved, int64_t now) {
    TORCH_CHECK(saved == now, "sac: a tensor kept for backward was mutated after it was saved: the output of ", name,
                unitSuffix(kept.unit, !kept.offloaded.empty()), ", call ", kept.ordinal,
                " of this region, changed version from ", saved, " to ", now,
                ". The recompute would read the mutated value; clone it before mutating in place, or do not "
                "keep ",
                name);
  };
  size_t position = 0;
  for (const c10::IValue& value : kept.outputs) {
    forEachTensor(value,
                  [&](const at::Tensor& tensor) { check_version(kept.versions[position++], versionOf(tensor)); });
  }
  // NOTE: [Offloading kept outputs] (offload.cpp): checked before the host copy is used.
  KeptValues* outputs = &kept.outputs;
  KeptValues with_offloaded;
  if (!kept.offloaded.empty()) {
    std::lock_guard<std::mutex> lock(offload_mutex_);
    for (const auto& [slot, offloaded] : kept.offloaded) {
      check_version(offloaded.savedVersion(), offloaded.currentVersion());
    }
    with_offloaded = kept.outputs;
    for (auto& [slot, offloaded] : kept.offloaded) with_offloaded[slot] = offloaded.take(!consume_served_);
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
    for (c10::IValue& value : *outputs) results.push_back(consume_served_ ? std::move(value) : detachedValue(value));
    // The recompute writes what it is served again: a backward that keeps its graph is served
    // this pass's copy (NOTE: [Kept outputs written in the forward]).
    if (!consume_served_) {
      for (auto& [slot, preserved] : kept.preserved) {
        if (preserved->working_pass != passes_) {
          PluginCallGuard not_the_models;
          preserved->working = preserved->pristine.clone();
          preserved->working_pass = passes_;
        }
        results[slot] = aliasOver(preserved->working, kept.outputs[slot].toTensor());
      }
    }
  }
  // The outputs go after the arguments, which the engine drops: only it knows whether it owns
  // them (NOTE: [Hot ops skip boxing] in hot_op_kernels.cpp).
  for (c10::IValue& value : results) stack->push_back(std::move(value));

  if (consume_served_) {
    drop(kept);
    kept.consumed = true;
  }
  --left_to_serve_;
  return true;
}

// Each pass gets its own salt, so tensors whose origin cannot be named never match across passes.
void Region::beginForward() {
  flow_.reset(++passes_, site_->callsPerPassHint());
  // NOTE: [A nested checkpoint names its inputs as the outer does] (data_flow.cpp)
  enclosing_.reset();
  const ThreadState::EnclosingPass enclosing = ThreadState::current().decidingRegionAround(this);
  // NOTE: [A checkpoint replayed by the recompute around it holds nothing]
  // torch runs a checkpoint nested in another again when the outer one recomputes, as a new
  // checkpoint whose forward only rebuilds what the outer needs; autograd never goes through it,
  // so nothing recomputes it, and what it kept would be held, unserved, until the outer's
  // recomputed tensors die. It decides as a forward does (the data flow names its calls alike)
  // but holds nothing.
  replays_only_ = enclosing.region != nullptr && enclosing.in_recompute;
  if (Region* around = enclosing.region) {
    around->has_nested_regions_ = true;
    enclosing_ = std::make_unique<WeakLink>(
        WeakLink{c10::weak_intrusive_ptr<Region>(c10::intrusive_ptr<Region>::reclaim_copy(around))});
    flow_.nameExternalsAs(&around->flow_, nullptr);
  }
  forward_position_ = 0;
  routing_.clear();
  // NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp)
  outside_writes_.clear();
  flow_.noteExternalReads();
  dead_calls_.beginForward();
}

void Region::watchSaves() {
  if (!policy().keepsNothing() && !replays_only_ && site_->deadCallsPossible()) dead_calls_.track();
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
int64_t Region::releaseUnreached(int64_t last_saved_position) {
  int64_t released = 0;
  for (auto& [call, kept] : kept_) {
    if (kept.position <= static_cast<uint64_t>(std::max<int64_t>(last_saved_position, 0)) || kept.released ||
        kept.outputs.empty()) {
      continue;
    }
    site_->noteNeverReached(*kept.op, kept.ordinal);
    drop(kept);
    kept.released = true;
    ++released;
  }
  return released;
}

void Region::endForward() {
  calls_per_pass_ = flow_.callsRecorded();
  site_->noteCallsPerPass(calls_per_pass_);
  site_->noteOutsideWrites(outside_writes_.any());
  if (dead_calls_.tracking()) {
    // NOTE: [The recompute runs only what backward needs] (dead_calls.cpp): a checkpoint nested in
    // this one reads what this one's calls make in calls this region does not see.
    if (has_nested_regions_) dead_calls_.noteWhatItCannotFollow();
    const size_t dead = dead_calls_.endForward([this](uint64_t call) {
      auto found = kept_.find(call);
      return found != kept_.end() && !found->second.released && !found->second.outputs.empty();
    });
    site_->noteDeadCalls(dead > 0);
  }
  flow_.reset(++passes_, 0);
  if (any_offloaded_) {
    if (last_offloading_region.has_value()) {
      offloaded_before_ = std::make_unique<WeakLink>(WeakLink{std::move(*last_offloading_region)});
    }
    last_offloading_region.emplace(c10::intrusive_ptr<Region>::reclaim_copy(this));
  }
}

// NOTE: [The recompute after the last kept call]
// A recompute serves each kept output at most once. Counting what is left to serve lets the
// fallback stop naming calls once the count reaches zero: no later call of this pass can be
// served, so its identity and its outputs' records are never read. A consumed entry (an extra
// backward after one without retain_graph) keeps the count above zero, so that the call that
// would have been served still reaches serve() and is told that its output was freed.
void Region::beginRecompute() {
  flow_.reset(++passes_, calls_per_pass_);
  // NOTE: [A nested checkpoint names its inputs as the outer does] (data_flow.cpp)
  if (has_nested_regions_) flow_.retainNamesForNested();
  enclosing_in_recompute_ = enclosing_ != nullptr ? enclosing_->region.lock() : c10::intrusive_ptr<Region>();
  if (enclosing_in_recompute_) flow_.nameExternalsAs(nullptr, &enclosing_in_recompute_->names_for_nested_);
  consume_served_ = !currentBackwardKeepsGraph();
  left_to_serve_ = 0;
  bool any_consumed = false;
  for (const auto& [key, kept] : kept_) {
    left_to_serve_ += kept.outputs.empty() ? 0 : 1;
    any_consumed = any_consumed || (kept.consumed && !kept.released);
  }
  if (any_consumed) left_to_serve_ = SIZE_MAX;
  routing_.beginRecompute();
  dead_calls_.beginRecompute();
  if (!any_offloaded_) return;
  // NOTE: [Offloading kept outputs] (offload.cpp): fetch this region's outputs, then the next's.
  fetchOffloaded();
  if (offloaded_before_ != nullptr) {
    c10::intrusive_ptr<Region> next = offloaded_before_->region.lock();
    offloaded_before_.reset();
    if (next) next->fetchOffloaded();
  }
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
void Region::endRecompute(bool keep_entries) {
  if (has_nested_regions_) names_for_nested_ = flow_.takeNamesForNested();
  flow_.reset(++passes_, 0);
  enclosing_in_recompute_.reset();
  dead_calls_.endRecompute();
  if (keep_entries) return;
  // The unserved entries, by forward position: the message names them in the order they ran.
  std::vector<std::pair<uint64_t, const KeptOutputs*>> unserved;
  int64_t unserved_bytes = 0;
  for (auto& [key, kept] : kept_) {
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
  if (!unserved.empty() && site_->claimNotice(Site::Notice::kHeldNeverServed)) {
    std::sort(unserved.begin(), unserved.end());
    std::string unserved_names;
    for (size_t i = 0; i < unserved.size() && i < 8; ++i) {
      const KeptOutputs& kept = *unserved[i].second;
      unserved_names += c10::str(i > 0 ? "; " : "", kept.op->traits.qualified_name, ", call ", kept.ordinal,
                                 unitSuffix(kept.unit, !kept.offloaded.empty()));
    }
    never_served_notice_ = c10::str(
        "sac: ", site_->label(), " held the outputs of ", unserved.size(), " call", unserved.size() > 1 ? "s" : "",
        " (", unserved_bytes,
        " bytes) from its forward to its backward, and its recompute never asked for them: ", unserved_names,
        unserved.size() > 8 ? "; ..." : "",
        ". Those calls ran again. The recompute named them differently from the forward: an argument came from a "
        "tensor the region cannot name, made outside its intercepted calls (a constant built without the "
        "dispatcher, a value a cache kept from the forward, a copy made outside the region). sac_plugin.audit() "
        "counts them per op (never_served); warned once per checkpoint site");
  }
  if (inputs_.any()) inputs_.drop(/*consumed=*/true);
  for (auto& [key, kept] : kept_) {
    drop(kept);
    kept.consumed = true;
  }
  kept_storages_.clear();
}

int64_t Region::keptBytes() const {
  HashSet<const void*> storages;
  int64_t bytes = 0;
  for (const at::Tensor& tensor : keptTensors()) {
    if (!tensor.has_storage()) continue;
    if (storages.insert(tensor.storage().unsafeGetStorageImpl()).second) {
      bytes += static_cast<int64_t>(tensor.storage().nbytes());
    }
  }
  return bytes;
}

std::vector<at::Tensor> Region::keptTensors() const {
  std::vector<at::Tensor> tensors;
  for (const auto& [key, kept] : kept_) {
    for (const c10::IValue& value : kept.outputs) {
      forEachTensor(value, [&](const at::Tensor& tensor) {
        if (tensor.defined()) tensors.push_back(tensor);
      });
    }
  }
  return tensors;
}

int64_t Region::keptCalls() const {
  int64_t calls = 0;
  for (const auto& [key, kept] : kept_) calls += kept.outputs.empty() ? 0 : 1;
  return calls;
}

}  // namespace sac
