#pragma once
// The steps every intercepted call of a region goes through, whichever engine hands it over
// (NOTE: [One call pipeline] in call_pipeline.cpp): beginCall before the kernel, finishCall after.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/region.h"
#include "ops/op_catalog.h"
#include "policy/policy.h"

namespace sac {

// What the engine does with the call after beginCall.
enum class CallStep : uint8_t {
  kRunOnly,       // run the kernel; nothing to finish (a view the policy does not name, or a
                  // recompute past its last kept call)
  kRunAndFinish,  // run the kernel, then finishCall with its outputs
  kServed,        // served: the kernel is skipped, the outputs follow the arguments on the stack,
                  // already recorded
  kSkipped,       // dead in the recompute: as kServed, with stand-in outputs (NOTE: [The recompute
                  // runs only what backward needs] in dead_calls.cpp)
};

// A call between beginCall and finishCall.
struct CallInFlight {
  const OpEntry* op = nullptr;
  uint64_t identity = 0;      // its data-flow identity (NOTE: [Matching kept calls by data flow])
  Decision decision;          // the forward's decision
  uint32_t kept_ordinal = 0;  // a held call's 1-based number among the op's held calls
  bool hold = false;          // keep (or offload) its outputs once the kernel has run
  // A cast of a parameter (autocast's weight cast), and the parameter: its output is named by what
  // it casts (NOTE: [A parameter cast is named by what it casts] in data_flow.cpp).
  bool casts_a_parameter = false;
  at::Tensor cast_source;
  // A routing call of a policy that recomputes the routing: the forward notes what it returned,
  // the recompute checks it (NOTE: [Unpinned routing must repeat itself] in routing_check.cpp).
  enum class RoutingStep : uint8_t { kNone, kNote, kCheck } routing = RoutingStep::kNone;
  std::vector<WrittenStorage> written;
};

// Before the kernel. The call's `num_arguments` arguments are the last values on `stack` (in
// schema order; the dispatch-mode engine passes its tensors and None for the rest); `naming_key`,
// when given, names the call together with them (the dispatch-mode engine's fold of the other
// arguments), otherwise the arguments alone do. `draws_random` is whether this call draws from a
// generator (drawsRandomNumbers, which needs every argument). A served call's outputs follow its
// arguments on the stack; the engine drops the arguments.
CallStep beginCall(Region& region, bool in_recompute, const OpEntry& op, const c10::OperatorHandle& handle,
                   torch::jit::Stack* stack, size_t num_arguments, std::optional<int64_t> naming_key, bool draws_random,
                   CallInFlight* call);

// The first steps of beginCall, which name the call in `region`'s data flow: false for a call
// the region leaves unrecorded (a view the policy does not name, a recompute past its last kept
// call), else the call's identity and the storages it writes are in `call`, and in the forward
// the region's kept outputs in those storages are preserved.
bool nameCall(Region& region, bool in_recompute, const OpEntry& op, torch::jit::Stack* stack, size_t num_arguments,
              std::optional<int64_t> naming_key, CallInFlight* call);

// The calls of a nested checkpoint as the regions open around it name them (NOTE: [A checkpoint
// nested in another is named by the outer too] in call_pipeline.cpp): begin before the kernel,
// finish once its outputs are the last `num_returns` values on the stack (run or served).
// Whether a call in `region` (the innermost region, null for none) must be redirected before it
// is named (NOTE: [The recompute writes nothing outside its region] in outside_writes.cpp): the
// region, or a region around it, is recomputing and its forward wrote outside it.
bool redirectsOutsideWrites(const Region* region, bool in_recompute);
// Replaces the call's arguments (the last `num_arguments` values on `stack`) that must not touch
// what they live in by views over the recompute's copies.
void redirectOutsideWrites(Region* region, bool in_recompute, const OpEntry& op, torch::jit::Stack* stack,
                           size_t num_arguments);

// The once-per-site note for a call the rule recomputes although the policy selected it: a
// mutating op inside a kept unit, or a kept op's call that draws random numbers.
void warnAboutRecomputedSelection(Site& site, const OpEntry& op, const Decision& decision);

class EnclosingCalls {
 public:
  void begin(const OpEntry& op, torch::jit::Stack* stack, size_t num_arguments, std::optional<int64_t> naming_key);
  void finish(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t num_returns);
  bool empty() const { return calls_.empty(); }

 private:
  std::vector<std::pair<Region*, CallInFlight>> calls_;
};

// After the kernel ran: holds the outputs of a held call and records the call's outputs (the
// last `num_returns` values on `stack`) in the data flow.
void finishCall(Region& region, CallInFlight& call, const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                size_t num_returns);

}  // namespace sac
