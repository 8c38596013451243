#pragma once
// Per-thread interception state: a stack of activations (checkpointed regions in their forward
// or recompute, and audits). An activation that adds the plugin's key to the thread-local
// include set removes exactly that bit on exit, and changes no other bit, so the key can never
// outlive the scope that added it and another owner's bits are never touched (see NOTE: [Only
// our own bit] in thread_state.cpp).

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>

#include <vector>

#include "ops/op_counters.h"
#include "policy/unit_stack.h"

namespace sac {

class Region;

enum class ActivationKind : uint8_t { kAudit, kForward, kRecompute };

struct Activation {
  ActivationKind kind;
  c10::intrusive_ptr<Region> region;  // null for audits; keeps the region alive while open
  bool intercepts;                    // wants the plugin's key in the include set
  bool added_key;                     // found it absent and added it: removes it on exit
  std::vector<UnitId> saved_units;    // the unit stack to restore on exit
  uint64_t serial = 0;                // unique on this thread: tells a reopened depth from the old one
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
  // The regions open around the innermost one that keep or offload anything, outermost first,
  // each with whether it is in its recompute: they name the calls of the checkpoints nested in
  // them (NOTE: [A checkpoint nested in another is named by the outer too] in call_pipeline.cpp).
  struct EnclosingPass {
    Region* region;
    bool in_recompute;
  };
  const std::vector<EnclosingPass>& enclosingPasses() const { return enclosing_; }
  // Whether `region` is open on this thread around the innermost region.
  bool encloses(const Region* region) const;
  // The innermost region open on this thread other than `self` (or `self`'s marker), where it
  // keeps or offloads anything (else a null region), and whether it is in its recompute: the
  // region a checkpoint starting its forward is nested in (NOTE: [A nested checkpoint names its
  // inputs as the outer does] in data_flow.cpp).
  EnclosingPass decidingRegionAround(const Region* self) const;
  // The pass to count an op in.
  Phase phase() const;
  size_t depth() const { return stack_.size(); }
  // Whether calls carrying the key on this thread are ours: an activation of ours wants the
  // key, and the key was not already included by another owner when the first of them began.
  bool intercepts() const { return intercepting_ > 0 && !key_included_by_another_owner_; }
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
  std::vector<EnclosingPass> enclosing_;
  ActivationKind region_kind_ = ActivationKind::kForward;
  bool any_recompute_ = false;
  size_t intercepting_ = 0;
  bool key_included_by_another_owner_ = false;
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
