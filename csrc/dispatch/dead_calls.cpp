#include "dispatch/dead_calls.h"

#include <ATen/core/function_schema.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "dispatch/ivalue_tensors.h"
#include "dispatch/sac_key.h"
#include "ops/op_catalog.h"
#include "ops/op_traits.h"

namespace sac {

// NOTE: [The recompute runs only what backward needs]
// The recompute exists to rebuild the tensors the forward saved for backward. A call whose
// outputs no saved tensor comes from, and that no call the recompute runs reads, computes nothing
// the backward uses: under tensor parallelism, the all-reduce whose result only feeds a kept
// residual add, which is served. Such a call is dead: the recompute hands it stand-in outputs (the
// same sizes, strides and dtype, NaN where the dtype has one) and does not run it. How the region
// finds them:
//   1. In the forward, every call the region names is noted with the calls that produced what it
//      reads (by storage), and every tensor autograd saves for backward with the call that
//      produced it (checkpointing.py watches torch's checkpoint's pack hook).
//   2. At the end of the forward, from the last call to the first: a call the recompute is served
//      (kept) needs nothing; any other call runs, and so do the calls that produced what it reads,
//      unless it is dead: it writes nothing, draws no random numbers, routes no tokens, casts no
//      parameter, returns only plain tensors, autograd saved none of its outputs, a later call
//      reads one of them (an output no intercepted call reads may be read by code the region
//      cannot see: Python, a Triton kernel), and no call that runs reads any.
//   3. In the recompute, a dead call named as in the forward gets its stand-ins, named as its
//      outputs were, so the kept calls that read them are served as before. Should a call that
//      runs read a stand-in after all (a kept call the recompute could not be served, NOTE:
//      [Served, or named] in kept_outputs.cpp), the dead call is run first and its values written into
//      the stand-in: the recompute never computes from a stand-in. For that, a skipped call's
//      arguments are held until the recompute ends (a collective's are not: it never runs late).
// A collective is dead by the same rule, and skipping one is only sound if every rank skips it:
// the rule reads the program's calls and the policy, the same on every rank running the same
// code, unless that code branched on values. So a forward that read values on the host (an
// `.item()`, a copy to the CPU, an op whose output size depends on its values: the expert loop
// whose ranks get different token counts) skips no collective, and a skipped collective is never
// run late: a call that needs its values after all stops the recompute with an error naming it.
// The calls torch's early stop never reaches (after the last saved tensor) are not its business.
// Only the first forward of a site is watched for free; the site's later forwards are noted only
// where the first found a call to skip (Site::deadCallsPossible), so a layer with none pays nothing.

namespace {

// The returns of a call that can be stood in for: each a fresh plain tensor, a list of them, or
// None, with no alias of an argument.
bool standsIn(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t num_returns) {
  const auto& returns = schema.returns();
  if (num_returns == 0 || returns.size() != num_returns) return false;
  const size_t first = stack.size() - num_returns;
  bool any_tensor = false;
  for (size_t i = 0; i < num_returns; ++i) {
    if (returns[i].alias_info() != nullptr) return false;
    const c10::IValue& value = stack[first + i];
    if (value.isNone()) continue;
    if (!value.isTensor() && !value.isTensorList()) return false;
    bool plain = true;
    forEachTensor(value, [&](const at::Tensor& tensor) {
      plain = plain && tensor.defined() && tensor.has_storage() && !tensor.key_set().has(c10::DispatchKey::Python) &&
              !tensor.is_sparse() && tensor.layout() == c10::kStrided;
      any_tensor = true;
    });
    if (!plain) return false;
  }
  return any_tensor;
}

// A tensor with `geometry` over `storage` (a 1-D tensor over the whole storage), made without a
// dispatch.
template <class Geometry>
at::Tensor over(const at::Tensor& storage, const Geometry& geometry) {
  at::Tensor tensor =
      at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage.storage()), storage.key_set(), storage.dtype());
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(geometry.sizes, geometry.strides, geometry.offset);
  return tensor;
}

template <class Geometry>
at::Tensor standIn(const Geometry& geometry) {
  PluginCallGuard not_the_models;  // NOTE: [The plugin's own calls]
  at::Tensor storage = at::empty({geometry.storage_elements}, geometry.options);
  const c10::ScalarType dtype = geometry.options.dtype().toScalarType();
  if (c10::isFloatingType(dtype) || c10::isComplexType(dtype)) {
    // Read by mistake, a stand-in spreads NaN rather than plausible values.
    storage.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  return over(storage, geometry);
}

}  // namespace

void DeadCalls::beginForward() {
  tracking_ = false;
  cannot_follow_ = false;
  read_values_ = false;
  calls_.clear();
  producers_.clear();
  dead_.clear();
  endRecompute();
}

void DeadCalls::beginRecompute() {
  // A forward that raised before its end found nothing: its records go, and nothing is skipped
  // that was not found.
  if (std::exchange(tracking_, false)) {
    calls_.clear();
    producers_.clear();
  }
  endRecompute();
}

void DeadCalls::noteInputs(const OpEntry& op, uint64_t identity, bool may_skip, const c10::IValue* arguments,
                           size_t num_arguments, const std::vector<WrittenStorage>& written) {
  calls_.emplace_back();
  ForwardCall& call = calls_.back();
  call.op = &op;
  call.identity = identity;
  call.may_skip = may_skip && written.empty() && !op.traits.mutates_inputs && !op.traits.writes_out_arguments &&
                  !op.traits.is_random && !op.traits.is_routing && !op.traits.reads_values_on_host &&
                  // A stand-in is the same allocation: nothing to save.
                  !op.traits.is_uninitialised_allocation;
  if (C10_UNLIKELY(op.traits.reads_values_on_host)) read_values_ = true;
  for (size_t i = 0; i < num_arguments; ++i) {
    forEachTensor(arguments[i], [&](const at::Tensor& tensor) {
      if (!tensor.defined()) return;
      call.from_device = call.from_device || !tensor.device().is_cpu();
      if (!tensor.has_storage()) return;
      auto found = producers_.find(tensor.storage().unsafeGetStorageImpl());
      if (found == producers_.end()) return;
      if (std::find(call.inputs.begin(), call.inputs.end(), found->second) == call.inputs.end()) {
        call.inputs.push_back(found->second);
        calls_[found->second].read = true;
      }
    });
  }
}

void DeadCalls::noteOutputs(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t num_returns,
                            const std::vector<WrittenStorage>& written) {
  if (calls_.empty()) return;
  const auto index = static_cast<uint32_t>(calls_.size() - 1);
  ForwardCall& call = calls_.back();
  call.candidate = call.may_skip && standsIn(schema, stack, num_returns);
  for (const WrittenStorage& write : written) producedBy(write.storage.unsafeGetStorageImpl(), index);
  const size_t first = stack.size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    if (i < schema.returns().size() && schema.returns()[i].alias_info() != nullptr) continue;
    const c10::IValue& value = stack[first + i];
    if (call.candidate) call.outputs.shape.push_back(value.isNone() ? -2 : value.isTensor() ? -1 : 0);
    forEachTensor(value, [&](const at::Tensor& tensor) {
      if (!tensor.defined()) return;
      // A copy to the host (`.item()` on an accelerator, `.tolist()`, `.cpu()`): its values may
      // steer the code that follows.
      if (call.from_device && tensor.device().is_cpu()) read_values_ = true;
      if (!tensor.has_storage()) return;
      producedBy(tensor.storage().unsafeGetStorageImpl(), index);
      if (!call.candidate) return;
      if (value.isTensorList()) ++call.outputs.shape.back();
      Geometry geometry;
      geometry.sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
      geometry.strides.assign(tensor.strides().begin(), tensor.strides().end());
      geometry.offset = tensor.storage_offset();
      geometry.storage_elements = static_cast<int64_t>(tensor.storage().nbytes() / tensor.itemsize());
      geometry.options = tensor.options();
      call.outputs.tensors.push_back(std::move(geometry));
    });
  }
}

void DeadCalls::noteSaved(uintptr_t storage) {
  auto found = producers_.find(reinterpret_cast<const c10::StorageImpl*>(storage));
  if (found != producers_.end()) calls_[found->second].saved = true;
}

size_t DeadCalls::endForward(const std::function<bool(uint64_t)>& served) {
  const bool tracked = std::exchange(tracking_, false);
  if (!tracked || cannot_follow_) {
    calls_.clear();
    producers_.clear();
    return 0;
  }
  std::vector<bool> needed(calls_.size(), false);
  std::vector<bool> dead(calls_.size(), false);
  for (size_t i = calls_.size(); i-- > 0;) {
    const ForwardCall& call = calls_[i];
    if (served(call.identity)) continue;
    const bool may_skip = call.candidate && (!call.op->traits.is_collective || !read_values_);
    if (may_skip && !call.saved && call.read && !needed[i]) {
      dead[i] = true;
      continue;
    }
    if (call.op->traits.only_wraps && !needed[i]) continue;  // runs, but reads nothing
    for (uint32_t input : call.inputs) needed[input] = true;
  }
  // A collective that waits for another (functional collectives' wait_tensor) runs when the one
  // it waits for runs: a collective started and never waited for holds its work forever.
  for (size_t i = 0; i < calls_.size(); ++i) {
    if (!dead[i] || !calls_[i].op->traits.is_collective) continue;
    for (uint32_t input : calls_[i].inputs) {
      if (!dead[input] && calls_[input].op->traits.is_collective) dead[i] = false;
    }
  }
  for (size_t i = 0; i < calls_.size(); ++i) {
    if (dead[i]) dead_.emplace(calls_[i].identity, DeadCall{calls_[i].op, std::move(calls_[i].outputs)});
  }
  calls_.clear();
  producers_.clear();
  return dead_.size();
}

bool DeadCalls::skip(const OpEntry& op, const c10::OperatorHandle& handle, uint64_t identity, torch::jit::Stack* stack,
                     size_t num_arguments) {
  auto found = dead_.find(identity);
  if (found == dead_.end() || found->second.op != &op) return false;
  const Outputs& outputs = found->second.outputs;
  SkippedCall skipped;
  skipped.op = &op;
  skipped.handle = handle;
  skipped.outputs = &outputs;
  if (!op.traits.is_collective) {
    skipped.arguments.assign(stack->end() - static_cast<std::ptrdiff_t>(num_arguments), stack->end());
  }
  const size_t index = skipped_.size();
  size_t next = 0;
  auto make = [&]() {
    at::Tensor tensor = standIn(outputs.tensors[next]);
    c10::weak_intrusive_ptr<c10::StorageImpl> storage = tensor.storage().getWeakStorageImpl();
    stand_ins_.insert_or_assign(tensor.storage().unsafeGetStorageImpl(), StandIn{storage, index});
    skipped.stand_ins.push_back(std::move(storage));
    ++next;
    return tensor;
  };
  for (int32_t shape : outputs.shape) {
    if (shape == -2) {
      stack->emplace_back();
    } else if (shape == -1) {
      stack->emplace_back(make());
    } else {
      c10::List<at::Tensor> list;
      for (int32_t i = 0; i < shape; ++i) list.push_back(make());
      stack->emplace_back(std::move(list));
    }
  }
  skipped_.push_back(std::move(skipped));
  return true;
}

void DeadCalls::materializeReadsOf(const OpEntry& op, const c10::IValue* arguments, size_t num_arguments,
                                   const std::string& label) {
  if (op.traits.only_wraps) return;
  for (size_t i = 0; i < num_arguments; ++i) {
    forEachTensor(arguments[i], [&](const at::Tensor& tensor) {
      if (!tensor.defined() || !tensor.has_storage()) return;
      const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
      auto found = stand_ins_.find(storage);
      if (found == stand_ins_.end()) return;
      // An address is read back only for the storage that had it.
      if (found->second.storage.lock().get() != storage) {
        stand_ins_.erase(found);
        return;
      }
      if (skipped_[found->second.skipped].materialized) return;
      TORCH_CHECK(!skipped_[found->second.skipped].op->traits.is_collective, "sac: the recompute of ", label,
                  " skipped ", skipped_[found->second.skipped].op->traits.qualified_name,
                  " because no call it runs reads its output, but ", op.traits.qualified_name,
                  " reads it: the recompute named a call differently from the forward. A collective is never run "
                  "late (every rank must run it at the same point); run this layer with a policy that keeps nothing "
                  "read from a collective, or report the layer");
      materialize(found->second.skipped, label);
    });
  }
}

void DeadCalls::materialize(size_t index, const std::string& label) {
  SkippedCall& skipped = skipped_[index];
  skipped.materialized = true;
  skipped.op->counters.reclassifySkippedAsExecution();
  // What it reads may stand in for another skipped call: that one first.
  materializeReadsOf(*skipped.op, skipped.arguments.data(), skipped.arguments.size(), label);
  torch::jit::Stack stack = skipped.arguments;
  {
    PluginCallGuard not_the_models;  // NOTE: [The plugin's own calls]
    skipped.handle->callBoxed(stack);
  }
  // Into each stand-in still read: the same sizes and strides, so a plain copy.
  size_t next = 0;
  for (const c10::IValue& value : stack) {
    forEachTensor(value, [&](const at::Tensor& computed) {
      if (next >= skipped.stand_ins.size()) return;
      c10::intrusive_ptr<c10::StorageImpl> alive = skipped.stand_ins[next].lock();
      const auto& geometry = skipped.outputs->tensors[next++];
      if (!alive) return;
      PluginCallGuard not_the_models;
      at::Tensor whole = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(alive)), computed.key_set(),
                                                                  computed.dtype());
      over(whole, geometry).copy_(computed);
    });
  }
  skipped.arguments.clear();
}

void DeadCalls::endRecompute() {
  stand_ins_.clear();
  skipped_.clear();
}

}  // namespace sac
