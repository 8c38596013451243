// The coexisting path: per-op kernels on the plugin's key, beside another owner's backend
// fallback on the same key.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/op_registration/op_registration.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "dispatch/interception.h"
#include "dispatch/sac_key.h"
#include "dispatch/thread_state.h"
#include "ops/hash_containers.h"

namespace sac {

// NOTE: [Sharing the key with another owner]
// A dispatch key holds one backend fallback, and upstream torch is claiming ours for a C++
// FakeTensor (NOTE: [The dispatch key sac_plugin intercepts on]). When a fallback is already
// there at load, the plugin shares the key instead of refusing to load:
//   - A kernel registered for one op on a key wins over the key's backend fallback, so the
//     plugin registers the same boxed kernel for every op (and, through a registration
//     listener, for every op defined later). The dispatcher still routes exactly as before:
//     only calls whose key set holds the key reach it, and the key is a functionality key, so
//     no autograd or composite entry of the op changes.
//   - Before overriding an op, it reads what the key runs for that op today
//     (OperatorHandle::getComputedKernelForDispatchKey: the other owner's fallback, or its own
//     kernel for that op) and keeps it.
//   - At a call, the plugin's kernel takes the call only if it is ours (NOTE: [Calls that are
//     not ours]); every other call goes, untouched and with the same key set, to the kernel it
//     would have reached without the plugin. So the other owner receives exactly the calls it
//     received before, and the plugin's calls never reach it.
// Ops defined while the dispatcher holds its lock (the listener is called under it) cannot be
// registered from the listener; they are queued and registered at the next activation of the
// plugin on any thread, before any op of that activation runs. Until then such an op falls to
// the other owner's fallback, which passes calls it does not own below the key.
namespace {

struct Coexistence {
  std::mutex mutex;
  // The other owner's kernel per op, by operator name (stable while the op is registered).
  HashMap<const c10::OperatorName*, std::shared_ptr<const c10::SafeKernelFunction>> owners;
  std::vector<c10::RegistrationHandleRAII> registrations;  // never released
  std::vector<c10::OperatorName> pending;                  // defined since the last install
  std::atomic<bool> has_pending{false};
  std::optional<c10::RegistrationHandleRAII> listener;
};

Coexistence& coexistence() {
  static auto* instance = new Coexistence();  // leaked: ops may run during static destruction
  return *instance;
}

// The cache's shared_ptr keeps the kernel alive, so callers get a reference and no refcount traffic.
const c10::SafeKernelFunction& ownerKernelOf(const c10::OperatorHandle& op) {
  // Read-mostly: a thread-local cache in front of the shared table.
  thread_local HashMap<const c10::OperatorName*, std::shared_ptr<const c10::SafeKernelFunction>> cache;
  auto found = cache.find(&op.operator_name());
  if (found != cache.end()) return *found->second;
  Coexistence& state = coexistence();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto owner = state.owners.find(&op.operator_name());
  TORCH_CHECK(owner != state.owners.end(), "sac: no kernel of the key's other owner was recorded for ",
              op.operator_name(), "; this is a bug in sac_plugin's coexisting path");
  return *cache.emplace(&op.operator_name(), owner->second).first->second;
}

void coexistingKernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (ThreadState::current().intercepts() && !carriesOurKey(*stack, op.schema().arguments().size())) {
    return interceptCall(op, keys, stack);
  }
  ownerKernelOf(op).callBoxed(op, keys, stack);
}

// Under Coexistence::mutex, outside any dispatcher lock.
void registerKernelFor(Coexistence& state, const c10::OperatorHandle& op) {
  if (state.owners.count(&op.operator_name()) > 0) return;
  auto owner = std::make_shared<const c10::SafeKernelFunction>(op.getComputedKernelForDispatchKey(kSacKey));
  state.owners.emplace(&op.operator_name(), std::move(owner));
  state.registrations.push_back(c10::Dispatcher::singleton().registerImpl(
      op.operator_name(), kSacKey, c10::KernelFunction::makeFromBoxedFunction<&coexistingKernel>(), std::nullopt,
      nullptr, "sac_plugin: selective activation checkpointing (sharing the key)"));
}

class NewOpListener final : public c10::OpRegistrationListener {
 public:
  void onOperatorRegistered(const c10::OperatorHandle& op) override {
    // Called with the dispatcher's lock held: registering here would deadlock.
    Coexistence& state = coexistence();
    std::lock_guard<std::mutex> lock(state.mutex);
    state.pending.push_back(op.operator_name());
    state.has_pending.store(true, std::memory_order_release);
  }
  void onOperatorDeregistered(const c10::OperatorHandle& op) override {
    Coexistence& state = coexistence();
    std::lock_guard<std::mutex> lock(state.mutex);
    state.owners.erase(&op.operator_name());
  }
};

}  // namespace

void installKernelsForNewOps() {
  Coexistence& state = coexistence();
  if (!state.has_pending.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(state.mutex);
  std::vector<c10::OperatorName> pending;
  pending.swap(state.pending);
  state.has_pending.store(false, std::memory_order_release);
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : pending) {
    if (auto op = dispatcher.findSchema(name)) registerKernelFor(state, *op);
  }
}

void installCoexistingKernels() {
  Coexistence& state = coexistence();
  // The listener first replays every op registered so far into `pending` (under the
  // dispatcher's lock), then keeps adding new ones.
  {
    auto listener = c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<NewOpListener>());
    std::lock_guard<std::mutex> lock(state.mutex);
    state.listener.emplace(std::move(listener));
  }
  installKernelsForNewOps();
}

}  // namespace sac
