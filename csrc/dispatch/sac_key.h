#pragma once

#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace sac {

// NOTE: [The dispatch key sac_plugin intercepts on]
// We need a key that (1) sits below autograd, so that during the recompute the autograd node
// of a kept op is still created and saves the same tensors (torch's non-reentrant checkpoint
// counts them, and a mismatch raises "A different number of tensors was saved"); only the
// kernel underneath is skipped; (2) is a *functionality* key, not a per-backend one: a
// backend fallback on a per-backend key (PrivateUse3, CustomRNGKeyId) loses to
// CompositeExplicitAutograd kernels, so aten::tanh would arrive as aten::tanh.out, and
// DispatchKeySet::remove of a per-backend key leaves its backend bit behind in the include
// set; (3) holds no backend fallback in core, because a key holds only one.
//
// In torch 2.13, below autograd, high to low: ADInplaceOrView, ZeroTensor, Negative,
// Conjugate, Functionalize, FuncTorchDynamicLayerBackMode, Python, Fake, BackendSelect, then
// the backends. Every one of them holds a fallback or a per-op kernel table in core except
// `Fake`, which is reserved for a C++ FakeTensor mode that no released torch registers yet
// (torchdistx used the same key for its fake tensors). `Fake` sits just below `Python`, so
// TorchDispatchModes (including torch's own SAC) see an op before we do, and just above
// BackendSelect, so factory ops (`empty`, `randn`) reach us as well once the key is in the
// thread-local include set. No tensor ever carries `Fake` in its own key set here, so the key
// is hit exactly where we include it: inside checkpointed regions and audits. In torch 2.11
// `Fake` sits just above `Python` instead: still below autograd and above BackendSelect, but
// there a tensor subclass (DTensor) reaches us before its __torch_dispatch__; such calls are counted and run, never
// kept (NOTE: [Python below our key (torch 2.11)]).
//
// Upstream is claiming the key for a C++ FakeTensor. When a fallback is already on it at load,
// installInterception() shares the key through per-op kernels instead of registering a fallback
// (NOTE: [Sharing the key with another owner] in coexistence.cpp).
inline constexpr c10::DispatchKey kSacKey = c10::DispatchKey::Fake;

// NOTE: [The plugin's own calls]
// The plugin dispatches ops of its own: offload copies and their buffers, the copies that serve an
// out= call, op-trait and bookkeeping queries. They are not calls of the checkpointed function, so
// none may be intercepted (our key) or seen by a TorchDispatchMode or tensor subclass (`Python`,
// and `PythonTLSSnapshot`, which re-enters Python dispatch): a user's logging or FLOP-counting
// mode sees exactly the calls the model made, and a value-changing mode (fake quantization)
// never rewrites the plugin's copies. torch's _DisableTorchDispatch excludes the same two keys.
inline const c10::DispatchKeySet kPluginCallExcludedKeys{kSacKey, c10::DispatchKey::Python,
                                                         c10::DispatchKey::PythonTLSSnapshot};
class PluginCallGuard {
 public:
  PluginCallGuard() : excluded_(kPluginCallExcludedKeys) {}

 private:
  c10::impl::ExcludeDispatchKeyGuard excluded_;
};

}  // namespace sac
