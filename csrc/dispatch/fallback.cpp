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

#include "dispatch/data_flow.h"
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
    if (region == nullptr || !region->intercepts()) return countAndRun(state.phase());

    const Policy& policy = region->policy();
    // A view makes no storage and writes none: the data flow names its output by its base's
    // storage and its geometry, so a view needs no record unless the policy names the op itself.
    if (entry_.traits.is_view && !policy.namesOp(entry_)) return countAndRun(state.phase());

    const bool recompute = state.regionInRecompute();
    const c10::FunctionSchema& schema = op_.schema();
    const size_t num_arguments = schema.arguments().size();
    const size_t num_returns = schema.returns().size();
    const c10::IValue* arguments = &(*stack_)[stack_->size() - num_arguments];
    std::vector<WrittenStorage> written;
    if (entry_.traits.mutates_inputs || entry_.traits.writes_out_arguments) {
      written = writtenStorages();
      if (entry_.traits.mutates_inputs && !recompute) region->demoteKeptOutputsIn(written);
    }
    DataFlow& flow = region->flow();
    const uint64_t call = flow.identify(entry_, arguments, num_arguments);

    if (recompute) {
      const bool consume = !currentBackwardKeepsGraph();
      if (region->keptAnything() && region->serve(entry_, call, op_, stack_, consume)) {
        entry_.counters.recordHit();
      } else {
        countAndRun(state.phase());
      }
      flow.recordCall(call, schema, *stack_, num_returns, written);
      return;
    }

    CallFacts facts;
    facts.draws_random = drawsRandomNumbers(entry_.traits, arguments);
    facts.casts_a_parameter = castsAParameter(entry_.traits, arguments);
    if (policy.everyNth(entry_) > 0) facts.call_index = region->nextCallIndex(entry_);
    Decision decision = policy.decide(entry_, UnitStack::current().units(), facts);
    if (decision.mutating_in_kept_unit || decision.random_call_of_kept_op) warnOnce(policy, decision);
    countAndRun(state.phase());
    if (decision.keep) region->keep(entry_, call, decision.unit, *stack_, num_returns);
    flow.recordCall(call, schema, *stack_, num_returns, written);
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

  // Storages of the arguments this op writes (in place or as out= arguments), noted before the
  // kernel consumes the arguments.
  std::vector<WrittenStorage> writtenStorages() const {
    std::vector<WrittenStorage> storages;
    const auto& arguments = op_.schema().arguments();
    const size_t first = stack_->size() - arguments.size();
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::AliasInfo* alias = arguments[i].alias_info();
      if (alias == nullptr || !alias->isWrite()) continue;
      forEachTensor((*stack_)[first + i], [&](const at::Tensor& tensor) {
        if (tensor.defined() && tensor.has_storage()) {
          storages.push_back(WrittenStorage{tensor.storage(), static_cast<uint32_t>(i)});
        }
      });
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
