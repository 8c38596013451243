// The offload outcome of the keep rule (NOTE: [The keep rule] in policy.cpp): offload rules select
// as keep rules do, the same vetoes apply, and declarations refuse what cannot be offloaded.
#include <gtest/gtest.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "ops/op_catalog.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

namespace sac {
namespace {

const OpEntry& entryOf(const char* name, const char* overload = "") {
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  EXPECT_TRUE(handle.has_value()) << name << "." << overload;
  return lookupOp(*handle);
}

std::string messageOf(const PolicySpec& spec) {
  try {
    Policy::create(spec);
  } catch (const c10::ValueError& error) {
    return error.what_without_backtrace();
  }
  return "no error";
}

TEST(PolicyOffload, OffloadedOpIsOffloadedWithItsReason) {
  PolicySpec spec;
  spec.offloaded_ops = {"aten::mm.default"};
  auto policy = Policy::create(spec);
  Decision decision = policy->decide(entryOf("aten::mm"), {}, CallFacts{});
  EXPECT_EQ(decision.outcome, Outcome::kOffload);
  EXPECT_EQ(decision.reason, Reason::kOffloadedOp);
  EXPECT_TRUE(decision.held);
  EXPECT_FALSE(policy->keepsNothing());
  EXPECT_FALSE(policy->offloadsNothing());
  EXPECT_TRUE(policy->namesOp(entryOf("aten::mm")));
  EXPECT_EQ(policy->offloadedOpNames(), std::vector<std::string>{"aten::mm"});
  EXPECT_EQ(policy->decide(entryOf("aten::tanh"), {}, CallFacts{}).outcome, Outcome::kRecompute);
}

TEST(PolicyOffload, TheKeptVetoesApply) {
  PolicySpec spec;
  spec.offloaded_units = {"attn"};
  spec.recomputed_units = {"gate"};
  auto policy = Policy::create(spec);
  const UnitId attn = internUnit("attn");
  const UnitId gate = internUnit("gate");
  Decision in_unit = policy->decide(entryOf("aten::mm"), {attn}, CallFacts{});
  EXPECT_EQ(in_unit.outcome, Outcome::kOffload);
  EXPECT_EQ(in_unit.reason, Reason::kOffloadedUnit);
  EXPECT_EQ(in_unit.unit, attn);
  CallFacts random;
  random.draws_random = true;
  EXPECT_EQ(policy->decide(entryOf("aten::mm"), {attn}, random).reason, Reason::kRandomDraw);
  Decision mutating = policy->decide(entryOf("aten::add_", "Tensor"), {attn}, CallFacts{});
  EXPECT_EQ(mutating.reason, Reason::kMutatesInput);
  EXPECT_TRUE(mutating.mutating_in_kept_unit);
  EXPECT_EQ(policy->decide(entryOf("aten::view"), {attn}, CallFacts{}).reason, Reason::kViewInKeptUnit);
  EXPECT_EQ(policy->decide(entryOf("aten::mm"), {attn, gate}, CallFacts{}).reason, Reason::kInsideRecomputedUnit);
  EXPECT_EQ(policy->decide(entryOf("_c10d_functional::all_reduce"), {attn}, CallFacts{}).reason,
            Reason::kCollective);
}

TEST(PolicyOffload, TheInnermostSelectingUnitDecides) {
  PolicySpec spec;
  spec.kept_units = {"block"};
  spec.offloaded_units = {"mlp"};
  auto policy = Policy::create(spec);
  const UnitId block = internUnit("block");
  const UnitId mlp = internUnit("mlp");
  EXPECT_EQ(policy->decide(entryOf("aten::mm"), {block, mlp}, CallFacts{}).outcome, Outcome::kOffload);
  EXPECT_EQ(policy->decide(entryOf("aten::mm"), {mlp, block}, CallFacts{}).outcome, Outcome::kKeep);
  EXPECT_EQ(policy->decide(entryOf("aten::mm"), {block}, CallFacts{}).outcome, Outcome::kKeep);
}

TEST(PolicyOffload, KeptAndOffloadedCallsShareAnOpsCount) {
  PolicySpec spec;
  spec.kept_calls = {{"aten::mm.default", {0, 2}}};
  spec.offloaded_calls = {{"aten::mm.default", {1, 3}}};
  auto policy = Policy::create(spec);
  const OpEntry& mm = entryOf("aten::mm");
  EXPECT_TRUE(policy->countsCalls(mm, {}));
  std::vector<Outcome> outcomes;
  for (uint64_t i = 0; i < 5; ++i) outcomes.push_back(policy->decide(mm, {}, CallFacts{false, i}).outcome);
  EXPECT_EQ(outcomes, (std::vector<Outcome>{Outcome::kKeep, Outcome::kOffload, Outcome::kKeep, Outcome::kOffload,
                                            Outcome::kRecompute}));
  EXPECT_EQ(policy->offloadedCalls(),
            (std::vector<std::pair<std::string, std::vector<int64_t>>>{{"aten::mm", {1, 3}}}));
  // An op with only an offloaded-calls rule counts its calls too.
  PolicySpec only;
  only.offloaded_calls = {{"aten::bmm.default", {0}}};
  EXPECT_TRUE(Policy::create(only)->countsCalls(entryOf("aten::bmm"), {}));
}

TEST(PolicyOffload, DeclarationsRefuseWhatCannotBeOffloaded) {
  PolicySpec collective;
  collective.offloaded_ops = {"_c10d_functional::all_reduce"};
  EXPECT_EQ(messageOf(collective),
            "sac: offloaded_ops: '_c10d_functional::all_reduce' names _c10d_functional::all_reduce, which is a "
            "collective; collectives are never kept, because the recompute must run them again on every rank");
  PolicySpec view;
  view.offloaded_ops = {"aten::view.default"};
  EXPECT_EQ(messageOf(view),
            "sac: offloaded_ops: 'aten::view.default' names aten::view, which is a view; a view holds no memory of "
            "its own, so offloading it frees nothing (name it in kept_ops, or offload the op that makes its base)");
  PolicySpec both;
  both.kept_ops = {"aten::mm.default"};
  both.offloaded_ops = {"aten::mm.default"};
  EXPECT_EQ(messageOf(both),
            "sac: offloaded_ops: 'aten::mm.default' names aten::mm, which kept_ops already names; give each op one "
            "rule");
  PolicySpec same_index;
  same_index.kept_calls = {{"aten::mm.default", {0, 1}}};
  same_index.offloaded_calls = {{"aten::mm.default", {1}}};
  EXPECT_EQ(messageOf(same_index),
            "sac: offloaded_calls: 'aten::mm.default' lists call 1 of aten::mm, which kept_calls lists too; a call is "
            "kept or offloaded, not both");
  PolicySpec unit_twice;
  unit_twice.kept_units = {"attn"};
  unit_twice.offloaded_units = {"attn"};
  EXPECT_EQ(messageOf(unit_twice),
            "sac: offloaded_units: 'attn' is in kept_units too; a unit is kept or offloaded, not both");
  PolicySpec negative_floor;
  negative_floor.offload_min_bytes = -1;
  EXPECT_EQ(messageOf(negative_floor), "sac: offload_min_bytes must be >= 0 bytes, got -1");
}

TEST(PolicyOffload, HostBytesAreReservedWithinTheLimit) {
  PolicySpec spec;
  spec.offloaded_ops = {"aten::mm.default"};
  spec.host_memory_limit = 100;
  auto policy = Policy::create(spec);
  EXPECT_TRUE(policy->reserveHostBytes(60));
  EXPECT_FALSE(policy->reserveHostBytes(41));
  EXPECT_TRUE(policy->reserveHostBytes(40));
  EXPECT_EQ(policy->hostBytesHeld(), 100);
  policy->releaseHostBytes(100);
  EXPECT_EQ(policy->hostBytesHeld(), 0);
  EXPECT_TRUE(policy->claimOffloadNotice(Policy::OffloadNotice::kHostLimitReached));
  EXPECT_FALSE(policy->claimOffloadNotice(Policy::OffloadNotice::kHostLimitReached));
  EXPECT_TRUE(policy->claimOffloadNotice(Policy::OffloadNotice::kRunsOnCpu));
}

}  // namespace
}  // namespace sac
