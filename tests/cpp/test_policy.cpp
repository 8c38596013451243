#include <ATen/Functions.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "ops/op_catalog.h"
#include "ops/routing.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"
#include "test_support.h"

namespace sac {
namespace {

std::string valueErrorOf(const std::vector<std::string>& ops, const std::vector<std::string>& units = {}) {
  try {
    Policy::create(ops, units);
  } catch (const c10::ValueError& error) {
    return error.what_without_backtrace();
  }
  return "no error";
}

std::string messageOf(const PolicySpec& spec) {
  try {
    Policy::create(spec);
  } catch (const c10::ValueError& error) {
    return error.what_without_backtrace();
  }
  return "no error";
}

TEST(PolicyDeclaration, UnknownOpNamesTheClosestRegisteredOnes) {
  EXPECT_EQ(valueErrorOf({"aten::mmm"}),
            "sac: kept_ops: unknown op 'aten::mmm'; closest registered names: aten::bmm, aten::mm, aten::smm");
}

TEST(PolicyDeclaration, CollectiveIsRefused) {
  EXPECT_EQ(valueErrorOf({"_c10d_functional::all_reduce"}),
            "sac: kept_ops: '_c10d_functional::all_reduce' names _c10d_functional::all_reduce, which is a "
            "collective; collectives are never kept, because the recompute must run them again on every rank");
}

TEST(PolicyDeclaration, RandomOpIsRefused) {
  EXPECT_EQ(valueErrorOf({"aten::native_dropout.default"}),
            "sac: kept_ops: 'aten::native_dropout.default' names aten::native_dropout, which is a random op; "
            "random ops are never kept, because skipping one in the recompute would shift the generator for "
            "every random op after it");
}

TEST(PolicyDeclaration, MutatingOpIsRefused) {
  EXPECT_EQ(valueErrorOf({"aten::add_.Tensor"}),
            "sac: kept_ops: 'aten::add_.Tensor' names aten::add_.Tensor, which mutates an input; only "
            "functional (or out=) ops can be kept, because the recompute must apply the mutation again");
}

TEST(PolicyDeclaration, EmptyUnitNameIsRefused) {
  EXPECT_EQ(valueErrorOf({}, {""}), "sac: kept_units: a unit name must be non-empty, e.g. 'attn' or 'moe_gate'");
}

TEST(PolicyDeclaration, EveryOverloadSpellingKeepsAllKeepableOverloads) {
  auto policy = Policy::create({"aten::mm"}, {});
  EXPECT_EQ(policy->keptOpNames(),
            (std::vector<std::string>{"aten::mm", "aten::mm.dtype", "aten::mm.dtype_out", "aten::mm.out"}));
  EXPECT_FALSE(policy->keepsNothing());
  EXPECT_TRUE(Policy::create({}, {})->keepsNothing());
}

TEST(PolicyDecision, KeptOpIsKeptAnywhere) {
  auto policy = Policy::create({"aten::mm.default"}, {});
  Decision decision = policy->decide(entryOf("aten::mm"), {}, CallFacts{});
  EXPECT_TRUE(decision.held);
  EXPECT_EQ(decision.unit, kNoUnit);
  EXPECT_FALSE(policy->decide(entryOf("aten::mm", "out"), {}, CallFacts{}).held);
  EXPECT_FALSE(policy->decide(entryOf("aten::tanh"), {}, CallFacts{}).held);
}

TEST(PolicyDecision, OpsInsideAKeptUnitAreKept) {
  auto policy = Policy::create({}, {"attn"});
  UnitId attn = internUnit("attn");
  UnitId mlp = internUnit("mlp");
  Decision inside = policy->decide(entryOf("aten::tanh"), {attn}, CallFacts{});
  EXPECT_TRUE(inside.held);
  EXPECT_EQ(inside.unit, attn);
  EXPECT_FALSE(policy->decide(entryOf("aten::tanh"), {mlp}, CallFacts{}).held);
  EXPECT_FALSE(policy->decide(entryOf("aten::tanh"), {}, CallFacts{}).held);
}

TEST(PolicyDecision, NestedUnitsKeepWhenAnyEnclosingUnitIsKept) {
  auto policy = Policy::create({}, {"attn"});
  UnitId attn = internUnit("attn");
  UnitId rope = internUnit("rope");
  EXPECT_TRUE(policy->decide(entryOf("aten::tanh"), {attn, rope}, CallFacts{}).held);
  EXPECT_TRUE(policy->decide(entryOf("aten::tanh"), {rope, attn}, CallFacts{}).held);
}

TEST(PolicyDecision, InvariantsWinInsideAKeptUnit) {
  auto policy = Policy::create({}, {"attn"});
  UnitId attn = internUnit("attn");
  Decision mutating = policy->decide(entryOf("aten::add_", "Tensor"), {attn}, CallFacts{});
  EXPECT_FALSE(mutating.held);
  EXPECT_TRUE(mutating.mutating_in_kept_unit);
  EXPECT_FALSE(policy->decide(entryOf("aten::native_dropout"), {attn}, CallFacts{true, 0}).held);
  EXPECT_FALSE(policy->decide(entryOf("_c10d_functional::all_reduce"), {attn}, CallFacts{}).held);
  EXPECT_FALSE(policy->decide(entryOf("aten::view"), {attn}, CallFacts{}).held);
  EXPECT_FALSE(policy->decide(entryOf("aten::detach"), {attn}, CallFacts{}).held);
  // An out= op behaves like its functional twin.
  EXPECT_TRUE(policy->decide(entryOf("aten::mm", "out"), {attn}, CallFacts{}).held);
}

TEST(OpTraitsClassification, ReadsSchemaAndTags) {
  EXPECT_TRUE(entryOf("aten::add_", "Tensor").traits.mutates_inputs);
  EXPECT_TRUE(entryOf("aten::mm", "out").traits.writes_out_arguments);
  EXPECT_FALSE(entryOf("aten::mm", "out").traits.mutates_inputs);
  EXPECT_TRUE(entryOf("aten::view").traits.is_view);
  EXPECT_TRUE(entryOf("aten::bernoulli").traits.is_random);
  EXPECT_TRUE(entryOf("_c10d_functional::all_reduce").traits.is_collective);
  EXPECT_TRUE(entryOf("aten::detach").traits.never_counts);
  EXPECT_EQ(entryOf("aten::add", "Tensor").traits.qualified_name, "aten::add.Tensor");
  EXPECT_EQ(entryOf("aten::tanh").traits.qualified_name, "aten::tanh");
}

// NOTE: [Writes no schema declares]: the in-place collectives' writes are seen although their
// schemas do not mark them.
TEST(OpTraitsClassification, UnmarkedWritesOfInPlaceCollectivesAreWrites) {
  const OpTraits& allreduce = entryOf("c10d::allreduce_").traits;
  EXPECT_TRUE(allreduce.mutates_inputs);
  EXPECT_TRUE(allreduce.is_collective);
  EXPECT_EQ(allreduce.written_arguments, std::vector<uint32_t>{0});
  EXPECT_EQ(entryOf("c10d::allgather_").traits.written_arguments, std::vector<uint32_t>{0});
  EXPECT_EQ(entryOf("c10d::send").traits.written_arguments, std::vector<uint32_t>{});
  EXPECT_FALSE(entryOf("c10d::send").traits.mutates_inputs);
  EXPECT_EQ(entryOf("aten::add_", "Tensor").traits.written_arguments, std::vector<uint32_t>{0});
}

// Every op this torch registers whose name says it writes while its schema marks nothing is in
// the table, and every argument the table names exists: a new collective shows up here the day
// torch adds it.
TEST(OpTraitsClassification, EveryRegisteredOpThatWritesWithoutMarksIsListed) {
  std::vector<std::string> unlisted;
  size_t c10d_ops = 0;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    std::optional<c10::OperatorHandle> handle = c10::Dispatcher::singleton().findOp(name);
    if (!handle.has_value() || !handle->hasSchema()) continue;
    if (name.name.rfind("c10d::", 0) == 0) ++c10d_ops;
    if (!namedAsWritingWithoutMarks(*handle)) continue;
    bool listed = false;
    for (const UnannotatedWrite& entry : unannotatedWrites()) {
      if (entry.op != name.name) continue;
      listed = true;
      for (std::string_view written : entry.written) {
        bool found = false;
        for (const c10::Argument& argument : handle->schema().arguments()) found = found || argument.name() == written;
        EXPECT_TRUE(found) << name.name << " has no argument " << written;
      }
    }
    if (!listed) unlisted.push_back(name.name + "." + name.overload_name);
  }
  EXPECT_GT(c10d_ops, 10u) << "c10d's ops are not registered in this process: the check proves nothing";
  EXPECT_EQ(unlisted, std::vector<std::string>{});
}

TEST(ResolvableOpNames, KeepsRegisteredSpellingsAndSkipsTheRest) {
  EXPECT_EQ(resolvableOpNames({"aten::_flash_attention_v9", "aten::mm.default", "not_an_op"}),
            std::vector<std::string>{"aten::mm.default"});
  try {
    resolvableOpNames({"aten::nope"});
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("none of the op names resolves to a registered op: [aten::nope]"),
              std::string::npos);
  }
}

TEST(PolicyDecision, AttentionIsKeptOnlyInCallsWithoutDropout) {
  auto policy = Policy::create({"aten::_scaled_dot_product_flash_attention_for_cpu"}, {});
  const OpEntry& attention = entryOf("aten::_scaled_dot_product_flash_attention_for_cpu");
  EXPECT_TRUE(attention.traits.is_random);
  EXPECT_TRUE(randomOnlyPerCall(attention.traits));
  EXPECT_TRUE(policy->decide(attention, {}, CallFacts{}).held);
  Decision with_dropout = policy->decide(attention, {}, CallFacts{true, 0});
  EXPECT_FALSE(with_dropout.held);
  EXPECT_TRUE(with_dropout.random_call_of_kept_op);
}

TEST(OpTraitsClassification, DropoutPDecidesWhetherACallDrawsRandomNumbers) {
  const OpTraits& traits = entryOf("aten::_scaled_dot_product_flash_attention_for_cpu").traits;
  ASSERT_GE(traits.dropout_p_argument, 0);
  std::vector<c10::IValue> arguments(static_cast<size_t>(traits.dropout_p_argument) + 1);
  arguments[traits.dropout_p_argument] = 0.0;
  EXPECT_FALSE(drawsRandomNumbers(traits, arguments.data()));
  arguments[traits.dropout_p_argument] = 0.1;
  EXPECT_TRUE(drawsRandomNumbers(traits, arguments.data()));
  EXPECT_TRUE(drawsRandomNumbers(entryOf("aten::bernoulli").traits, arguments.data()));
  EXPECT_FALSE(drawsRandomNumbers(entryOf("aten::tanh").traits, arguments.data()));
  arguments[traits.dropout_p_argument] = c10::IValue();  // no number: a draw cannot be ruled out
  EXPECT_TRUE(drawsRandomNumbers(traits, arguments.data()));
}

TEST(OpTraitsClassification, TheRandomRuleIsStatedOverTheCallsDropoutP) {
  const OpTraits& attention = entryOf("aten::_scaled_dot_product_flash_attention_for_cpu").traits;
  EXPECT_FALSE(drawsRandomNumbers(attention, 0.0));
  EXPECT_FALSE(drawsRandomNumbers(attention, -0.0));
  EXPECT_TRUE(drawsRandomNumbers(attention, 0.1));
  EXPECT_TRUE(drawsRandomNumbers(attention, std::nullopt));
  // An op without a dropout_p draws whenever it is random, whatever a caller passes.
  EXPECT_TRUE(drawsRandomNumbers(entryOf("aten::bernoulli").traits, 0.0));
  EXPECT_FALSE(drawsRandomNumbers(entryOf("aten::tanh").traits, std::nullopt));
}

TEST(OpTraitsClassification, OnlyACopyOfALeafThatRequiresGradCastsAParameter) {
  const OpTraits& copy = entryOf("aten::_to_copy").traits;
  EXPECT_TRUE(castsAParameter(copy, true, true));
  EXPECT_FALSE(castsAParameter(copy, true, false));  // a cast of a cast, or of an activation
  EXPECT_FALSE(castsAParameter(copy, false, true));  // a buffer, or an input
  EXPECT_FALSE(castsAParameter(entryOf("aten::clone").traits, true, true));

  at::Tensor parameter = at::ones({2}).set_requires_grad(true);
  at::Tensor activation = parameter.mul(2);
  std::vector<c10::IValue> arguments = {parameter};
  EXPECT_TRUE(castsAParameter(copy, arguments.data()));
  arguments = {activation};
  EXPECT_FALSE(castsAParameter(copy, arguments.data()));
  arguments = {at::ones({2})};
  EXPECT_FALSE(castsAParameter(copy, arguments.data()));
  arguments = {at::Tensor()};
  EXPECT_FALSE(castsAParameter(copy, arguments.data()));
}

TEST(PolicyDecision, EveryNthKeepsCallsOneThreeFive) {
  PolicySpec spec;
  spec.every_nth_op = {{"aten::mm.default", 2}};
  auto policy = Policy::create(spec);
  const OpEntry& mm = entryOf("aten::mm");
  EXPECT_EQ(policy->everyNth(mm), 2u);
  EXPECT_EQ(policy->everyNth(entryOf("aten::tanh")), 0u);
  std::vector<bool> kept;
  for (uint32_t i = 0; i < 5; ++i) kept.push_back(policy->decide(mm, {}, CallFacts{false, i}).held);
  EXPECT_EQ(kept, (std::vector<bool>{true, false, true, false, true}));
  EXPECT_FALSE(policy->keepsNothing());
}

TEST(PolicyDecision, RecomputedUnitWinsOverKeptOpsAndUnits) {
  PolicySpec spec;
  spec.kept_ops = {"aten::tanh"};
  spec.kept_units = {"attn"};
  spec.recomputed_units = {"router"};
  auto policy = Policy::create(spec);
  UnitId attn = internUnit("attn");
  UnitId router = internUnit("router");
  EXPECT_TRUE(policy->decide(entryOf("aten::tanh"), {attn}, CallFacts{}).held);
  EXPECT_FALSE(policy->decide(entryOf("aten::tanh"), {attn, router}, CallFacts{}).held);
  EXPECT_FALSE(policy->decide(entryOf("aten::sin"), {router, attn}, CallFacts{}).held);
  EXPECT_EQ(policy->recomputedUnitNames(), std::vector<std::string>{"router"});
}

// A call forced back to recompute takes no every-nth or kept-calls index, so the calls
// around it alternate as if it were not there (torchtitan's every-second-matmul counter).
TEST(PolicyDecision, CallsInsideARecomputedUnitTakeNoCallIndex) {
  PolicySpec spec;
  spec.every_nth_op = {{"aten::mm.default", 2}};
  spec.kept_calls = {{"aten::bmm.default", {1}}};
  spec.recomputed_units = {"gate"};
  auto policy = Policy::create(spec);
  UnitId gate = internUnit("gate");
  UnitId attn = internUnit("attn");
  EXPECT_TRUE(policy->countsCalls(entryOf("aten::mm"), {}));
  EXPECT_TRUE(policy->countsCalls(entryOf("aten::mm"), {attn}));
  EXPECT_FALSE(policy->countsCalls(entryOf("aten::mm"), {gate}));
  EXPECT_FALSE(policy->countsCalls(entryOf("aten::mm"), {gate, attn}));
  EXPECT_TRUE(policy->countsCalls(entryOf("aten::bmm"), {attn}));
  EXPECT_FALSE(policy->countsCalls(entryOf("aten::bmm"), {attn, gate}));
  EXPECT_FALSE(policy->countsCalls(entryOf("aten::tanh"), {}));
}

TEST(PolicyDeclaration, EveryNthNeedsAPositiveN) {
  PolicySpec spec;
  spec.every_nth_op = {{"aten::mm", 0}};
  try {
    Policy::create(spec);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& error) {
    EXPECT_EQ(std::string(error.what_without_backtrace()),
              "sac: every_nth_op: 'aten::mm' needs n >= 1 (2 keeps every other call), got 0");
  }
}

// n is stored as given: 2**32 keeps only the first call, 2**32 + 1 too.
TEST(PolicyDecision, EveryNthIsStoredExactlyBeyond32Bits) {
  const OpEntry& mm = entryOf("aten::mm");
  for (int64_t n : {int64_t{1} << 32, (int64_t{1} << 32) + 1, INT64_MAX}) {
    PolicySpec spec;
    spec.every_nth_op = {{"aten::mm.default", n}};
    auto policy = Policy::create(spec);
    EXPECT_EQ(policy->everyNth(mm), static_cast<uint64_t>(n));
    EXPECT_EQ(policy->everyNthOps(), (std::vector<std::pair<std::string, int64_t>>{{"aten::mm", n}}));
    std::vector<bool> kept;
    for (uint32_t i : {0u, 1u, 2u, UINT32_MAX}) kept.push_back(policy->decide(mm, {}, CallFacts{false, i}).held);
    EXPECT_EQ(kept, (std::vector<bool>{true, false, false, false})) << n;
  }
}

TEST(PolicyDeclaration, TwoEveryNthRulesForOneOverloadMustAgree) {
  PolicySpec spec;
  spec.every_nth_op = {{"aten::mm", 2}, {"aten.mm.default", 2}};
  EXPECT_EQ(Policy::create(spec)->everyNthOps(),
            (std::vector<std::pair<std::string, int64_t>>{
                {"aten::mm", 2}, {"aten::mm.dtype", 2}, {"aten::mm.dtype_out", 2}, {"aten::mm.out", 2}}));
  spec.every_nth_op = {{"aten::mm", 2}, {"aten.mm.default", 3}};
  try {
    Policy::create(spec);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& error) {
    EXPECT_EQ(std::string(error.what_without_backtrace()),
              "sac: every_nth_op: 'aten.mm.default' gives aten::mm n = 3, but another entry already gave it n = 2; "
              "give each op one n");
  }
}

// A memory-budget plan keeps an explicit set of calls of an op.
TEST(PolicyDecision, KeptCallsKeepExactlyTheListedIndices) {
  PolicySpec spec;
  spec.kept_calls = {{"aten::mm.default", {5, 0, 2, 2}}};
  auto policy = Policy::create(spec);
  const OpEntry& mm = entryOf("aten::mm");
  EXPECT_TRUE(policy->countsCalls(mm, {}));
  EXPECT_FALSE(policy->countsCalls(entryOf("aten::tanh"), {}));
  EXPECT_TRUE(policy->namesOp(mm));
  EXPECT_FALSE(policy->keepsNothing());
  std::vector<bool> kept;
  for (uint64_t i = 0; i < 7; ++i) kept.push_back(policy->decide(mm, {}, CallFacts{false, i}).held);
  EXPECT_EQ(kept, (std::vector<bool>{true, false, true, false, false, true, false}));
  EXPECT_EQ(policy->keptCalls(), (std::vector<std::pair<std::string, std::vector<int64_t>>>{{"aten::mm", {0, 2, 5}}}));
  // A call that draws random numbers is never kept, even when listed.
  Decision random = policy->decide(mm, {}, CallFacts{true, 0});
  EXPECT_FALSE(random.held);
  EXPECT_EQ(random.reason, Reason::kRandomDraw);
}

TEST(PolicyDeclaration, KeptCallsRefuseNegativeIndicesAndASecondRule) {
  auto message = messageOf;
  PolicySpec negative;
  negative.kept_calls = {{"aten::mm.default", {0, -1}}};
  EXPECT_EQ(message(negative),
            "sac: kept_calls: 'aten::mm.default' lists call index -1; indices count the op's calls in a region from 0");
  PolicySpec twice;
  twice.kept_ops = {"aten::mm.default"};
  twice.kept_calls = {{"aten::mm", {0}}};
  EXPECT_EQ(message(twice),
            "sac: kept_calls: 'aten::mm' names aten::mm, which kept_ops already names; give each op one rule "
            "(kept_ops, every_nth_op or kept_calls)");
  PolicySpec mutating;
  mutating.kept_calls = {{"aten::add_.Tensor", {0}}};
  EXPECT_NE(message(mutating).find("mutates an input"), std::string::npos) << message(mutating);
  PolicySpec unknown;
  unknown.kept_calls = {{"aten::not_an_op", {0}}};
  EXPECT_EQ(message(unknown).rfind("sac: kept_calls: ", 0), 0u) << message(unknown);
}

// The offload outcome (NOTE: [The keep rule] in policy.cpp): offload rules select as keep rules
// do, the same vetoes apply, and declarations refuse what cannot be offloaded.

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
  EXPECT_EQ(policy->decide(entryOf("_c10d_functional::all_reduce"), {attn}, CallFacts{}).reason, Reason::kCollective);
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

TEST(PolicyUnits, PatternsMatchAsTorchtitanRegionPatterns) {
  EXPECT_TRUE(unitPatternMatches("*", "layers.0.attention"));
  EXPECT_TRUE(unitPatternMatches("*routed_experts.w13.*", "moe.routed_experts.w13.linear"));
  EXPECT_FALSE(unitPatternMatches("*routed_experts.w13.*", "moe.routed_experts.w13"));
  EXPECT_TRUE(unitPatternMatches("block/*.core", "block/attn.x.core"));
  EXPECT_FALSE(unitPatternMatches("attn", "attn.core"));
  EXPECT_TRUE(unitPatternMatches("a*b*c", "aXbYbZc"));
  EXPECT_FALSE(unitPatternMatches("a*b*c", "aXbYbZ"));
}

TEST(PolicyUnits, PatternsSelectInEveryList) {
  PolicySpec spec;
  spec.kept_units = {"*.attention*"};
  spec.recomputed_units = {"*routed_experts.w13.*"};
  spec.offloaded_units = {"mlp*"};
  auto policy = Policy::create(spec);
  const OpEntry& tanh = entryOf("aten::tanh");
  UnitId attention = internUnit("layers.0.attention.core");
  UnitId w13 = internUnit("moe.routed_experts.w13.mm");
  UnitId mlp = internUnit("mlp.up");
  Decision kept = policy->decide(tanh, {attention}, CallFacts{});
  EXPECT_EQ(kept.reason, Reason::kKeptUnit);
  EXPECT_EQ(kept.unit, attention);
  EXPECT_EQ(policy->decide(tanh, {attention, w13}, CallFacts{}).reason, Reason::kInsideRecomputedUnit);
  EXPECT_EQ(policy->decide(tanh, {mlp}, CallFacts{}).reason, Reason::kOffloadedUnit);
  EXPECT_EQ(policy->keptUnitNames(), std::vector<std::string>{"*.attention*"});
  // A pattern is not interned: it names no unit of its own.
  size_t interned = internedUnitCount();
  Policy::create({}, {"never.opened.*"});
  EXPECT_EQ(internedUnitCount(), interned);
}

TEST(PolicyUnits, APatternBothKeptAndOffloadedIsRefused) {
  PolicySpec spec;
  spec.kept_units = {"layers.*"};
  spec.offloaded_units = {"layers.*"};
  EXPECT_EQ(messageOf(spec),
            "sac: offloaded_units: 'layers.*' is in kept_units too; a unit is kept or offloaded, not both");
}

// NOTE: [Region openings carry their flag]: a region that no list names follows its flag; the
// innermost region that decides for itself decides; the lists override the flag.
TEST(PolicyUnits, RegionsFollowTheirFlagUnlessAListNamesThem) {
  PolicySpec spec;
  spec.kept_ops = {"aten::mm"};  // a policy that selects something
  spec.kept_units = {"layers.0.moe"};
  spec.recomputed_units = {"*.w13"};
  auto policy = Policy::create(spec);
  const OpEntry& tanh = entryOf("aten::tanh");
  UnitId core = internUnit("attn.core");
  UnitId rope = internUnit("attn.rope");
  UnitId moe = internUnit("layers.0.moe");
  UnitId w13 = internUnit("experts.w13");
  UnitId save_core = regionOpening(core, /*recompute=*/false);
  UnitId recompute_rope = regionOpening(rope, /*recompute=*/true);
  EXPECT_EQ(unitName(save_core), "attn.core");
  Decision saved = policy->decide(tanh, {save_core}, CallFacts{});
  EXPECT_EQ(saved.reason, Reason::kKeptUnit);
  EXPECT_EQ(saved.unit, core);
  EXPECT_EQ(policy->decide(tanh, {recompute_rope}, CallFacts{}).reason, Reason::kNotSelected);
  // torch_remat's nesting: inside a recompute=True region an inner region keeps its own policy.
  EXPECT_TRUE(policy->decide(tanh, {recompute_rope, save_core}, CallFacts{}).held);
  // The innermost region decides: a recompute=True region inside a kept unit recomputes.
  EXPECT_FALSE(policy->decide(tanh, {moe, recompute_rope}, CallFacts{}).held);
  // The lists override the flag: kept_units keeps a recompute=True region, recomputed_units
  // recomputes a recompute=False one.
  EXPECT_TRUE(policy->decide(tanh, {regionOpening(moe, true)}, CallFacts{}).held);
  EXPECT_EQ(policy->decide(tanh, {save_core, regionOpening(w13, false)}, CallFacts{}).reason,
            Reason::kInsideRecomputedUnit);
  // A plain unit inside a region is no region: the region decides.
  EXPECT_TRUE(policy->decide(tanh, {save_core, internUnit("inner")}, CallFacts{}).held);
}

TEST(PolicyRouting, RoutingCallsAreKeptUnderASelectivePolicy) {
  auto policy = Policy::create({}, {"attn"});
  UnitId router = internUnit("router");
  CallFacts routes;
  routes.routes_tokens = true;
  Decision topk = policy->decide(entryOf("aten::topk"), {router}, routes);
  EXPECT_EQ(topk.outcome, Outcome::kKeep);
  EXPECT_EQ(topk.reason, Reason::kRoutesTokens);
  EXPECT_STREQ(reasonText(Reason::kRoutesTokens), "routes tokens");
  // Before the units: a recomputed unit recomputes the experts, not the choice of them.
  PolicySpec spec;
  spec.kept_units = {"attn"};
  spec.recomputed_units = {"router"};
  EXPECT_EQ(Policy::create(spec)->decide(entryOf("aten::topk"), {router}, routes).reason, Reason::kRoutesTokens);
  // A policy that selects nothing is full recompute.
  EXPECT_FALSE(Policy::create({}, {})->decide(entryOf("aten::topk"), {}, routes).held);
  // The opt-out.
  PolicySpec opt_out;
  opt_out.kept_units = {"attn"};
  opt_out.pin_routing = false;
  auto unpinned = Policy::create(opt_out);
  EXPECT_FALSE(unpinned->pinsRouting());
  EXPECT_EQ(unpinned->decide(entryOf("aten::topk"), {router}, routes).reason, Reason::kNotSelected);
}

TEST(PolicyRouting, RoutesTokensReadsTheOpAndItsArguments) {
  EXPECT_TRUE(routesTokens(entryOf("aten::topk").traits, nullptr));
  EXPECT_TRUE(routesTokens(entryOf("aten::argsort").traits, nullptr));
  EXPECT_TRUE(routesTokens(entryOf("aten::argmax").traits, nullptr));
  EXPECT_TRUE(routesTokens(entryOf("aten::sort").traits, nullptr));
  EXPECT_TRUE(routesTokens(entryOf("aten::_local_scalar_dense").traits, nullptr));
  EXPECT_TRUE(routesTokens(entryOf("aten::nonzero").traits, nullptr));
  EXPECT_TRUE(routesTokens(entryOf("aten::_unique2").traits, nullptr));
  EXPECT_FALSE(routesTokens(entryOf("aten::mm").traits, nullptr));
  EXPECT_FALSE(routesTokens(entryOf("aten::_to_copy").traits, nullptr));
  // The op-only half is read once, when the op is classified.
  EXPECT_TRUE(entryOf("aten::topk").traits.is_routing);
  EXPECT_TRUE(entryOf("aten::_local_scalar_dense").traits.is_routing);
  EXPECT_FALSE(entryOf("aten::mm").traits.is_routing);
  EXPECT_FALSE(entryOf("aten::_to_copy").traits.is_routing);
  // A copy from the CPU to the CPU is no device->host copy.
  std::vector<c10::IValue> cpu_copy{at::ones({4}), c10::IValue(), c10::IValue(), c10::Device(c10::kCPU),
                                    c10::IValue(), false,         c10::IValue()};
  EXPECT_FALSE(routesTokens(entryOf("aten::_to_copy").traits, cpu_copy.data()));
  std::vector<c10::IValue> meta_copy{at::ones({4}, at::TensorOptions().device(c10::kMeta)),
                                     c10::IValue(),
                                     c10::IValue(),
                                     c10::Device(c10::kCPU),
                                     c10::IValue(),
                                     false,
                                     c10::IValue()};
  EXPECT_FALSE(routesTokens(entryOf("aten::_to_copy").traits, meta_copy.data()));
}

}  // namespace
}  // namespace sac
