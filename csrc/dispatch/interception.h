#pragma once
// Internal to csrc/dispatch: the shared entry of the native fallback and the per-op kernels
// (coexisting, hot ops).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace sac {

// Whether a tensor argument carries the key itself: another owner's tensor (NOTE: [Calls that
// are not ours]).
bool carriesOurKey(const torch::jit::Stack& stack, size_t num_arguments);

// NOTE: [Python below our key (torch 2.11)] in fallback.cpp: whether this torch dispatches the
// plugin's key before `Python`.
bool pythonBelowSacKey();

// Runs one call of ours: counts, keeps, serves, and redispatches below the key.
void interceptCall(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

// Registers the native path's unboxed kernels for the hottest ops (NOTE: [Hot ops skip boxing]
// in hot_op_kernels.cpp).
void installHotOpKernels();

// Registers the coexisting path's per-op kernels (coexistence.cpp).
void installCoexistingKernels();

// Registers per-op kernels for ops defined since the last call (coexistence.cpp); cheap when
// there are none. Called where no dispatcher lock is held.
void installKernelsForNewOps();

}  // namespace sac
