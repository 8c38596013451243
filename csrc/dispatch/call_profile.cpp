#include "dispatch/call_profile.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

#include "dispatch/ivalue_tensors.h"
#include "dispatch/region.h"
#include "dispatch/storage_copy.h"
#include "ops/hash_containers.h"
#include "ops/op_catalog.h"
#include "ops/op_traits.h"
#include "policy/policy.h"

namespace sac {

// NOTE: [Profiling a region]
// A profiling region is a region whose policy keeps nothing but which still intercepts, so the
// fallback sees every call a checkpointed forward would make, under the same rules: calls from
// inside a kernel, metadata queries, meta tensors and calls a Python handler below our key owns
// (torch 2.11) never reach it, exactly as they never reach a policy. Each call is numbered with
// Region::nextCallIndex, the counter kept-call and every-nth rules use, so a plan's indices are
// the indices the policy that executes it will count. The kernel runs once, as it would without
// profiling: never again for timing, because repeating a random or mutating call would change
// results. Instead the layer's forward runs several times (Python drives the runs) and each
// call's time is the median over them. Time is read around the redispatch: std::chrono's
// steady clock on CPU; on a CUDA tensor a timing event pair on the current stream, through
// c10::Event and the device guard the CUDA library registers (no CUDA header or link here),
// synchronised after the call, which is acceptable while profiling and never happens otherwise.
//
// A profile offers only calls the runtime would serve, at the bytes it would hold:
//   - a call whose new output the forward later writes (in place or as an out= argument, seen
//     through the same writtenStorages the fallback reads) is offered at its output's bytes when
//     the runtime would hold a copy from before the write, and not offered when it would
//     recompute the call instead (NOTE: [Kept outputs written in the forward] in preserved_writes.cpp).
//     F.linear on a 3-D input, without a Python mode, adds its bias in place into its mm's
//     output;
//   - a new output the layer returns costs nothing when kept, the caller holding it anyway,
//     unless the forward writes it later;
//   - a call after the point where the recompute stops is not offered (Python notes that point,
//     NOTE: [Where the recompute stops] in planner/_profile.py): the runtime never holds it
//     (NOTE: [Kept outputs the recompute never reaches] in kept_outputs.cpp).

namespace {

bool onCuda(const c10::IValue* arguments, size_t count, c10::Device* device) {
  bool found = false;
  for (size_t i = 0; i < count && !found; ++i) {
    forEachTensor(arguments[i], [&](const at::Tensor& tensor) {
      if (!found && tensor.defined() && tensor.device().is_cuda()) {
        *device = tensor.device();
        found = true;
      }
    });
  }
  return found;
}

double timeOnCuda(c10::Device device, c10::function_ref<void()> run_kernel) {
  const c10::impl::DeviceGuardImplInterface* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Stream stream = guard->getStream(device);
  // BACKEND_DEFAULT creates CUDA events with timing enabled (PYTORCH_DEFAULT disables it).
  c10::Event start(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  c10::Event end(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  start.record(stream);
  run_kernel();
  end.record(stream);
  end.synchronize();
  return start.elapsedTime(end) / 1000.0;  // elapsedTime is in milliseconds; profiles count seconds
}

}  // namespace

const char* whyNotKeepable(const OpEntry& op, const CallFacts& call) {
  Decision named = Policy::decideNamed(op, call);
  if (!named.held) return reasonText(named.reason);
  // A plan keeps calls for the storage they create. A view creates none and would pin its base;
  // an out= op writes storage its caller allocated. Neither is offered, though a policy naming
  // one keeps it.
  if (op.traits.is_view) return "view";
  if (op.traits.writes_out_arguments) return "out= op";
  return "";
}

void CallProfile::beginRun() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_run_, "sac: a profile run is already open; end it first");
  in_run_ = true;
  position_ = 0;
}

void CallProfile::endRun() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_run_, "sac: no profile run is open");
  in_run_ = false;
  if (mismatch_.empty() && runs_ > 0 && position_ != calls_.size()) {
    mismatch_ = "run " + std::to_string(runs_ + 1) + " made " + std::to_string(position_) +
                " calls where the first made " + std::to_string(calls_.size());
  }
  ++runs_;
  TORCH_CHECK(mismatch_.empty(), "sac: the layer made different calls in two profiling runs (", mismatch_,
              "); a profile needs a forward that makes the same calls every time it runs after a warm-up");
}

void CallProfile::profileCall(Region& region, const OpEntry& op, const c10::FunctionSchema& schema,
                              torch::jit::Stack* stack, c10::function_ref<void()> run_kernel) {
  const size_t num_arguments = schema.arguments().size();
  const size_t num_returns = schema.returns().size();
  const c10::IValue* arguments = &(*stack)[stack->size() - num_arguments];
  ProfiledCall call;
  call.op = &op;
  call.index = region.nextCallIndex(op);
  const std::vector<UnitId>& units = UnitStack::current().units();
  call.unit = units.empty() ? UINT32_MAX : units.back();
  CallFacts facts;
  facts.draws_random = drawsRandomNumbers(op.traits, arguments);
  facts.casts_a_parameter = castsAParameter(op.traits, arguments);
  call.not_keepable = whyNotKeepable(op, facts);
  std::vector<WrittenStorage> written;
  if (op.traits.mutates_inputs || op.traits.writes_out_arguments) written = writtenStorages(op.traits, arguments);
  HashSet<const c10::StorageImpl*> seen;
  for (size_t i = 0; i < num_arguments; ++i) {
    forEachTensor(arguments[i], [&](const at::Tensor& tensor) {
      if (tensor.defined() && tensor.has_storage()) seen.insert(tensor.storage().unsafeGetStorageImpl());
    });
  }

  c10::Device device(c10::DeviceType::CPU);
  double seconds = 0;
  if (onCuda(arguments, num_arguments, &device)) {
    seconds = timeOnCuda(device, run_kernel);
  } else {
    auto start = std::chrono::steady_clock::now();
    run_kernel();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  bool aliases_an_input = false;
  std::vector<const c10::StorageImpl*> preservable;
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    forEachTensor((*stack)[i], [&](const at::Tensor& tensor) {
      if (!tensor.defined() || !tensor.has_storage()) return;
      if (seen.insert(tensor.storage().unsafeGetStorageImpl()).second) {
        const auto bytes = static_cast<int64_t>(tensor.storage().nbytes());
        call.output_bytes += bytes;
        call.storages.emplace_back(tensor.storage().getWeakStorageImpl(), bytes);
        if (preservableFromWrites(tensor)) preservable.push_back(tensor.storage().unsafeGetStorageImpl());
      } else {
        aliases_an_input = true;
      }
    });
  }
  // Keeping an output that shares an input's storage would pin that storage, whose bytes this
  // call's record does not carry: such calls are not offered to a plan.
  if (aliases_an_input && call.not_keepable[0] == '\0') call.not_keepable = "aliases an input";

  std::lock_guard<std::mutex> lock(mutex_);
  if (!in_run_ || !mismatch_.empty()) return;
  if (runs_ == 0) {
    for (const WrittenStorage& write : written) {
      auto found = made_by_.find(write.storage.unsafeGetStorageImpl());
      if (found == made_by_.end()) continue;
      const bool copied = found->second.size() == 1 && preservable_.count(found->first) != 0;
      for (size_t position : found->second) {
        ProfiledCall& writer_of = calls_[position];
        if (copied) {
          writer_of.written_later = true;
        } else if (writer_of.not_keepable[0] == '\0') {
          writer_of.not_keepable = kWrittenInTheForward;
        }
      }
    }
    for (const auto& storage : call.storages) made_by_[storage.first._unsafe_get_target()].push_back(calls_.size());
    // Two outputs of the call in one storage: the runtime cannot copy one of them alone.
    if (!aliases_an_input) preservable_.insert(preservable.begin(), preservable.end());
    call.seconds.push_back(seconds);
    calls_.push_back(std::move(call));
    return;
  }
  if (position_ >= calls_.size() || calls_[position_].op != &op || calls_[position_].index != call.index) {
    mismatch_ = "call " + std::to_string(position_) + " is " + op.traits.qualified_name + " #" +
                std::to_string(call.index) + " in run " + std::to_string(runs_ + 1) + ", but " +
                (position_ < calls_.size()
                     ? calls_[position_].op->traits.qualified_name + " #" + std::to_string(calls_[position_].index)
                     : std::string("nothing")) +
                " in the first";
    return;
  }
  calls_[position_++].seconds.push_back(seconds);
}

void CallProfile::noteLayerOutputs(const std::vector<uintptr_t>& output_storages) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(runs_ == 1 && !in_run_, "sac: the layer's outputs are noted once, after the first profile run");
  for (uintptr_t storage : output_storages) {
    auto found = made_by_.find(reinterpret_cast<const c10::StorageImpl*>(storage));
    if (found == made_by_.end()) continue;
    for (size_t position : found->second) {
      ProfiledCall& call = calls_[position];
      if (call.written_later) continue;  // the region holds a copy of its own
      for (auto& [storage, bytes] : call.storages) {
        if (storage._unsafe_get_target() != found->first || bytes == 0) continue;
        call.output_bytes -= bytes;
        bytes = 0;
      }
    }
  }
}

std::vector<ProfiledCall> CallProfile::calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_;
}

int64_t CallProfile::recordedInRun() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(runs_ == 0 ? calls_.size() : position_);
}

int64_t CallProfile::runs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return runs_;
}

}  // namespace sac
