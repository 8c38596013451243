// The fallback: every op dispatched while the plugin's key is in the thread-local include set
// lands here, under its own name, below autograd. It handles:
//   - ops that never count (detach, metadata, profiler, sac's own) and ops on meta tensors:
//     straight through;
//   - ops outside a region (audits only): counted, then run;
//   - ops the region's policy recomputes: counted, then run;
//   - kept ops in the forward: counted, run, outputs stored in the region;
//   - kept ops in the recompute: outputs served from the region, kernel skipped, hit counted.
// Redispatch always goes to the keys below ours, with the key set the dispatcher gave us.

#include "dispatch/fallback.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <mutex>

#include "dispatch/call_signature.h"
#include "dispatch/ivalue_tensors.h"
#include "dispatch/region.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "policy/op_catalog.h"
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

class InterceptedCall {
 public:
  InterceptedCall(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack)
      : op_(op), keys_(keys), below_(keys & kBelowSacKey), stack_(stack), entry_(lookupOp(op)) {}

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
    if (region == nullptr || !region->intercepts() || python_handles_it) return countAndRun(state.phase());

    const bool recompute = state.regionInRecompute();
    if (entry_.traits.mutates_inputs && !recompute) region->demoteKeptOutputsIn(writtenStorages());

    const Policy& policy = region->policy();
    const size_t num_arguments = op_.schema().arguments().size();
    const c10::IValue* arguments = &(*stack_)[stack_->size() - num_arguments];
    CallFacts call;
    call.draws_random = drawsRandomNumbers(entry_.traits, arguments);
    call.casts_a_parameter = castsAParameter(entry_.traits, arguments);
    if (policy.everyNth(entry_) > 0) call.call_index = region->nextCallIndex(entry_, recompute);
    Decision decision = policy.decide(entry_, UnitStack::current().units(), call);
    if (decision.mutating_in_kept_unit || decision.random_call_of_kept_op) warnOnce(policy, decision);
    if (!decision.keep) return countAndRun(state.phase());

    const uint64_t signature = callSignature(arguments, num_arguments);
    if (recompute) {
      if (region->serve(entry_, signature, op_, stack_, /*consume=*/!currentBackwardKeepsGraph())) {
        entry_.counters.recordHit();
        return;
      }
      return countAndRun(state.phase());
    }
    countAndRun(state.phase());
    region->keep(entry_, signature, decision.unit, *stack_, op_.schema().returns().size());
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

  // Storages of the arguments this op writes in place (not its out= arguments).
  std::vector<const c10::StorageImpl*> writtenStorages() const {
    std::vector<const c10::StorageImpl*> storages;
    const auto& arguments = op_.schema().arguments();
    const size_t first = stack_->size() - arguments.size();
    auto add = [&](const at::Tensor& tensor) {
      if (tensor.defined() && tensor.has_storage()) storages.push_back(tensor.storage().unsafeGetStorageImpl());
    };
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::AliasInfo* alias = arguments[i].alias_info();
      if (alias == nullptr || !alias->isWrite() || arguments[i].is_out()) continue;
      forEachTensor((*stack_)[first + i], add);
    }
    return storages;
  }

  void warnOnce(const Policy& policy, const Decision& decision) {
    if (!policy.claimWarning(entry_)) return;
    if (decision.mutating_in_kept_unit) {
      TORCH_WARN("sac: ", entry_.traits.qualified_name, " mutates an input inside kept unit '",
                 unitName(decision.unit), "'; it is recomputed rather than kept (warned once per policy)");
    } else {
      TORCH_WARN("sac: ", entry_.traits.qualified_name,
                 " is called with dropout_p > 0 and draws random numbers; it is recomputed rather than kept, so that "
                 "the recompute draws the same numbers (warned once per policy)");
    }
  }

  const c10::OperatorHandle& op_;
  c10::DispatchKeySet keys_;
  c10::DispatchKeySet below_;
  torch::jit::Stack* stack_;
  const OpEntry& entry_;
};

void sacFallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  InterceptedCall(op, keys, stack).run();
}

std::mutex install_mutex;
c10::RegistrationHandleRAII* registration = nullptr;  // leaked: lives as long as the process

}  // namespace

void installFallback() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (registration != nullptr) return;
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  TORCH_CHECK(!dispatcher.hasBackendFallbackForDispatchKey(kSacKey),
              "sac_plugin cannot load: the dispatch key ", c10::toString(kSacKey),
              " already holds a backend fallback in this torch, registered by torch itself or "
              "another library. sac_plugin intercepts ops through a fallback on that key and needs it free "
              "(see NOTE: [The dispatch key sac_plugin intercepts on] in csrc/dispatch/sac_key.h)");
  registration = new c10::RegistrationHandleRAII(dispatcher.registerFallback(
      kSacKey, c10::KernelFunction::makeFromBoxedFunction<&sacFallback>(),
      "sac_plugin: selective activation checkpointing"));
}

bool fallbackInstalled() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return registration != nullptr;
}

}  // namespace sac
