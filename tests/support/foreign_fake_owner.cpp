// A stand-in for the future C++ FakeTensor: another library that owns a backend fallback on the
// key sac_plugin intercepts on, registered when this library loads (before sac_plugin). It acts
// only while its own thread-local mode is on (the mode also puts the key in the thread-local
// include set, as FakeTensorModeTLS::set_state does), or on tensors that carry the key, and
// otherwise passes calls below the key. It counts what it acts on, so tests can check that
// sac_plugin changes none of its calls.
//
//   torch.ops.load_library(path)           # before `import sac_plugin`
//   torch.ops.sac_test_foreign.set_mode(True) / (False)
//   torch.ops.sac_test_foreign.acted_calls(), .received_calls(), .reset_counts()
//   torch.ops.sac_test_foreign.mark(tensor) -> a tensor that carries the key (an owner's tensor)

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>

namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;
std::atomic<int64_t> acted{0};
std::atomic<int64_t> received{0};
thread_local bool mode_on = false;
thread_local bool key_was_included = false;

bool argumentCarriesKey(const torch::jit::Stack& stack, size_t count) {
  for (size_t i = stack.size() - count; i < stack.size(); ++i) {
    const c10::IValue& value = stack[i];
    if (value.isTensor() && value.toTensor().defined() && value.toTensor().key_set().has(kKey)) return true;
    if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) {
        if (t.defined() && t.key_set().has(kKey)) return true;
      }
    }
  }
  return false;
}

void ownerFallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  // Its own control ops are not calls it acts on.
  const bool own_op = op.schema().name().rfind("sac_test_foreign::", 0) == 0;
  received.fetch_add(own_op ? 0 : 1, std::memory_order_relaxed);
  if (!own_op && (mode_on || argumentCarriesKey(*stack, op.schema().arguments().size()))) {
    acted.fetch_add(1, std::memory_order_relaxed);
  }
  // Acting here is only counting; the call then runs below the key, like a pass-through.
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

void setMode(bool on) {
  if (on == mode_on) return;
  if (on) {
    key_was_included = c10::impl::tls_is_dispatch_key_included(kKey);
    c10::impl::tls_set_dispatch_key_included(kKey, true);
  } else if (!key_was_included) {
    c10::impl::tls_set_dispatch_key_included(kKey, false);
  }
  mode_on = on;
}

at::Tensor mark(const at::Tensor& tensor) {
  // A tensor of the owner's: the same storage, with the key in its own key set.
  auto impl =
      c10::make_intrusive<c10::TensorImpl>(c10::Storage(tensor.storage()), tensor.key_set().add(kKey), tensor.dtype());
  impl->set_sizes_and_strides(tensor.sizes(), tensor.strides(), tensor.storage_offset());
  return at::Tensor(std::move(impl));
}

}  // namespace

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&ownerFallback>()); }

TORCH_LIBRARY(sac_test_foreign, m) {
  m.def("set_mode(bool on) -> ()", &setMode);
  m.def("acted_calls() -> int", []() -> int64_t { return acted.load(); });
  m.def("received_calls() -> int", []() -> int64_t { return received.load(); });
  m.def("reset_counts() -> ()", []() {
    acted.store(0);
    received.store(0);
  });
  m.def("mark(Tensor t) -> Tensor", &mark);
}
