#pragma once
// The scopes Python opens and closes: a checkpointed region's forward and recompute (and, through
// OpenScope, audits). Each scope checks every exit before it changes anything (NOTE: [Scopes are
// checked before they change anything]). RegionHandle is what Python holds for one checkpoint
// call, through sac_plugin._C's Region and RegionScope types (bindings/python_scopes.cpp).

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <thread>

#include "dispatch/handed_out.h"
#include "dispatch/region.h"
#include "dispatch/thread_state.h"

namespace sac {

// NOTE: [Scopes are checked before they change anything]
// Python drives every scope (a region's forward and recompute, an audit, a unit) through
// separate enter and exit calls, so nothing guarantees they pair up: an exit may come from
// another thread, twice, never, or after an enclosing scope closed out of order. Each handle
// therefore records which thread opened it, at which depth and with which activation serial,
// and every refusal happens before any state changes, so a refused call can be retried
// correctly on the right thread. The dispatch key set is thread-local: only the thread that
// opened a scope can restore it, so an exit from another thread is refused, never applied.
// A scope that an enclosing scope's out-of-order exit already unwound (which raised then)
// closes quietly. A handle destroyed while its scope is open closes it when that happens on
// the opening thread (the usual case: CPython frees an object where its last reference dies).
struct OpenScope {
  bool open = false;
  std::thread::id thread;
  size_t depth = 0;
  uint64_t serial = 0;

  void enter(ActivationKind kind, Region* region) {
    ThreadState& state = ThreadState::current();
    depth = state.enter(kind, region);
    serial = state.serialAt(depth);
    thread = std::this_thread::get_id();
    open = true;
  }

  // Refuses (changing nothing) an exit from another thread or of a scope that is not open.
  void checkExit(const char* what) const {
    TORCH_CHECK(open, "sac: exiting ", what, " that is not open; nothing was changed");
    TORCH_CHECK(thread == std::this_thread::get_id(), "sac: exiting ", what,
                " on a thread that did not enter it; exit it on the thread that entered it (it is still open there, "
                "and nothing was changed)");
  }

  // After checkExit: closes the activation if an out-of-order exit has not unwound it already.
  // ThreadState::exit may still throw after closing (inner scopes were open); the scope is
  // closed either way.
  void exit(ActivationKind kind, Region* region) {
    open = false;
    ThreadState& state = ThreadState::current();
    if (state.isOpen(depth, serial)) state.exit(kind, region, depth);
  }

  // For destructors: closes the scope if it is open on this thread; never throws.
  void abandon(ActivationKind kind, Region* region) noexcept {
    if (!open || thread != std::this_thread::get_id()) return;
    try {
      exit(kind, region);
    } catch (...) {
      // Inner scopes were open too: they were unwound with it, which is all that can be done.
    }
  }
};

struct RegionHandle : c10::intrusive_ptr_target {
  explicit RegionHandle(std::shared_ptr<Site> site)
      : region(c10::make_intrusive<Region>(std::move(site))), handed_out(HandedOut<RegionHandle>::add(this)) {}
  explicit RegionHandle(c10::intrusive_ptr<Region> profiling)
      : region(std::move(profiling)), handed_out(HandedOut<RegionHandle>::add(this)) {}
  ~RegionHandle() override {
    HandedOut<RegionHandle>::remove(handed_out);
    forward.abandon(ActivationKind::kForward, region.get());
    recompute.abandon(ActivationKind::kRecompute, region.get());
  }

  // A region serves one call of checkpoint(fn, ...): its forward runs once; its recompute runs
  // once per backward, one at a time (retain_graph=True allows more than one).
  int64_t enter(ActivationKind kind) {
    if (kind == ActivationKind::kForward) {
      TORCH_CHECK(!forward.open && !forward_done,
                  "sac: this region's forward was already entered; a region serves one checkpoint call, so make a "
                  "new one per call (the function context_fn(policy) returns does)");
    } else {
      TORCH_CHECK(!recompute.open, "sac: this region's recompute is already open; it runs once per backward");
    }
    OpenScope& scope = scopeOf(kind);
    scope.enter(kind, region.get());
    if (kind == ActivationKind::kForward) forward_done = true;
    return static_cast<int64_t>(scope.depth);
  }

  void exit(ActivationKind kind, int64_t depth) {
    OpenScope& scope = scopeOf(kind);
    const char* what = kind == ActivationKind::kForward ? "this region's forward" : "this region's recompute";
    scope.checkExit(what);
    TORCH_CHECK_VALUE(depth == static_cast<int64_t>(scope.depth), "sac: exiting ", what, " with depth ", depth,
                      ", but it was entered at depth ", scope.depth, "; pass the depth its enter returned");
    scope.exit(kind, region.get());
  }

  OpenScope& scopeOf(ActivationKind kind) { return kind == ActivationKind::kForward ? forward : recompute; }

  c10::intrusive_ptr<Region> region;
  // What torch.ops.sac.region_kept_tensors takes (NOTE: [A handle that comes back is checked]).
  const int64_t handed_out;
  // Touched by one thread at a time: the forward by the caller, the recompute by the thread
  // autograd runs it on, which the engine orders after the forward.
  OpenScope forward;
  OpenScope recompute;
  bool forward_done = false;
};

}  // namespace sac
