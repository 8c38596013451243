// The interception: every op dispatched while the plugin's key is in the thread-local include
// set lands here, under its own name, below autograd, through the native fallback or through the
// per-op kernels of the coexisting path (NOTE: [Sharing the key with another owner] in
// coexistence.cpp); the hottest ops take the same steps unboxed (NOTE: [Hot ops skip boxing] in
// hot_op_kernels.cpp). The steps, in InterceptedCall (intercepted_call.h), handle:
//   - ops that never count (detach, metadata, profiler, sac's own), ops on meta tensors and
//     calls on tensors that carry the key themselves (another owner's fake tensors): straight
//     through, uncounted;
//   - ops outside a region (audits only): counted, then run;
//   - every other call of a region: through the call pipeline (NOTE: [One call pipeline] in
//     call_pipeline.cpp), which decides, holds and serves it exactly as for the dispatch-mode
//     engine; the fallback counts what runs and redispatches it, and counts a served call as a hit.
// Redispatch always goes to the keys below ours, with the key set the dispatcher gave us.

#include "dispatch/fallback.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <mutex>

#include "dispatch/data_flow.h"
#include "dispatch/intercepted_call.h"
#include "dispatch/interception.h"
#include "dispatch/ivalue_tensors.h"
#include "dispatch/sac_key.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "ops/op_traits.h"

namespace sac {

// NOTE: [Python below our key (torch 2.11)]
// In torch 2.13+ `Python` sits above `Fake`: a tensor subclass's __torch_dispatch__ and a
// TorchDispatchMode (torch's own SAC modes) take an op first, and the plain-tensor ops they run
// reach us. In torch 2.11 `Python` sits below `Fake` (sac_key.h): we see the call on the
// subclass (or under the mode) first, and nothing its handler runs, because torch excludes
// every key above `Python` while a handler runs. Its outputs may then not be kept: serving
// one in the recompute would skip the handler's side effects (an AsyncCollectiveTensor's
// wait_tensor, a DTensor redistribution) or a mode's own cache. So where `Python` is below us
// and in the call's key set, the call is counted and run, never kept or served
// (InterceptedCall::run in intercepted_call.h).
bool pythonBelowSacKey() { return kPythonBelowSacKey; }

// NOTE: [Calls that are not ours]
// The key in a call's key set does not always make the call ours. The key's other owner (a C++
// FakeTensor mode) puts it in the key set of its own tensors and, while its mode is on, in the
// thread-local include set. Calls on tensors that carry the key are never ours: they pass
// through, uncounted. On the native path nothing else can have included the key, so every
// other call is ours (autograd threads inherit an activation's key set: NOTE: [Autograd threads
// inherit the key set]). On the coexisting path a call is ours only on a thread where an
// activation of ours added the key (ThreadState::intercepts).
bool carriesOurKey(const torch::jit::Stack& stack, size_t num_arguments) {
  bool carried = false;
  for (size_t i = stack.size() - num_arguments; i < stack.size() && !carried; ++i) {
    forEachTensor(stack[i], [&](const at::Tensor& tensor) {
      carried = carried || (tensor.defined() && tensor.unsafeGetTensorImpl()->key_set().has(kSacKey));
    });
  }
  return carried;
}

namespace {

// The fallback's calls arrive boxed: the stack holds the arguments, the kernel replaces them with
// its outputs (intercepted_call.h).
class BoxedInvocation {
 public:
  BoxedInvocation(const c10::OperatorHandle& op, torch::jit::Stack* stack) : op_(op), stack_(stack) {}

  torch::jit::Stack& arguments() { return *stack_; }
  torch::jit::Stack& ownedArguments(const c10::OperatorHandle& /*op*/) { return *stack_; }
  void runKernel(c10::DispatchKeySet below) { op_.redispatchBoxed(below, stack_); }
  void served(size_t num_arguments, size_t num_returns) {
    const auto outputs = stack_->end() - static_cast<std::ptrdiff_t>(num_returns);
    stack_->erase(outputs - static_cast<std::ptrdiff_t>(num_arguments), outputs);
  }

 private:
  const c10::OperatorHandle& op_;
  torch::jit::Stack* stack_;
};

void sacFallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (carriesOurKey(*stack, op.schema().arguments().size())) return op.redispatchBoxed(keys & kBelowSacKey, stack);
  interceptCall(op, keys, stack);
}

// NOTE: [Calls that never count skip the key]
// On the native path the key has no other owner, so an op the fallback would only pass through
// uncounted (detach, metadata queries) can skip the key altogether: a fallthrough kernel for
// it on the key makes the dispatcher go straight to the next key, without boxing the call for
// the fallback and unboxing it again below. torch's checkpoint detaches every tensor it saves in
// the recompute, so on a block of small ops that is a third of the calls the fallback received.
// Not on the coexisting path: there the other owner must keep receiving these calls.
void letNeverCountedOpsSkipTheKey() {
  static std::vector<c10::RegistrationHandleRAII>* registrations = new std::vector<c10::RegistrationHandleRAII>();
  for (const std::string& name : neverCountedOpNames()) {
    for (const c10::OperatorHandle& op : resolveOpSpelling(name)) {
      registrations->push_back(c10::Dispatcher::singleton().registerImpl(
          op.operator_name(), kSacKey, c10::KernelFunction::makeFallthrough(), std::nullopt, nullptr,
          "sac_plugin: never counted, skips the key (NOTE: [Calls that never count skip the key])"));
    }
  }
}

std::mutex install_mutex;
InterceptionPath installed_path = InterceptionPath::kNotInstalled;
c10::RegistrationHandleRAII* registration = nullptr;  // leaked: lives as long as the process

}  // namespace

void interceptCall(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  BoxedInvocation invocation(op, stack);
  InterceptedCall<BoxedInvocation>(lookupOp(op), op, keys, invocation).run();
}

InterceptionPath installInterception() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed_path != InterceptionPath::kNotInstalled) return installed_path;
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  if (dispatcher.hasBackendFallbackForDispatchKey(kSacKey)) {
    installCoexistingKernels();
    installed_path = InterceptionPath::kCoexisting;
  } else {
    registration = new c10::RegistrationHandleRAII(
        dispatcher.registerFallback(kSacKey, c10::KernelFunction::makeFromBoxedFunction<&sacFallback>(),
                                    "sac_plugin: selective activation checkpointing"));
    letNeverCountedOpsSkipTheKey();
    installHotOpKernels();
    installed_path = InterceptionPath::kNative;
  }
  return installed_path;
}

InterceptionPath interceptionPath() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return installed_path;
}

const char* interceptionPathName(InterceptionPath path) {
  switch (path) {
    case InterceptionPath::kNotInstalled:
      return "not installed";
    case InterceptionPath::kNative:
      return "native";
    case InterceptionPath::kCoexisting:
      return "coexisting";
  }
  return "unknown";
}

}  // namespace sac
