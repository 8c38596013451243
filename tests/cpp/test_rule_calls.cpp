// The keep rule as Python's front doors ask it (bindings/rule_calls.h, which sac_plugin._C wraps):
// the encoding of a decision, per-pass counting, and errors with their messages.

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/rule_calls.h"
#include "policy/policy.h"

namespace sac {
namespace {

struct Decoded {
  int outcome;
  int reason;
  bool mutating_in_kept_unit;
  bool random_call_of_kept_op;
  int64_t unit_plus_one;
};

Decoded decode(int64_t result) {
  EXPECT_GE(result, 0);
  return {static_cast<int>(result & 0xFF), static_cast<int>((result >> 8) & 0xFF), ((result >> 16) & 1) != 0,
          ((result >> 17) & 1) != 0, result >> 32};
}

// The message of the c10::ValueError `body` throws ("" when it throws none).
template <class Body>
std::string valueError(Body&& body) {
  try {
    body();
  } catch (const c10::ValueError& error) {
    return error.what_without_backtrace();
  }
  return "";
}

TEST(RuleCalls, SingleOverloadNamesExactlyOne) {
  const OpEntry* mm = &singleOverload("aten::mm.default");
  EXPECT_EQ(&singleOverload("aten.mm.default"), mm);
  // The qualified name a profile writes means the default overload.
  EXPECT_EQ(&singleOverload("aten::mm"), mm);
  EXPECT_NE(&singleOverload("aten::mm.out"), mm);
  EXPECT_EQ(valueError([] { singleOverload("aten::add"); }).rfind("sac: 'aten::add' names ", 0), 0u);
  EXPECT_NE(valueError([] { singleOverload("aten::not_an_op.default"); }).find("unknown op 'aten::not_an_op.default'"),
            std::string::npos);
  EXPECT_NE(valueError([] { singleOverload("no namespace"); }), "");
}

TEST(RuleCalls, IndexedCallEncodesOutcomeReasonAndUnit) {
  PolicySpec spec;
  spec.kept_units = {"attn"};
  spec.kept_calls = {{"aten::mm.default", {1}}};
  std::shared_ptr<const Policy> policy = Policy::create(spec);
  const int64_t attn = unitIdPlusOne("attn");
  const int64_t other = unitIdPlusOne("other");
  ASSERT_GT(attn, 0);
  const std::vector<int64_t> units = {attn, other};
  const std::vector<int64_t> none;

  Decoded kept = decode(decideIndexedCall(*policy, singleOverload("aten::tanh"), units, 0, 0));
  EXPECT_EQ(kept.outcome, static_cast<int>(Outcome::kKeep));
  EXPECT_EQ(kept.reason, static_cast<int>(Reason::kKeptUnit));
  EXPECT_EQ(kept.unit_plus_one, attn);

  Decoded mutating = decode(decideIndexedCall(*policy, singleOverload("aten::add_.Tensor"), {attn}, 0, 0));
  EXPECT_EQ(mutating.outcome, static_cast<int>(Outcome::kRecompute));
  EXPECT_EQ(mutating.reason, static_cast<int>(Reason::kMutatesInput));
  EXPECT_TRUE(mutating.mutating_in_kept_unit);
  EXPECT_EQ(mutating.unit_plus_one, attn);

  Decoded cast = decode(decideIndexedCall(*policy, singleOverload("aten::_to_copy"), {attn}, 0, /*casts*/ 2));
  EXPECT_EQ(cast.reason, static_cast<int>(Reason::kParameterCast));
  EXPECT_EQ(cast.unit_plus_one, 0);

  const OpEntry& mm = singleOverload("aten::mm");
  EXPECT_EQ(decode(decideIndexedCall(*policy, mm, none, 1, 0)).reason, static_cast<int>(Reason::kKeptCallIndex));
  Decoded random_mm = decode(decideIndexedCall(*policy, mm, none, 1, /*draws*/ 1));
  EXPECT_EQ(random_mm.reason, static_cast<int>(Reason::kRandomDraw));
  EXPECT_FALSE(random_mm.random_call_of_kept_op);  // mm draws nothing per call: no warning
  EXPECT_EQ(decode(decideIndexedCall(*policy, mm, none, 2, 0)).reason, static_cast<int>(Reason::kNotSelected));
}

TEST(RuleCalls, IndexedCallEncodesTheOffloadOutcome) {
  PolicySpec spec;
  spec.offloaded_units = {"attn"};
  spec.offloaded_calls = {{"aten::mm.default", {0}}};
  std::shared_ptr<const Policy> policy = Policy::create(spec);
  const int64_t attn = unitIdPlusOne("attn");
  Decoded in_unit = decode(decideIndexedCall(*policy, singleOverload("aten::tanh"), {attn}, 0, 0));
  EXPECT_EQ(in_unit.outcome, static_cast<int>(Outcome::kOffload));
  EXPECT_EQ(in_unit.reason, static_cast<int>(Reason::kOffloadedUnit));
  EXPECT_EQ(in_unit.unit_plus_one, attn);
  const OpEntry& mm = singleOverload("aten::mm");
  Decoded first_mm = decode(decideIndexedCall(*policy, mm, {}, 0, 0));
  EXPECT_EQ(first_mm.outcome, static_cast<int>(Outcome::kOffload));
  EXPECT_EQ(first_mm.reason, static_cast<int>(Reason::kOffloadedCallIndex));
  EXPECT_EQ(decode(decideIndexedCall(*policy, mm, {}, 1, 0)).outcome, static_cast<int>(Outcome::kRecompute));
}

TEST(RuleCalls, DeciderCountsEachPassFromZero) {
  PolicySpec spec;
  spec.every_nth_op = {{"aten::mm.default", 2}};
  CallDecider decider(Policy::create(spec));
  const OpEntry& mm = singleOverload("aten::mm.default");
  auto reason = [&](int64_t pass) { return decode(decideNextCall(decider, mm, pass, {}, 0)).reason; };
  const int every_nth = static_cast<int>(Reason::kEveryNthCall);
  const int not_selected = static_cast<int>(Reason::kNotSelected);
  EXPECT_EQ(std::vector<int>({reason(0), reason(0), reason(0)}),
            std::vector<int>({every_nth, not_selected, every_nth}));
  EXPECT_EQ(std::vector<int>({reason(1), reason(1)}), std::vector<int>({every_nth, not_selected}));
}

TEST(RuleCalls, BadArgumentsAreValueErrorsWithAMessage) {
  std::shared_ptr<const Policy> policy = Policy::create({}, {});
  const OpEntry& mm = singleOverload("aten::mm.default");
  EXPECT_EQ(valueError([&] {
              decideIndexedCall(*policy, mm, {int64_t{1} << 40}, 0, 0);
            }).rfind("sac: no recompute unit has id ", 0),
            0u);
  EXPECT_EQ(valueError([&] { decideIndexedCall(*policy, mm, {}, -1, 0); }), "sac: a call index counts from 0, got -1");
  EXPECT_EQ(valueError([&] { decideIndexedCall(*policy, mm, {}, 0, 16); }),
            "sac: call facts are bit 0 (draws random numbers), bit 1 (casts a parameter), bit 2 (routes tokens) and "
            "bit 3 (whether it routes tokens follows from the op), got 16");
  CallDecider decider(policy);
  EXPECT_EQ(valueError([&] { decideNextCall(decider, mm, 2, {}, 0); }),
            "sac: pass is 0 (forward) or 1 (recompute), got 2");
}

TEST(RuleCalls, RegionOpeningsAndRoutingFactsCross) {
  PolicySpec spec;
  spec.kept_ops = {"aten::tanh"};
  std::shared_ptr<const Policy> policy = Policy::create(spec);
  const int64_t core = unitIdPlusOne("attn.core");
  const OpEntry& sin = singleOverload("aten::sin.default");
  // NOTE: [Region openings carry their flag]: a recompute=False region keeps; the decision names
  // the unit, not the opening.
  const int64_t save = static_cast<int64_t>(regionOpening(static_cast<UnitId>(core - 1), false)) + 1;
  EXPECT_TRUE(validUnitIdPlusOne(save));
  int64_t kept = decideIndexedCall(*policy, sin, {save}, 0, 0);
  EXPECT_EQ(kept & 0xFF, static_cast<int64_t>(Outcome::kKeep));
  EXPECT_EQ(kept >> 32, core);
  const int64_t not_an_opening = (int64_t{1} << 31) + core;
  EXPECT_FALSE(validUnitIdPlusOne(not_an_opening));
  EXPECT_NE(valueError([&] { decideIndexedCall(*policy, sin, {not_an_opening}, 0, 0); }), "");
  // Routing: given by the caller (bit 2), or read from the op (bit 3).
  const OpEntry& topk = singleOverload("aten::topk.default");
  const OpEntry& to_copy = singleOverload("aten::_to_copy.default");
  auto reason = [&](const OpEntry& op, int64_t facts) {
    return (decideIndexedCall(*policy, op, {}, 0, facts) >> 8) & 0xFF;
  };
  EXPECT_EQ(reason(topk, 8), static_cast<int64_t>(Reason::kRoutesTokens));
  EXPECT_EQ(reason(topk, 0), static_cast<int64_t>(Reason::kNotSelected));
  EXPECT_EQ(reason(to_copy, 8), static_cast<int64_t>(Reason::kNotSelected));
  EXPECT_EQ(reason(to_copy, 4), static_cast<int64_t>(Reason::kRoutesTokens));
}

}  // namespace
}  // namespace sac
