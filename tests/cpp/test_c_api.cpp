// The keep rule through the C ABI (bindings/c_api.h), as sac_plugin/_rule.py calls it: the
// encoding of a decision, per-pass counting, and errors as statuses with a message.

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/c_api.h"
#include "policy/policy.h"

namespace sac {
namespace {

const void* entry(const std::string& name) { return sac_op_entry(name.data(), static_cast<int64_t>(name.size())); }

int64_t unitIdPlusOne(const std::string& name) { return sac_unit_id(name.data(), static_cast<int64_t>(name.size())); }

struct Decoded {
  int outcome;
  int reason;
  bool mutating_in_kept_unit;
  bool random_call_of_kept_op;
  int64_t unit_plus_one;
};

Decoded decode(int64_t result) {
  EXPECT_GE(result, 0) << sac_scope_last_error();
  return {static_cast<int>(result & 0xFF), static_cast<int>((result >> 8) & 0xFF), ((result >> 16) & 1) != 0,
          ((result >> 17) & 1) != 0, result >> 32};
}

TEST(KeepRuleCApi, VersionIsNine) { EXPECT_EQ(sac_scope_c_api_version(), 9); }

TEST(KeepRuleCApi, OpEntryNamesExactlyOneOverload) {
  const void* mm = entry("aten::mm.default");
  ASSERT_NE(mm, nullptr);
  EXPECT_EQ(entry("aten.mm.default"), mm);
  // The qualified name a profile writes means the default overload.
  EXPECT_EQ(entry("aten::mm"), mm);
  EXPECT_NE(entry("aten::mm.out"), mm);
  EXPECT_EQ(entry("aten::add"), nullptr);
  EXPECT_EQ(std::string(sac_scope_last_error()).rfind("sac: 'aten::add' names ", 0), 0u) << sac_scope_last_error();
  EXPECT_EQ(entry("aten::not_an_op.default"), nullptr);
  EXPECT_NE(std::string(sac_scope_last_error()).find("unknown op 'aten::not_an_op.default'"), std::string::npos);
  EXPECT_EQ(entry("no namespace"), nullptr);
}

TEST(KeepRuleCApi, PolicyDecideEncodesOutcomeReasonAndUnit) {
  PolicySpec spec;
  spec.kept_units = {"attn"};
  spec.kept_calls = {{"aten::mm.default", {1}}};
  std::shared_ptr<const Policy> policy = Policy::create(spec);
  const int64_t attn = unitIdPlusOne("attn");
  const int64_t other = unitIdPlusOne("other");
  ASSERT_GT(attn, 0);
  const int64_t units[] = {attn, other};

  Decoded kept = decode(sac_policy_decide(&policy, entry("aten::tanh"), units, 2, 0, 0));
  EXPECT_EQ(kept.outcome, static_cast<int>(Outcome::kKeep));
  EXPECT_EQ(kept.reason, static_cast<int>(Reason::kKeptUnit));
  EXPECT_EQ(kept.unit_plus_one, attn);

  Decoded mutating = decode(sac_policy_decide(&policy, entry("aten::add_.Tensor"), units, 1, 0, 0));
  EXPECT_EQ(mutating.outcome, static_cast<int>(Outcome::kRecompute));
  EXPECT_EQ(mutating.reason, static_cast<int>(Reason::kMutatesInput));
  EXPECT_TRUE(mutating.mutating_in_kept_unit);
  EXPECT_EQ(mutating.unit_plus_one, attn);

  Decoded cast = decode(sac_policy_decide(&policy, entry("aten::_to_copy"), units, 1, 0, /*casts*/ 2));
  EXPECT_EQ(cast.reason, static_cast<int>(Reason::kParameterCast));
  EXPECT_EQ(cast.unit_plus_one, 0);

  Decoded second_mm = decode(sac_policy_decide(&policy, entry("aten::mm"), nullptr, 0, 1, 0));
  EXPECT_EQ(second_mm.reason, static_cast<int>(Reason::kKeptCallIndex));
  Decoded random_mm = decode(sac_policy_decide(&policy, entry("aten::mm"), nullptr, 0, 1, /*draws*/ 1));
  EXPECT_EQ(random_mm.reason, static_cast<int>(Reason::kRandomDraw));
  EXPECT_FALSE(random_mm.random_call_of_kept_op);  // mm draws nothing per call: no warning
  EXPECT_EQ(decode(sac_policy_decide(&policy, entry("aten::mm"), nullptr, 0, 2, 0)).reason,
            static_cast<int>(Reason::kNotSelected));
}

TEST(KeepRuleCApi, PolicyDecideEncodesTheOffloadOutcome) {
  PolicySpec spec;
  spec.offloaded_units = {"attn"};
  spec.offloaded_calls = {{"aten::mm.default", {0}}};
  std::shared_ptr<const Policy> policy = Policy::create(spec);
  const int64_t attn = unitIdPlusOne("attn");
  const int64_t units[] = {attn};
  Decoded in_unit = decode(sac_policy_decide(&policy, entry("aten::tanh"), units, 1, 0, 0));
  EXPECT_EQ(in_unit.outcome, static_cast<int>(Outcome::kOffload));
  EXPECT_EQ(in_unit.reason, static_cast<int>(Reason::kOffloadedUnit));
  EXPECT_EQ(in_unit.unit_plus_one, attn);
  Decoded first_mm = decode(sac_policy_decide(&policy, entry("aten::mm"), nullptr, 0, 0, 0));
  EXPECT_EQ(first_mm.outcome, static_cast<int>(Outcome::kOffload));
  EXPECT_EQ(first_mm.reason, static_cast<int>(Reason::kOffloadedCallIndex));
  EXPECT_EQ(decode(sac_policy_decide(&policy, entry("aten::mm"), nullptr, 0, 1, 0)).outcome,
            static_cast<int>(Outcome::kRecompute));
}

TEST(KeepRuleCApi, DeciderCountsEachPassFromZero) {
  PolicySpec spec;
  spec.every_nth_ops = {{"aten::mm.default", 2}};
  std::shared_ptr<const Policy> policy = Policy::create(spec);
  void* decider = sac_call_decider_new(&policy);
  ASSERT_NE(decider, nullptr);
  const void* mm = entry("aten::mm.default");
  auto reason = [&](int32_t pass) { return decode(sac_call_decider_decide(decider, mm, pass, nullptr, 0, 0)).reason; };
  const int every_nth = static_cast<int>(Reason::kEveryNthCall);
  const int not_selected = static_cast<int>(Reason::kNotSelected);
  EXPECT_EQ(std::vector<int>({reason(0), reason(0), reason(0)}),
            std::vector<int>({every_nth, not_selected, every_nth}));
  EXPECT_EQ(std::vector<int>({reason(1), reason(1)}), std::vector<int>({every_nth, not_selected}));
  sac_call_decider_release(decider);
}

TEST(KeepRuleCApi, BadArgumentsAreStatusesWithAMessage) {
  std::shared_ptr<const Policy> policy = Policy::create({}, {});
  const void* mm = entry("aten::mm.default");
  const int64_t bad_unit[] = {int64_t{1} << 40};
  EXPECT_EQ(sac_policy_decide(&policy, mm, bad_unit, 1, 0, 0), -kSacScopeValueError);
  EXPECT_EQ(std::string(sac_scope_last_error()).rfind("sac: no recompute unit has id ", 0), 0u);
  EXPECT_EQ(sac_policy_decide(&policy, mm, nullptr, 0, -1, 0), -kSacScopeValueError);
  EXPECT_EQ(std::string(sac_scope_last_error()), "sac: a call index counts from 0, got -1");
  EXPECT_EQ(sac_policy_decide(&policy, mm, nullptr, 0, 0, 16), -kSacScopeValueError);
  EXPECT_EQ(std::string(sac_scope_last_error()),
            "sac: call facts are bit 0 (draws random numbers), bit 1 (casts a parameter), bit 2 (routes tokens) and "
            "bit 3 (whether it routes tokens follows from the op), got 16");
  EXPECT_EQ(sac_policy_decide(&policy, nullptr, nullptr, 0, 0, 0), -kSacScopeValueError);
  EXPECT_EQ(sac_policy_decide(nullptr, mm, nullptr, 0, 0, 0), -kSacScopeValueError);
  EXPECT_EQ(sac_call_decider_new(nullptr), nullptr);
  EXPECT_EQ(std::string(sac_scope_last_error()), "sac: a call decider needs a policy address, got null");
  void* decider = sac_call_decider_new(&policy);
  EXPECT_EQ(sac_call_decider_decide(decider, mm, 2, nullptr, 0, 0), -kSacScopeValueError);
  EXPECT_EQ(std::string(sac_scope_last_error()), "sac: pass is 0 (forward) or 1 (recompute), got 2");
  sac_call_decider_release(decider);
}

TEST(KeepRuleCApi, ReasonTextCoversEveryReason) {
  for (int32_t reason = 0; reason < kNumReasons; ++reason) {
    ASSERT_NE(sac_reason_text(reason), nullptr) << reason;
    EXPECT_STREQ(sac_reason_text(reason), reasonText(static_cast<Reason>(reason)));
  }
  EXPECT_EQ(sac_reason_text(kNumReasons), nullptr);
  EXPECT_EQ(sac_reason_text(-1), nullptr);
  EXPECT_STREQ(sac_reason_text(static_cast<int32_t>(Reason::kMutatesInput)), "mutates an input");
}

TEST(KeepRuleCApi, RegionOpeningsAndRoutingFactsCross) {
  PolicySpec spec;
  spec.kept_ops = {"aten::tanh"};
  std::shared_ptr<const Policy> policy = Policy::create(spec);
  const int64_t core = unitIdPlusOne("attn.core");
  // NOTE: [Region openings carry their flag]: a recompute=False region keeps; the decision names
  // the unit, not the opening.
  const int64_t save[] = {static_cast<int64_t>(regionOpening(static_cast<UnitId>(core - 1), false)) + 1};
  int64_t kept = sac_policy_decide(&policy, entry("aten::sin.default"), save, 1, 0, 0);
  EXPECT_EQ(kept & 0xFF, static_cast<int64_t>(Outcome::kKeep));
  EXPECT_EQ(kept >> 32, core);
  const int64_t not_an_opening[] = {(int64_t{1} << 31) + core};
  EXPECT_EQ(sac_policy_decide(&policy, entry("aten::sin.default"), not_an_opening, 1, 0, 0), -kSacScopeValueError);
  EXPECT_EQ(sac_unit_push(not_an_opening[0]), -kSacScopeValueError);
  // Routing: given by the caller (bit 2), or read from the op (bit 3).
  const void* topk = entry("aten::topk.default");
  const void* to_copy = entry("aten::_to_copy.default");
  EXPECT_EQ((sac_policy_decide(&policy, topk, nullptr, 0, 0, 8) >> 8) & 0xFF,
            static_cast<int64_t>(Reason::kRoutesTokens));
  EXPECT_EQ((sac_policy_decide(&policy, topk, nullptr, 0, 0, 0) >> 8) & 0xFF,
            static_cast<int64_t>(Reason::kNotSelected));
  EXPECT_EQ((sac_policy_decide(&policy, to_copy, nullptr, 0, 0, 8) >> 8) & 0xFF,
            static_cast<int64_t>(Reason::kNotSelected));
  EXPECT_EQ((sac_policy_decide(&policy, to_copy, nullptr, 0, 0, 4) >> 8) & 0xFF,
            static_cast<int64_t>(Reason::kRoutesTokens));
}

}  // namespace
}  // namespace sac
