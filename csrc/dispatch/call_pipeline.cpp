#include "dispatch/call_pipeline.h"

#include "dispatch/call_trace.h"
#include "dispatch/thread_state.h"
#include "ops/op_traits.h"
#include "ops/user_warning.h"
#include "policy/unit_stack.h"

namespace sac {

// NOTE: [One call pipeline]
// A region's calls reach it from two engines: the native fallback, below autograd in C++, and
// the dispatch-mode engine, a TorchDispatchMode whose kernel call runs in Python. Both hand each
// call to these two functions, so what is decided, held and served never depends on the engine;
// the engines differ only in where they sit and in how they run the kernel and count it.
// Before the kernel (beginCall):
//   1. a view the policy does not name runs unrecorded: the data flow names its output by its
//      base's storage and its geometry, so it needs no record;
//   2. a recompute past its last kept call runs unrecorded (NOTE: [The recompute after the last
//      kept call] in kept_outputs.cpp);
//   3. the storages the call writes are noted; in the forward, kept outputs living in them are
//      preserved: the region holds their value from before the write (NOTE: [Kept outputs
//      written in the forward] in preserved_writes.cpp);
//   4. the call is named by data flow (NOTE: [Matching kept calls by data flow] in data_flow.cpp);
//   5. in the recompute, a kept call is served and its kernel skipped; in the forward, the call is
//      decided by Policy::decide (NOTE: [The keep rule] in policy.cpp) with the facts only the call
//      shows (its call index, whether it draws random numbers, casts a parameter or routes
//      tokens), a selection
//      the rule overrides is warned about once per site, and the forward's position advances.
// After the kernel (finishCall):
//   6. a held call keeps (or offloads) its outputs, unless its site learnt that the recompute
//      never reaches it (NOTE: [Kept outputs the recompute never reaches] in kept_outputs.cpp);
//   7. the outputs are recorded in the data flow, naming the calls that consume them.
// In the recompute, a call nothing the backward needs reads gets stand-in outputs instead of
// running (step 5; NOTE: [The recompute runs only what backward needs] in dead_calls.cpp), and a
// call that runs has any stand-in it reads filled first.

namespace {

// NOTE: [The per-op trace is recorded below Python] (call_trace.h): what became of the call.
// The flag is tested before the phase is read: the phase costs a thread-local lookup per call,
// and calls are traced only while a report watches.
CallStep traced(const OpEntry& op, CallOutcome outcome, CallStep step) {
  if (C10_UNLIKELY(tracingCalls())) detail::traceCallSlow(op, ThreadState::current().phase(), outcome);
  return step;
}

}  // namespace

// The call's outputs (the last `num_returns` values on `stack`) now originate from it; a
// parameter cast's output is named by what it casts (NOTE: [A parameter cast is named by what it
// casts] in data_flow.cpp).
void recordOutputs(DataFlow& flow, CallInFlight& call, const c10::FunctionSchema& schema,
                   const torch::jit::Stack& stack, size_t num_returns) {
  flow.recordCall(call.identity, schema, stack, num_returns, call.written);
  if (C10_UNLIKELY(call.casts_a_parameter)) {
    call.casts_a_parameter = false;
    if (num_returns == 1 && stack.back().isTensor()) {
      const at::Tensor& cast = stack.back().toTensor();
      flow.nameParameterCast(cast, DataFlow::parameterCastName(call.cast_source, cast.scalar_type()));
    }
    call.cast_source.reset();
  }
}

bool nameCall(Region& region, bool in_recompute, const OpEntry& op, torch::jit::Stack* stack, size_t num_arguments,
              std::optional<int64_t> naming_key, CallInFlight* call) {
  // NOTE: [A small constant is named by its value] (data_flow.cpp)
  if (C10_UNLIKELY(op.traits.is_lift_fresh)) region.flow().nameFreshConstant((*stack)[stack->size() - num_arguments]);
  if (op.traits.is_view && !region.policy().namesOp(op)) return false;
  if (in_recompute && !region.servesMore()) return false;

  const c10::IValue* arguments = &(*stack)[stack->size() - num_arguments];
  call->op = &op;
  call->hold = false;
  call->casts_a_parameter = C10_UNLIKELY(op.traits.is_copy_cast) && castsAParameter(op.traits, arguments);
  if (C10_UNLIKELY(call->casts_a_parameter)) call->cast_source = arguments[0].toTensor();
  call->routing = CallInFlight::RoutingStep::kNone;
  call->written.clear();
  if (C10_UNLIKELY(op.traits.mutates_inputs || op.traits.writes_out_arguments)) {
    call->written = writtenStorages(op.traits, arguments);
    if (!in_recompute) {
      region.preserveKeptOutputsIn(call->written);  // in place and out= writes alike
      // NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp)
      region.outsideWrites().noteForward(region.flow(), op, arguments, call->written, region.site().label());
    }
  }
  DataFlow& flow = region.flow();
  if (C10_UNLIKELY(naming_key.has_value())) {  // the dispatch-mode engine only
    stack->emplace_back(*naming_key);
    call->identity = flow.identify(op, &(*stack)[stack->size() - num_arguments - 1], num_arguments + 1);
    stack->pop_back();
  } else {
    call->identity = flow.identify(op, arguments, num_arguments);
  }
  return true;
}

bool redirectsOutsideWrites(const Region* region, bool in_recompute) {
  if (region != nullptr && in_recompute && region->outsideWrites().any()) return true;
  for (const ThreadState::EnclosingPass& pass : ThreadState::current().enclosingPasses()) {
    if (pass.in_recompute && pass.region->outsideWrites().any()) return true;
  }
  return false;
}

// NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp): the regions around
// the innermost one first, in their own passes (a nested checkpoint that the outer recompute runs
// again is a forward of its own, whose writes the outer keeps from the tensors outside it).
void redirectOutsideWrites(Region* region, bool in_recompute, const OpEntry& op, torch::jit::Stack* stack,
                           size_t num_arguments) {
  c10::IValue* arguments = &(*stack)[stack->size() - num_arguments];
  for (const ThreadState::EnclosingPass& pass : ThreadState::current().enclosingPasses()) {
    if (pass.in_recompute && pass.region->outsideWrites().any()) {
      pass.region->outsideWrites().redirect(pass.region->flow(), op, arguments, num_arguments, pass.region->pass());
    }
  }
  if (region != nullptr && in_recompute && region->outsideWrites().any()) {
    region->outsideWrites().redirect(region->flow(), op, arguments, num_arguments, region->pass());
  }
}

// NOTE: [A checkpoint nested in another is named by the outer too]
// A checkpoint called inside another's function is a region of its own, innermost while it runs:
// it decides and holds its calls, and the outer region sees none of them. But the outer's calls
// after it read what it returned, and the outer's recompute runs the nested checkpoint again as
// a new region whose outputs are new storages (torch recomputes nested checkpoints as it meets
// them). Named by storage, those outputs would differ between the outer's two passes and no
// outer kept call reading them would be served. So every region open around the innermost one
// that holds anything also names each call the nested region runs, in its own data flow, as it
// names its own calls: its two passes name the nested calls alike, and the outer's kept calls
// that read them match. The outer decides and holds none of them (rule: a saved tensor belongs
// to the innermost checkpoint), but a write they make to a storage an outer kept output lives in
// is seen, and the kept output preserved (NOTE: [Kept outputs written in the forward] in
// preserved_writes.cpp).
void EnclosingCalls::begin(const OpEntry& op, torch::jit::Stack* stack, size_t num_arguments,
                           std::optional<int64_t> naming_key) {
  for (const ThreadState::EnclosingPass& pass : ThreadState::current().enclosingPasses()) {
    calls_.emplace_back();
    calls_.back().first = pass.region;
    if (!nameCall(*pass.region, pass.in_recompute, op, stack, num_arguments, naming_key, &calls_.back().second)) {
      calls_.pop_back();
    }
  }
}

void EnclosingCalls::finish(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t num_returns) {
  for (auto& [region, call] : calls_) recordOutputs(region->flow(), call, schema, stack, num_returns);
  calls_.clear();
}

CallStep beginCall(Region& region, bool in_recompute, const OpEntry& op, const c10::OperatorHandle& handle,
                   torch::jit::Stack* stack, size_t num_arguments, std::optional<int64_t> naming_key, bool draws_random,
                   CallInFlight* call) {
  if (!nameCall(region, in_recompute, op, stack, num_arguments, naming_key, call)) {
    if (C10_UNLIKELY(in_recompute && region.deadCalls().skippedAny()) && !op.traits.is_view) {
      region.deadCalls().materializeReadsOf(op, &(*stack)[stack->size() - num_arguments], num_arguments,
                                            region.site().label());
    }
    return traced(op, CallOutcome::kRecomputed, CallStep::kRunOnly);
  }
  const Policy& policy = region.policy();
  const c10::FunctionSchema& schema = handle.schema();
  const c10::IValue* arguments = &(*stack)[stack->size() - num_arguments];
  DataFlow& flow = region.flow();

  if (in_recompute) {
    if (!region.serve(op, call->identity, handle, stack)) {
      // NOTE: [The recompute runs only what backward needs] (dead_calls.cpp)
      DeadCalls& dead = region.deadCalls();
      if (C10_UNLIKELY(dead.any()) && dead.skip(op, handle, call->identity, stack, num_arguments)) {
        flow.recordCall(call->identity, schema, *stack, schema.returns().size(), call->written);
        return traced(op, CallOutcome::kSkipped, CallStep::kSkipped);
      }
      if (C10_UNLIKELY(dead.skippedAny())) dead.materializeReadsOf(op, arguments, num_arguments, region.site().label());
      if (C10_UNLIKELY(region.routing().pending() > 0) && region.routing().expects(call->identity)) {
        call->routing = CallInFlight::RoutingStep::kCheck;
      }
      return traced(op, CallOutcome::kRecomputed, CallStep::kRunAndFinish);
    }
    flow.recordCall(call->identity, schema, *stack, schema.returns().size(), call->written);
    return traced(op, CallOutcome::kServed, CallStep::kServed);
  }

  CallFacts facts;
  facts.draws_random = draws_random;
  facts.casts_a_parameter = call->casts_a_parameter;
  facts.routes_tokens = routesTokens(op.traits, arguments);
  const std::vector<UnitId>& open_units = UnitStack::current().units();
  if (policy.countsCalls(op, open_units)) facts.call_index = region.nextCallIndex(op);
  call->decision = policy.decide(op, open_units, facts);
  if (C10_UNLIKELY(facts.routes_tokens) && !policy.pinsRouting() && !policy.keepsNothing()) {
    call->routing = CallInFlight::RoutingStep::kNote;
  }
  if (C10_UNLIKELY(call->decision.mutating_in_kept_unit || call->decision.random_call_of_kept_op)) {
    warnAboutRecomputedSelection(region.site(), op, call->decision);
  }
  region.advancePosition();
  if (call->decision.held) {
    call->kept_ordinal = region.nextKeptOrdinal(op);
    call->hold = !region.site().neverReached(op, call->kept_ordinal) && !region.replaysOnly();
  }
  // NOTE: [The recompute runs only what backward needs] (dead_calls.cpp): what it reads, before
  // the kernel consumes its arguments.
  if (C10_UNLIKELY(region.deadCalls().tracking())) {
    const bool may_skip = !draws_random && !call->casts_a_parameter && !facts.routes_tokens;
    region.deadCalls().noteInputs(op, call->identity, may_skip, arguments, num_arguments, call->written);
  }
  const CallOutcome outcome = !call->hold                                   ? CallOutcome::kRecomputed
                              : call->decision.outcome == Outcome::kOffload ? CallOutcome::kOffloaded
                                                                            : CallOutcome::kKept;
  return traced(op, outcome, CallStep::kRunAndFinish);
}

void finishCall(Region& region, CallInFlight& call, const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                size_t num_returns) {
  if (call.hold) region.keep(*call.op, call.identity, call.decision, stack, num_returns, call.kept_ordinal);
  if (C10_UNLIKELY(call.routing == CallInFlight::RoutingStep::kNote)) {
    region.routing().note(*call.op, call.identity, stack, num_returns);
  } else if (C10_UNLIKELY(call.routing == CallInFlight::RoutingStep::kCheck)) {
    call.routing = CallInFlight::RoutingStep::kNone;
    region.routing().check(call.identity, stack, num_returns, region.site().label());
  }
  call.routing = CallInFlight::RoutingStep::kNone;
  if (C10_UNLIKELY(region.deadCalls().tracking())) {
    region.deadCalls().noteOutputs(schema, stack, num_returns, call.written);
  }
  recordOutputs(region.flow(), call, schema, stack, num_returns);
  call.hold = false;
}

// NOTE: [What the rule recomputes by design is logged, not warned] (ops/user_warning.h)
void warnAboutRecomputedSelection(Site& site, const OpEntry& op, const Decision& decision) {
  if (!site.claimWarning(op)) return;
  if (decision.mutating_in_kept_unit) {
    logInfo("sac: ", op.traits.qualified_name, " mutates an input inside kept unit '", unitName(decision.unit),
            "'; it is recomputed rather than kept (said once per checkpoint site)");
  } else {
    logInfo("sac: ", op.traits.qualified_name,
            " is called with dropout_p > 0 and draws random numbers; it is recomputed rather than kept, so that "
            "the recompute draws the same numbers (said once per checkpoint site)");
  }
}

}  // namespace sac
