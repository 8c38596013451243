// The interception: every op dispatched while the plugin's key is in the thread-local include
// set lands here, under its own name, below autograd, through the native fallback or through the
// per-op kernels of the coexisting path (NOTE: [Sharing the key with another owner] in
// coexistence.cpp). It handles:
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

#include "dispatch/call_pipeline.h"
#include "dispatch/call_profile.h"
#include "dispatch/call_trace.h"
#include "dispatch/data_flow.h"
#include "dispatch/interception.h"
#include "dispatch/ivalue_tensors.h"
#include "dispatch/region.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "ops/op_traits.h"
#include "ops/user_warning.h"
#include "policy/unit_stack.h"

namespace sac {
namespace {

// NOTE: [Redispatching below our key]
// redispatchBoxed uses exactly the key set we pass, while callBoxed would recompute it from
// thread-local state and land here again. Masking with FULL_AFTER keeps every key below ours
// (BackendSelect, then the backend) and drops ours and everything above, which has already run.
const c10::DispatchKeySet kBelowSacKey(c10::DispatchKeySet::FULL_AFTER, kSacKey);

// NOTE: [Python below our key (torch 2.11)]
// In torch 2.13+ `Python` sits above `Fake`: a tensor subclass's __torch_dispatch__ and a
// TorchDispatchMode (torch's own SAC modes) take an op first, and the plain-tensor ops they run
// reach us. In torch 2.11 `Python` sits below `Fake` (sac_key.h): we see the call on the
// subclass (or under the mode) first, and nothing its handler runs, because torch excludes
// every key above `Python` while a handler runs. Its outputs may then not be kept: serving
// one in the recompute would skip the handler's side effects (an AsyncCollectiveTensor's
// wait_tensor, a DTensor redistribution) or a mode's own cache. So where `Python` is below us
// and in the call's key set, the call is counted and run, never kept or served.
const bool kPythonBelowSacKey = kBelowSacKey.has(c10::DispatchKey::Python);

}  // namespace

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

class InterceptedCall {
 public:
  InterceptedCall(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack)
      : op_(op), schema_(op.schema()), keys_(keys), below_(keys & kBelowSacKey), stack_(stack), entry_(lookupOp(op)) {}

  void run() {
    // NOTE: [Meta tensors are not activations]
    // torch.compile traces with fake and meta tensors, and may do so in the middle of an eager
    // region (a compiled submodule compiles on its first call). Those calls carry no data and
    // never run again in the recompute: keeping or counting them would only pollute the region
    // and the audit, so they pass straight through, like metadata queries.
    if (entry_.traits.never_counts || keys_.has_backend(c10::BackendComponent::MetaBit)) return runKernel();
    ThreadState& state = ThreadState::current();
    Region* region = state.region();
    const bool python_handles_it = kPythonBelowSacKey && keys_.has(c10::DispatchKey::Python);
    if (region == nullptr || !region->intercepts() || python_handles_it) {
      traceCall(entry_, state.phase(), CallOutcome::kRecomputed);  // NOTE: [The per-op trace is recorded below Python]
      return countAndRun(state.phase());
    }
    if (C10_UNLIKELY(region->profile() != nullptr)) {  // NOTE: [Profiling a region]
      return region->profile()->profileCall(*region, entry_, schema_, stack_, [&] { countAndRun(state.phase()); });
    }

    // NOTE: [One call pipeline] (call_pipeline.cpp)
    const size_t num_arguments = schema_.arguments().size();
    const bool recompute = state.regionInRecompute();
    const bool draws_random =
        !recompute && drawsRandomNumbers(entry_.traits, &(*stack_)[stack_->size() - num_arguments]);
    CallInFlight call;
    switch (beginCall(*region, recompute, entry_, op_, stack_, num_arguments, std::nullopt, draws_random, &call)) {
      case CallStep::kRunOnly:
        return countAndRun(state.phase());
      case CallStep::kServed:
        entry_.counters.recordHit();
        return;
      case CallStep::kRunAndFinish:
        countAndRun(state.phase());
        finishCall(*region, call, schema_, *stack_, schema_.returns().size());
        return;
    }
  }

 private:
  void runKernel() {
    // NOTE: [Ops called from inside a kernel are not intercepted]
    // A kernel may dispatch further ops (addmm's CPU kernel calls copy_, randn calls normal_).
    // They are part of the op we are running, not calls of the checkpointed function: seeing
    // them would count them twice, warn about copy_ "mutating" in a kept unit, and, worst, let
    // a kept op nested in a kept kernel be numbered in the forward but not in the recompute
    // (where the outer op is served and its kernel never runs), so a later call of the same op
    // would be served the nested call's output. Torch's dispatch modes behave the same way: the
    // mode is off while its handler runs the op.
    c10::impl::ExcludeDispatchKeyGuard not_nested(kSacKey);
    op_.redispatchBoxed(below_, stack_);
  }

  void countAndRun(Phase phase) {
    entry_.counters.recordExecution(phase);
    runKernel();
  }

  const c10::OperatorHandle& op_;
  // Read once: OperatorHandle::schema() is an out-of-line, checked call, and every step reads it.
  const c10::FunctionSchema& schema_;
  c10::DispatchKeySet keys_;
  c10::DispatchKeySet below_;
  torch::jit::Stack* stack_;
  const OpEntry& entry_;
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

std::vector<WrittenStorage> writtenStorages(const c10::FunctionSchema& schema, const c10::IValue* arguments) {
  std::vector<WrittenStorage> storages;
  const auto& declared = schema.arguments();
  for (size_t i = 0; i < declared.size(); ++i) {
    const c10::AliasInfo* alias = declared[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    forEachTensor(arguments[i], [&](const at::Tensor& tensor) {
      if (tensor.defined() && tensor.has_storage()) {
        storages.push_back(WrittenStorage{tensor.storage(), static_cast<uint32_t>(i)});
      }
    });
  }
  return storages;
}

bool pythonBelowSacKey() { return kPythonBelowSacKey; }

void interceptCall(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  InterceptedCall(op, keys, stack).run();
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
