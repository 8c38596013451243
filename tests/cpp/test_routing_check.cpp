// What a region's forward routed, checked in its recompute when the policy recomputes the routing
// (NOTE: [Unpinned routing must repeat itself] in dispatch/routing_check.cpp).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "dispatch/routing_check.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "test_support.h"

namespace sac {
namespace {

torch::jit::Stack returning(const c10::IValue& value) { return {value}; }

std::string messageOf(RoutingCheck& routing, uint64_t call, const c10::IValue& value) {
  try {
    routing.check(call, returning(value), 1, "MoELayer");
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  }
  return "";
}

TEST(RoutingCheckTest, TheSameSizesAndHostValuesPassOncePerRecompute) {
  RoutingCheck routing;
  routing.note(entrySpelled("aten::nonzero"), 11, returning(at::zeros({3, 2}, at::kLong)), 1);
  routing.note(entrySpelled("aten::_local_scalar_dense"), 12, returning(c10::IValue(int64_t{5})), 1);
  for (int recompute = 0; recompute < 2; ++recompute) {
    routing.beginRecompute();
    EXPECT_EQ(routing.pending(), 2u);
    EXPECT_TRUE(routing.expects(11));
    EXPECT_FALSE(routing.expects(13));  // a call the forward never made
    EXPECT_EQ(messageOf(routing, 11, at::zeros({3, 2}, at::kLong)), "");
    EXPECT_EQ(messageOf(routing, 12, c10::IValue(int64_t{5})), "");
    EXPECT_EQ(routing.pending(), 0u);
    EXPECT_FALSE(routing.expects(11));  // checked once per recompute
  }
}

TEST(RoutingCheckTest, OtherSizesOrHostValuesStopTheRecomputeNamingTheLayerTheOpAndTheFix) {
  RoutingCheck routing;
  routing.note(entrySpelled("aten::nonzero"), 11, returning(at::zeros({3, 2}, at::kLong)), 1);
  routing.note(entrySpelled("aten::nonzero"), 12, returning(at::zeros({4, 2}, at::kLong)), 1);
  routing.note(entrySpelled("aten::_local_scalar_dense"), 13, returning(c10::IValue(int64_t{5})), 1);
  routing.beginRecompute();
  const std::string fix =
      ". The policy recomputes the routing (pin_routing=False); leave pin_routing at True so that the routing is "
      "served from the forward, or make the router repeat itself in the recompute";
  EXPECT_EQ(messageOf(routing, 12, at::zeros({5, 2}, at::kLong)),
            "sac_plugin: the recompute of MoELayer routes tokens differently from its forward: the 2nd routing call "
            "of aten::nonzero returned [4, 2] in the forward and [5, 2] in the recompute" +
                fix);
  // A CPU tensor's contents are on the host already: they are compared too.
  EXPECT_EQ(messageOf(routing, 11, at::ones({3, 2}, at::kLong)),
            "sac_plugin: the recompute of MoELayer routes tokens differently from its forward: the 1st routing call "
            "of aten::nonzero returned other values than in the forward" +
                fix);
  EXPECT_EQ(messageOf(routing, 13, c10::IValue(int64_t{6})),
            "sac_plugin: the recompute of MoELayer routes tokens differently from its forward: the 1st routing call "
            "of aten::_local_scalar_dense returned other values than in the forward" +
                fix);
  routing.clear();
  EXPECT_EQ(routing.pending(), 0u);
  EXPECT_FALSE(routing.expects(11));
}

}  // namespace
}  // namespace sac
