// Checkpoint sites (NOTE: [What a site learns]) and regions as the one owner of what they hold
// (NOTE: [A region owns what it holds]).
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "dispatch/fallback.h"
#include "dispatch/region.h"
#include "dispatch/site.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "test_support.h"

namespace sac {
namespace {

class SiteTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(installInterception(), InterceptionPath::kNative); }
  void TearDown() override { EXPECT_EQ(ThreadState::current().depth(), 0u); }
};

TEST_F(SiteTest, WarningsAreClaimedOncePerSiteNotPerPolicy) {
  auto policy = Policy::create({}, {"attn"});
  Site first(policy);
  Site second(policy);
  const OpEntry& add_ = entrySpelled("aten::add_.Tensor");
  EXPECT_TRUE(first.claimWarning(add_));
  EXPECT_FALSE(first.claimWarning(add_));
  EXPECT_TRUE(second.claimWarning(add_));
  EXPECT_TRUE(first.claimNotice(Site::Notice::kHostLimitReached));
  EXPECT_FALSE(first.claimNotice(Site::Notice::kHostLimitReached));
  EXPECT_TRUE(first.claimNotice(Site::Notice::kRunsOnCpu));
  EXPECT_TRUE(second.claimNotice(Site::Notice::kHostLimitReached));
}

// What one site learns about the recompute's reach applies to its own regions only: a second
// site of the same policy still holds the call.
TEST_F(SiteTest, NeverReachedCallsAreLearntPerSite) {
  auto policy = Policy::create({"aten::tanh"}, {});
  auto first = std::make_shared<Site>(policy);
  auto second = std::make_shared<Site>(policy);
  at::Tensor x = at::randn({4, 4});
  auto forward = [&](const std::shared_ptr<Site>& site) {
    auto region = c10::make_intrusive<Region>(site);
    {
      ActivationScope scope(ActivationKind::kForward, region.get());
      at::tanh(x);
    }
    return region;
  };
  auto learning = forward(first);
  EXPECT_EQ(learning->keptCalls(), 1);
  EXPECT_EQ(learning->releaseUnreached(0), 1);  // no save after the call: the recompute stops before it
  EXPECT_TRUE(first->neverReached(entrySpelled("aten::tanh"), 1));
  EXPECT_FALSE(second->neverReached(entrySpelled("aten::tanh"), 1));
  EXPECT_EQ(forward(first)->keptCalls(), 0);
  EXPECT_EQ(forward(second)->keptCalls(), 1);
}

// A weak reference keeps no resource: the kept outputs go with the last strong reference.
TEST_F(SiteTest, ARegionReleasesWhatItHoldsWhileWeakReferencesRemain) {
  const int64_t live_before = Region::liveCount();
  auto region = c10::make_intrusive<Region>(Policy::create({"aten::tanh"}, {}));
  at::Tensor x = at::randn({64, 64});
  c10::weak_intrusive_ptr<c10::StorageImpl> kept_storage = [&] {
    ActivationScope scope(ActivationKind::kForward, region.get());
    return at::tanh(x).storage().getWeakStorageImpl();
  }();
  EXPECT_EQ(region->keptCalls(), 1);
  EXPECT_FALSE(kept_storage.expired());
  c10::weak_intrusive_ptr<Region> weak(region);
  EXPECT_EQ(Region::liveCount(), live_before + 1);
  region.reset();
  EXPECT_TRUE(kept_storage.expired());
  EXPECT_EQ(Region::liveCount(), live_before);
  EXPECT_FALSE(weak.lock());
}

}  // namespace
}  // namespace sac
