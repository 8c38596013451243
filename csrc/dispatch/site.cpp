#include "dispatch/site.h"

#include <c10/util/Exception.h>

namespace sac {

Site::Site(std::shared_ptr<const Policy> policy, std::string label, bool watches_outside_writes)
    : policy_(std::move(policy)), label_(std::move(label)), watches_outside_writes_(watches_outside_writes) {
  TORCH_CHECK(policy_ != nullptr, "sac: a checkpoint site needs a policy");
}

void Site::noteNeverReached(const OpEntry& op, uint32_t ordinal) {
  std::lock_guard<std::mutex> lock(mutex_);
  never_reached_.insert({&op, ordinal});
  any_never_reached_.store(true, std::memory_order_release);
}

bool Site::claimWarning(const OpEntry& op) {
  std::lock_guard<std::mutex> lock(mutex_);
  return warned_.insert(&op).second;
}

}  // namespace sac
