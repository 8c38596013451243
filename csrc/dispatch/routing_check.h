#pragma once
// What a region's forward routed, where its policy lets the recompute route again (pin_routing
// off), so that a recompute that routes otherwise stops at the call that differs (NOTE: [Unpinned
// routing must repeat itself] in routing_check.cpp).

#include <ATen/core/stack.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ops/hash_containers.h"
#include "ops/op_catalog.h"

namespace sac {

class RoutingCheck {
 public:
  // Forward: what the routing call with data-flow identity `call` returned (the last
  // `num_returns` values on `stack`).
  void note(const OpEntry& op, uint64_t call, const torch::jit::Stack& stack, size_t num_returns);
  // Recompute: whether the forward noted `call`, not yet checked in this pass.
  bool expects(uint64_t call) const;
  // Recompute: throws a c10::Error naming `where` (the region: its layer), the op, both results
  // and the fix when the recompute's call returned other sizes or host values than the forward's.
  void check(uint64_t call, const torch::jit::Stack& stack, size_t num_returns, const std::string& where);
  // Routing calls of the forward the recompute has not checked yet: while any is left, the
  // recompute names its calls (NOTE: [The recompute after the last kept call] in kept_outputs.cpp).
  size_t pending() const { return pending_; }
  // A new recompute checks every noted call again.
  void beginRecompute();
  void clear();

 private:
  // What a routing call returned, in a form that costs no device sync: each output's sizes, and
  // for values already on the host (CPU tensors, scalars) a hash of their contents.
  struct Routed {
    const OpEntry* op = nullptr;
    uint32_t ordinal = 0;  // 1-based, among the forward's routing calls of the op (for messages)
    std::vector<std::vector<int64_t>> sizes;
    uint64_t host_values = 0;
    bool checked = false;
  };
  static Routed describe(const torch::jit::Stack& stack, size_t num_returns);

  HashMap<uint64_t, Routed> calls_;
  HashMap<const OpEntry*, uint32_t> per_op_;
  size_t pending_ = 0;
};

}  // namespace sac
