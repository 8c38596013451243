#include "dispatch/thread_state.h"

#include <c10/util/Exception.h>

#include "dispatch/region.h"
#include "dispatch/sac_key.h"

namespace sac {

// NOTE: [Restoring the whole key set]
// An activation never removes "its" key on exit; it puts back the exact LocalDispatchKeySet it
// found on entry (what c10::impl::ForceDispatchKeyGuard does, split over enter/exit so Python
// context managers can drive it). Removing a delta would be wrong twice over: a key that was
// already included by an enclosing activation would be dropped too early, and for per-backend
// keys DispatchKeySet::remove clears only the functionality bit. Restoring a snapshot is
// correct however activations nest, and after an exception as much as after a normal exit.

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

ThreadState& ThreadState::current() {
  thread_local ThreadState state;
  return state;
}

size_t ThreadState::enter(ActivationKind kind, Region* region) {
  c10::impl::LocalDispatchKeySet saved = c10::impl::tls_local_dispatch_key_set();
  std::vector<UnitId> saved_units;
  UnitStack& units = UnitStack::current();
  if (kind == ActivationKind::kForward) {
    region->setUnitsAroundForward(units.units());
  } else if (kind == ActivationKind::kRecompute) {
    // The recompute re-runs the wrapped function, which re-opens its own units; the units that
    // were open around the checkpoint call in the forward are re-opened here.
    saved_units = units.units();
    units.truncate(0);
    units.pushAll(region->unitsAroundForward());
    region->beginRecompute();
  }
  if (needsInterception(kind, region)) {
    c10::impl::LocalDispatchKeySet updated = saved;
    updated.included_ = updated.included_.add(kSacKey);
    c10::impl::_force_tls_local_dispatch_key_set(updated);
  }
  c10::intrusive_ptr<Region> owner =
      region == nullptr ? c10::intrusive_ptr<Region>() : c10::intrusive_ptr<Region>::reclaim_copy(region);
  stack_.push_back(Activation{kind, std::move(owner), saved, std::move(saved_units), next_serial_++});
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
  Activation& target = stack_[depth - 1];
  c10::impl::_force_tls_local_dispatch_key_set(target.saved_keys);
  if (kind == ActivationKind::kRecompute) {
    UnitStack& units = UnitStack::current();
    units.truncate(0);
    units.pushAll(target.saved_units);
    region->endRecompute(/*keep_entries=*/currentBackwardKeepsGraph());
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
  for (const Activation& activation : stack_) {
    if (!activation.region) continue;
    region_ = activation.region.get();
    region_kind_ = activation.kind;
    any_recompute_ = any_recompute_ || activation.kind == ActivationKind::kRecompute;
  }
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
