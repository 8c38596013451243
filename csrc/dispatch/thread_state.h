#pragma once
// Per-thread interception state: a stack of activations (checkpointed regions in their forward
// or recompute, and audits). Each activation saves the whole thread-local dispatch key set on
// entry and restores it on exit, so the plugin's key can never outlive the scope that added it
// (see NOTE: [Restoring the whole key set] in thread_state.cpp).

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>

#include <vector>

#include "diagnostics/op_counters.h"
#include "policy/unit_stack.h"

namespace sac {

class Region;

enum class ActivationKind : uint8_t { kAudit, kForward, kRecompute };

struct Activation {
  ActivationKind kind;
  c10::intrusive_ptr<Region> region;  // null for audits; keeps the region alive while open
  c10::impl::LocalDispatchKeySet saved_keys;
  std::vector<UnitId> saved_units;  // the unit stack to restore on exit
  uint64_t serial = 0;              // unique on this thread: tells a reopened depth from the old one
};

// "an audit", "a checkpointed forward": for messages.
const char* describeActivation(ActivationKind kind);

class ThreadState {
 public:
  static ThreadState& current();

  // Enter returns the depth to pass back to exit, which checks the nesting. A region must be
  // owned by a c10::intrusive_ptr (c10::make_intrusive<Region>): the activation holds a
  // reference until it exits.
  size_t enter(ActivationKind kind, Region* region);
  void exit(ActivationKind kind, Region* region, size_t depth);

  // The innermost region and whether it is in its forward or its recompute.
  Region* region() const { return region_; }
  bool regionInRecompute() const { return region_kind_ == ActivationKind::kRecompute; }
  // The pass to count an op in.
  Phase phase() const;
  size_t depth() const { return stack_.size(); }
  // The serial of the activation open at `depth` (1-based), and whether the activation with that
  // serial is still open there: an enclosing activation exited out of order unwinds it.
  uint64_t serialAt(size_t depth) const { return stack_.at(depth - 1).serial; }
  bool isOpen(size_t depth, uint64_t serial) const {
    return depth >= 1 && depth <= stack_.size() && stack_[depth - 1].serial == serial;
  }

 private:
  void refreshInnermost();

  std::vector<Activation> stack_;
  Region* region_ = nullptr;
  ActivationKind region_kind_ = ActivationKind::kForward;
  bool any_recompute_ = false;
  uint64_t next_serial_ = 1;
};

// RAII form for C++ callers and tests.
class ActivationScope {
 public:
  ActivationScope(ActivationKind kind, Region* region);
  ~ActivationScope();
  ActivationScope(const ActivationScope&) = delete;
  ActivationScope& operator=(const ActivationScope&) = delete;

 private:
  ActivationKind kind_;
  Region* region_;
  size_t depth_;
};

}  // namespace sac
