#pragma once
// Internal to csrc/dispatch: what the native engine does with one call of ours, whichever way the
// call arrived (boxed, through the fallback, or unboxed, through a hot op's kernel: NOTE: [Hot ops
// skip boxing] in hot_op_kernels.cpp). The steps are written once, here; an Invocation supplies
// only where the call's arguments and outputs live and how its kernel runs:
//   - torch::jit::Stack& arguments(): the call's arguments, the last values of a stack;
//   - void runKernel(DispatchKeySet below): runs the kernel with the keys below ours; its outputs
//     are then the last values of that stack;
//   - void served(size_t num_arguments, size_t num_returns): the call pipeline served the call:
//     the outputs follow the arguments on the stack.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

#include "dispatch/call_pipeline.h"
#include "dispatch/call_profile.h"
#include "dispatch/call_trace.h"
#include "dispatch/region.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_traits.h"

namespace sac {

// NOTE: [Redispatching below our key]
// redispatchBoxed uses exactly the key set we pass, while callBoxed would recompute it from
// thread-local state and land here again. Masking with FULL_AFTER keeps every key below ours
// (BackendSelect, then the backend) and drops ours and everything above, which has already run.
inline const c10::DispatchKeySet kBelowSacKey(c10::DispatchKeySet::FULL_AFTER, kSacKey);

// NOTE: [Python below our key (torch 2.11)] in fallback.cpp.
inline const bool kPythonBelowSacKey = kBelowSacKey.has(c10::DispatchKey::Python);

template <class Invocation>
class InterceptedCall {
 public:
  InterceptedCall(const OpEntry& entry, const c10::OperatorHandle& op, c10::DispatchKeySet keys, Invocation& invocation)
      : entry_(entry), op_(op), keys_(keys), invocation_(invocation) {}

  void run() {
    // NOTE: [Meta tensors are not activations]
    // torch.compile traces with fake and meta tensors, and may do so in the middle of an eager
    // region (a compiled submodule compiles on its first call). Those calls carry no data and
    // never run again in the recompute: keeping or counting them would only pollute the region
    // and the audit, so they pass straight through, like metadata queries.
    if (C10_UNLIKELY(entry_.traits.never_counts || keys_.has_backend(c10::BackendComponent::MetaBit))) {
      return runKernel();
    }
    ThreadState& state = ThreadState::current();
    Region* region = state.region();
    const bool python_handles_it = kPythonBelowSacKey && keys_.has(c10::DispatchKey::Python);
    // NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp)
    const bool recompute = state.regionInRecompute();
    if (C10_UNLIKELY((recompute && region != nullptr && region->outsideWrites().any()) ||
                     !state.enclosingPasses().empty()) &&
        !python_handles_it && redirectsOutsideWrites(region, recompute)) {
      redirectOutsideWrites(region, recompute, entry_, &invocation_.ownedArguments(op_),
                            op_.schema().arguments().size());
    }
    // NOTE: [A checkpoint nested in another is named by the outer too] (call_pipeline.cpp)
    if (C10_UNLIKELY(!state.enclosingPasses().empty()) && !python_handles_it) {
      EnclosingCalls enclosing;
      enclosing.begin(entry_, &invocation_.arguments(), op_.schema().arguments().size(), std::nullopt);
      return runInRegion(state, region, python_handles_it, &enclosing);
    }
    runInRegion(state, region, python_handles_it, nullptr);
  }

 private:
  // `enclosing` (null unless the region is nested) names the call's outputs once they are on the
  // stack, before a served call's stack is handed back.
  void runInRegion(ThreadState& state, Region* region, bool python_handles_it, EnclosingCalls* enclosing) {
    const c10::FunctionSchema& schema = op_.schema();
    auto finishEnclosing = [&] {
      if (C10_UNLIKELY(enclosing != nullptr))
        enclosing->finish(schema, invocation_.arguments(), schema.returns().size());
    };
    if (C10_UNLIKELY(region == nullptr || !region->intercepts() || python_handles_it)) {
      if (C10_UNLIKELY(python_handles_it && region != nullptr)) followsNothingOf(*region, state);
      traceCall(entry_, state.phase(), CallOutcome::kRecomputed);  // NOTE: [The per-op trace is recorded below Python]
      countAndRun(state.phase());
      return finishEnclosing();
    }
    if (C10_UNLIKELY(region->profile() != nullptr)) {  // NOTE: [Profiling a region]
      region->profile()->profileCall(*region, entry_, op_.schema(), &invocation_.arguments(),
                                     [&] { countAndRun(state.phase()); });
      return finishEnclosing();
    }

    // NOTE: [One call pipeline] (call_pipeline.cpp)
    const size_t num_arguments = schema.arguments().size();
    torch::jit::Stack& stack = invocation_.arguments();
    const bool recompute = state.regionInRecompute();
    const bool draws_random = !recompute && drawsRandomNumbers(entry_.traits, &stack[stack.size() - num_arguments]);
    CallInFlight call;
    switch (beginCall(*region, recompute, entry_, op_, &stack, num_arguments, std::nullopt, draws_random, &call)) {
      case CallStep::kRunOnly:
        countAndRun(state.phase());
        return finishEnclosing();
      case CallStep::kServed:
        entry_.counters.recordHit();
        finishEnclosing();
        return invocation_.served(num_arguments, schema.returns().size());
      case CallStep::kSkipped:
        entry_.counters.recordSkipped();
        finishEnclosing();
        return invocation_.served(num_arguments, schema.returns().size());
      case CallStep::kRunAndFinish:
        countAndRun(state.phase());
        finishCall(*region, call, schema, invocation_.arguments(), schema.returns().size());
        return finishEnclosing();
    }
  }

  // NOTE: [The recompute runs only what backward needs] (dead_calls.cpp): a call a tensor
  // subclass's handler runs below the key reads what the region cannot follow, so the forward
  // skips nothing; in the recompute, the stand-ins it reads are filled first.
  void followsNothingOf(Region& region, const ThreadState& state) {
    DeadCalls& dead = region.deadCalls();
    if (!state.regionInRecompute()) return dead.noteWhatItCannotFollow();
    if (dead.skippedAny()) {
      const torch::jit::Stack& stack = invocation_.arguments();
      const size_t num_arguments = op_.schema().arguments().size();
      dead.materializeReadsOf(entry_, &stack[stack.size() - num_arguments], num_arguments, region.site().label());
    }
  }

  void runKernel() {
    // NOTE: [Ops called from inside a kernel are not intercepted]
    // A kernel may dispatch further ops (addmm's CPU kernel calls copy_, randn calls normal_).
    // They are part of the op we are running, not calls of the checkpointed function: seeing
    // them would count them twice, warn about copy_ "mutating" in a kept unit, and, worst, let
    // a kept op nested in a kept kernel be numbered in the forward but not in the recompute
    // (where the outer op is served and its kernel never runs), so a later call of the same op
    // would be served the nested call's output. Torch's dispatch modes behave the same way: the
    // mode is off while its handler runs the op.
    c10::impl::ExcludeDispatchKeyGuard not_nested(kSacKey);
    invocation_.runKernel(keys_ & kBelowSacKey);
  }

  void countAndRun(Phase phase) {
    entry_.counters.recordExecution(phase);
    runKernel();
  }

  const OpEntry& entry_;
  const c10::OperatorHandle& op_;
  c10::DispatchKeySet keys_;
  Invocation& invocation_;
};

}  // namespace sac
