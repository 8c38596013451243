#include "dispatch/thread_state.h"

#include <c10/util/Exception.h>

#include "dispatch/interception.h"
#include "dispatch/region.h"
#include "dispatch/sac_key.h"
#include "ops/per_thread.h"

namespace sac {

// NOTE: [Only our own bit]
// The key may have another owner (NOTE: [Sharing the key with another owner]), which turns the
// same thread-local bit on and off for its own mode. So an activation never restores a snapshot
// of the whole key set, which would undo a bit the other owner set or cleared in between: it
// adds the key only if it is absent, remembers that it did, and on exit clears that one bit and
// nothing else. Nested activations find the key present and leave it alone; misnested exits
// unwind every activation above the one exiting and clear the bit if any of them added it. If
// the key was already included when the first activation began, another owner's mode is on:
// the calls are its own, and this thread's activations do not intercept until they all close.

// NOTE: [Autograd threads inherit the key set]
// The autograd engine captures the caller's ThreadLocalState (the local dispatch key set
// included) when backward starts and installs it on whichever thread evaluates each node: the
// caller's on CPU, a device thread on CUDA. So an audit's key reaches backward ops on every
// thread, with no code here. This activation stack is not part of that state: the recompute
// context enters its own activation on the thread that runs the recompute, and the phase of
// ops there with no activation is read from the thread's current graph task.

namespace {

bool needsInterception(ActivationKind kind, Region* region) {
  // A region whose policy keeps nothing is plain full recompute: it only marks the phase for
  // counters, and ops reach the fallback only if an audit included the key.
  return kind == ActivationKind::kAudit || (region != nullptr && region->intercepts());
}

}  // namespace

const char* describeActivation(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::kAudit:
      return "an audit";
    case ActivationKind::kForward:
      return "a checkpointed forward";
    case ActivationKind::kRecompute:
      return "a checkpointed recompute";
  }
  return "an activation";
}

// One lookup per call: NOTE: [One lookup per thread-local object] in ops/per_thread.h.
ThreadState& ThreadState::current() { return PerThread<ThreadState>::get(); }

size_t ThreadState::enter(ActivationKind kind, Region* region) {
  const bool intercept = needsInterception(kind, region);
  bool added_key = false;
  if (intercept) {
    // Ops defined since the last activation get the coexisting path's kernels before any op of
    // this one runs (a no-op on the native path).
    installKernelsForNewOps();
    const bool included = c10::impl::tls_is_dispatch_key_included(kSacKey);
    if (intercepting_ == 0) key_included_by_another_owner_ = included;
    if (!included) {
      c10::impl::tls_set_dispatch_key_included(kSacKey, true);
      added_key = true;
    }
    ++intercepting_;
  }
  std::vector<UnitId> saved_units;
  UnitStack& units = UnitStack::current();
  if (kind == ActivationKind::kForward) {
    region->setUnitsAroundForward(units.units());
    region->beginForward();
  } else if (kind == ActivationKind::kRecompute) {
    // The recompute re-runs the wrapped function, which re-opens its own units; the units that
    // were open around the checkpoint call in the forward are re-opened here.
    saved_units = units.units();
    units.truncate(0);
    units.pushAll(region->unitsAroundForward());
    region->beginRecompute();
  }
  c10::intrusive_ptr<Region> owner =
      region == nullptr ? c10::intrusive_ptr<Region>() : c10::intrusive_ptr<Region>::reclaim_copy(region);
  stack_.push_back(Activation{kind, std::move(owner), intercept, added_key, std::move(saved_units), next_serial_++});
  refreshInnermost();
  return stack_.size();
}

void ThreadState::exit(ActivationKind kind, Region* region, size_t depth) {
  TORCH_CHECK(depth >= 1 && depth <= stack_.size() && stack_[depth - 1].kind == kind &&
                  stack_[depth - 1].region.get() == region,
              "sac: exiting ", describeActivation(kind), " that is not open on this thread (depth ", depth, ", ",
              stack_.size(), " open); nothing was changed");
  bool in_order = depth == stack_.size();
  // Unwind everything above it as well, so nothing leaks even when scopes were misnested.
  bool clear_key = false;
  for (size_t i = depth - 1; i < stack_.size(); ++i) {
    clear_key = clear_key || stack_[i].added_key;
    intercepting_ -= stack_[i].intercepts ? 1 : 0;
  }
  if (clear_key) c10::impl::tls_set_dispatch_key_included(kSacKey, false);
  if (intercepting_ == 0) key_included_by_another_owner_ = false;
  Activation& target = stack_[depth - 1];
  if (kind == ActivationKind::kRecompute) {
    UnitStack& units = UnitStack::current();
    units.truncate(0);
    units.pushAll(target.saved_units);
    region->endRecompute(/*keep_entries=*/currentBackwardKeepsGraph());
  } else if (kind == ActivationKind::kForward) {
    region->endForward();
  }
  ActivationKind innermost_kind = stack_.back().kind;
  stack_.erase(stack_.begin() + static_cast<std::ptrdiff_t>(depth - 1), stack_.end());
  refreshInnermost();
  TORCH_CHECK(in_order, "sac: ", describeActivation(kind), " exited while ", describeActivation(innermost_kind),
              " inside it was still open; both were closed and the dispatch key set restored");
}

void ThreadState::refreshInnermost() {
  region_ = nullptr;
  any_recompute_ = false;
  enclosing_.clear();
  for (const Activation& activation : stack_) {
    if (!activation.region) continue;
    // The innermost region found so far encloses this activation's: it names the calls of the
    // regions nested in it, if it holds anything.
    if (region_ != nullptr && region_ != activation.region.get() && region_->intercepts() &&
        region_->profile() == nullptr) {
      enclosing_.push_back(EnclosingPass{region_, region_kind_ == ActivationKind::kRecompute});
    }
    region_ = activation.region.get();
    region_kind_ = activation.kind;
    any_recompute_ = any_recompute_ || activation.kind == ActivationKind::kRecompute;
  }
}

ThreadState::EnclosingPass ThreadState::decidingRegionAround(const Region* self) const {
  for (auto activation = stack_.rbegin(); activation != stack_.rend(); ++activation) {
    if (!activation->region) continue;
    Region* deciding = activation->region->decidingRegion();
    if (deciding == self) continue;
    if (deciding == nullptr || !deciding->intercepts() || deciding->profile() != nullptr) break;
    return EnclosingPass{deciding, activation->kind == ActivationKind::kRecompute};
  }
  return EnclosingPass{nullptr, false};
}

bool ThreadState::encloses(const Region* region) const {
  for (size_t i = 0; i + 1 < stack_.size(); ++i) {
    if (stack_[i].region.get() == region && region != region_) return true;
  }
  return false;
}

Phase ThreadState::phase() const {
  if (any_recompute_) return Phase::kRecompute;
  if (region_ != nullptr) return Phase::kForward;
  return inAutogradGraphTask() ? Phase::kBackward : Phase::kForward;
}

ActivationScope::ActivationScope(ActivationKind kind, Region* region)
    : kind_(kind), region_(region), depth_(ThreadState::current().enter(kind, region)) {}

ActivationScope::~ActivationScope() {
  try {
    ThreadState::current().exit(kind_, region_, depth_);
  } catch (const c10::Error&) {
    // Misnested scopes were unwound by exit(); a destructor must not throw.
  }
}

}  // namespace sac
