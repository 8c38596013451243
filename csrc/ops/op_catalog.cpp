#include "ops/op_catalog.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/op_registration/op_registration.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "ops/hash_containers.h"

namespace sac {
namespace {

using OpKey = const c10::OperatorName*;  // stable for as long as the op is registered

struct Catalog {
  std::mutex mutex;
  HashMap<OpKey, OpEntry*> live;
  std::vector<std::unique_ptr<OpEntry>> owned;  // never shrinks: entries outlive deregistration
  std::atomic<uint64_t> epoch{0};               // bumped when an op leaves the dispatcher
  std::optional<c10::RegistrationHandleRAII> listener_handle;
};

class DeregistrationListener final : public c10::OpRegistrationListener {
 public:
  explicit DeregistrationListener(Catalog* catalog) : catalog_(catalog) {}
  void onOperatorRegistered(const c10::OperatorHandle&) override {}
  void onOperatorDeregistered(const c10::OperatorHandle& op) override {
    std::lock_guard<std::mutex> lock(catalog_->mutex);
    if (catalog_->live.erase(&op.operator_name()) > 0) {
      catalog_->epoch.fetch_add(1, std::memory_order_release);
    }
  }

 private:
  Catalog* catalog_;
};

Catalog& catalog() {
  // Leaked on purpose: ops may still be dispatched while static destructors run.
  static Catalog* instance = [] {
    auto* c = new Catalog();
    c->listener_handle.emplace(
        c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<DeregistrationListener>(c)));
    return c;
  }();
  return *instance;
}

const OpEntry& lookupSlow(const c10::OperatorHandle& op) {
  Catalog& c = catalog();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.live.find(&op.operator_name());
  if (it != c.live.end()) return *it->second;
  auto entry = std::make_unique<OpEntry>();
  entry->traits = classifyOp(op);
  OpEntry* raw = entry.get();
  c.owned.push_back(std::move(entry));
  c.live.emplace(&op.operator_name(), raw);
  return *raw;
}

struct ThreadCache {
  uint64_t epoch = 0;
  HashMap<OpKey, const OpEntry*> entries;
};

}  // namespace

const OpEntry& lookupOp(const c10::OperatorHandle& op) {
  thread_local ThreadCache cache;
  uint64_t epoch = catalog().epoch.load(std::memory_order_acquire);
  if (epoch != cache.epoch) {
    cache.entries.clear();
    cache.epoch = epoch;
  }
  auto [it, inserted] = cache.entries.try_emplace(&op.operator_name(), nullptr);
  if (inserted) it->second = &lookupSlow(op);
  return *it->second;
}

void forEachOp(const std::function<void(const OpEntry&)>& visit) {
  Catalog& c = catalog();
  std::lock_guard<std::mutex> lock(c.mutex);
  for (const auto& [key, entry] : c.live) visit(*entry);
}

}  // namespace sac
