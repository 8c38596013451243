// The keep rule (NOTE: [The keep rule] in policy.cpp) over every registered op and a grid of call
// facts and open units, and the two places that ask it rather than restating it: a policy's
// refusal of a named op, and a call profile's keepability.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dispatch/call_profile.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "policy/policy.h"
#include "test_support.h"

namespace sac {
namespace {

// Every registered overload, once, with the spelling that names exactly it.
struct RegisteredOp {
  const OpEntry* entry;
  std::string spelling;  // "aten::mm.default", "aten::add.Tensor"
};

const std::vector<RegisteredOp>& everyRegisteredOp() {
  static const std::vector<RegisteredOp> ops = [] {
    std::vector<RegisteredOp> all;
    c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      auto handle = dispatcher.findOp(name);
      if (!handle.has_value() || !handle->hasSchema()) continue;
      all.push_back(
          {&lookupOp(*handle), name.name + "." + (name.overload_name.empty() ? "default" : name.overload_name)});
    }
    return all;
  }();
  return ops;
}

CallFacts facts(bool draws_random, bool casts_a_parameter, uint64_t call_index = 0) {
  CallFacts call;
  call.draws_random = draws_random;
  call.casts_a_parameter = casts_a_parameter;
  call.call_index = call_index;
  return call;
}

bool isKeptReason(Reason reason) {
  return reason == Reason::kKeptOp || reason == Reason::kEveryNthCall || reason == Reason::kKeptCallIndex ||
         reason == Reason::kKeptUnit;
}

TEST(KeepRule, EveryReasonHasText) {
  for (int i = 0; i < kNumReasons; ++i) {
    std::string text = reasonText(static_cast<Reason>(i));
    EXPECT_FALSE(text.empty()) << i;
    EXPECT_EQ(text.find("unknown"), std::string::npos) << i;
  }
  EXPECT_STREQ(reasonText(static_cast<Reason>(kNumReasons)), "unknown reason");
}

// A units policy (kept unit attn, recomputed unit gate) over every registered op: the reason
// follows the rule's order, and the outcome is kKeep exactly for the kept reasons.
TEST(KeepRule, UnitsPolicyOverTheOpCatalog) {
  PolicySpec spec;
  spec.kept_units = {"attn"};
  spec.recomputed_units = {"gate"};
  auto policy = Policy::create(spec);
  const UnitId attn = internUnit("attn");
  const UnitId gate = internUnit("gate");
  const UnitId other = internUnit("other");
  const std::vector<std::vector<UnitId>> stacks = {{},     {other},     {attn}, {other, attn}, {attn, other},
                                                   {gate}, {attn, gate}};
  std::vector<int> seen(kNumReasons, 0);
  size_t ops = 0;
  for (const RegisteredOp& op : everyRegisteredOp()) {
    const OpTraits& traits = op.entry->traits;
    ++ops;
    for (const std::vector<UnitId>& units : stacks) {
      const bool in_gate = std::find(units.begin(), units.end(), gate) != units.end();
      const bool in_attn = std::find(units.begin(), units.end(), attn) != units.end();
      for (bool draws : {false, true}) {
        for (bool casts : {false, true}) {
          Reason expected = traits.is_collective                 ? Reason::kCollective
                            : traits.never_counts                ? Reason::kNeverCounted
                            : traits.is_uninitialised_allocation ? Reason::kUninitialisedAllocation
                            : casts                              ? Reason::kParameterCast
                            : in_gate                            ? Reason::kInsideRecomputedUnit
                            : !in_attn                           ? Reason::kNotSelected
                            : draws                              ? Reason::kRandomDraw
                            : traits.mutates_inputs              ? Reason::kMutatesInput
                            : traits.is_view                     ? Reason::kViewInKeptUnit
                                                                 : Reason::kKeptUnit;
          Decision decision = policy->decide(*op.entry, units, facts(draws, casts));
          ASSERT_EQ(decision.reason, expected)
              << op.spelling << " draws=" << draws << " casts=" << casts << " units=" << units.size() << ": got '"
              << reasonText(decision.reason) << "', expected '" << reasonText(expected) << "'";
          EXPECT_EQ(decision.held, expected == Reason::kKeptUnit) << op.spelling;
          EXPECT_EQ(decision.outcome == Outcome::kKeep, decision.held) << op.spelling;
          const bool selected_by_unit = in_attn && !in_gate && !casts && !traits.is_collective &&
                                        !traits.never_counts && !traits.is_uninitialised_allocation;
          EXPECT_EQ(decision.unit, selected_by_unit ? attn : kNoUnit) << op.spelling;
          EXPECT_EQ(decision.mutating_in_kept_unit, selected_by_unit && traits.mutates_inputs) << op.spelling;
          EXPECT_EQ(decision.random_call_of_kept_op, selected_by_unit && draws && randomOnlyPerCall(traits))
              << op.spelling;
          ++seen[static_cast<int>(decision.reason)];
        }
      }
    }
  }
  EXPECT_GT(ops, 1000u);
  for (Reason reason : {Reason::kKeptUnit, Reason::kCollective, Reason::kNeverCounted, Reason::kRandomDraw,
                        Reason::kMutatesInput, Reason::kViewInKeptUnit, Reason::kParameterCast,
                        Reason::kUninitialisedAllocation, Reason::kInsideRecomputedUnit, Reason::kNotSelected}) {
    EXPECT_GT(seen[static_cast<int>(reason)], 0) << reasonText(reason);
  }
}

// Each op-selection reason, and the vetoes that still apply to a selected call.
TEST(KeepRule, SelectionByOpAndItsVetoes) {
  PolicySpec spec;
  spec.kept_ops = {"aten::tanh", "aten::_scaled_dot_product_flash_attention_for_cpu"};
  spec.every_nth_op = {{"aten::mm.default", 2}};
  spec.kept_calls = {{"aten::bmm.default", {1}}};
  spec.recomputed_units = {"gate"};
  auto policy = Policy::create(spec);
  const UnitId gate = internUnit("gate");
  const OpEntry& tanh = entryOf("aten::tanh");
  const OpEntry& mm = entryOf("aten::mm");
  const OpEntry& bmm = entryOf("aten::bmm");
  const OpEntry& attention = entryOf("aten::_scaled_dot_product_flash_attention_for_cpu");

  EXPECT_EQ(policy->decide(tanh, {}, facts(false, false)).reason, Reason::kKeptOp);
  EXPECT_EQ(policy->decide(mm, {}, facts(false, false, 0)).reason, Reason::kEveryNthCall);
  EXPECT_EQ(policy->decide(mm, {}, facts(false, false, 1)).reason, Reason::kNotSelected);
  EXPECT_EQ(policy->decide(mm, {}, facts(false, false, 2)).reason, Reason::kEveryNthCall);
  EXPECT_EQ(policy->decide(bmm, {}, facts(false, false, 0)).reason, Reason::kNotSelected);
  EXPECT_EQ(policy->decide(bmm, {}, facts(false, false, 1)).reason, Reason::kKeptCallIndex);
  EXPECT_EQ(policy->decide(tanh, {gate}, facts(false, false)).reason, Reason::kInsideRecomputedUnit);
  EXPECT_EQ(policy->decide(mm, {gate}, facts(false, false, 0)).reason, Reason::kInsideRecomputedUnit);
  EXPECT_EQ(policy->decide(entryOf("aten::sin"), {}, facts(false, false)).reason, Reason::kNotSelected);

  Decision with_dropout = policy->decide(attention, {}, facts(true, false));
  EXPECT_EQ(with_dropout.outcome, Outcome::kRecompute);
  EXPECT_EQ(with_dropout.reason, Reason::kRandomDraw);
  EXPECT_TRUE(with_dropout.random_call_of_kept_op);
  Decision without_dropout = policy->decide(attention, {}, facts(false, false));
  EXPECT_EQ(without_dropout.outcome, Outcome::kKeep);
  EXPECT_EQ(without_dropout.reason, Reason::kKeptOp);
  EXPECT_FALSE(without_dropout.random_call_of_kept_op);

  // A parameter cast is recomputed whatever selects it.
  PolicySpec casts;
  casts.kept_ops = {"aten::_to_copy"};
  auto cast_policy = Policy::create(casts);
  EXPECT_EQ(cast_policy->decide(entryOf("aten::_to_copy"), {}, facts(false, true)).reason, Reason::kParameterCast);
  EXPECT_EQ(cast_policy->decide(entryOf("aten::_to_copy"), {}, facts(false, false)).reason, Reason::kKeptOp);
}

TEST(KeepRule, UninitialisedAllocationsAreFlaggedByOverload) {
  for (const char* name :
       {"aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided", "aten::new_empty_strided"}) {
    for (const c10::OperatorHandle& handle : resolveOpSpelling(name)) {
      EXPECT_TRUE(lookupOp(handle).traits.is_uninitialised_allocation) << name;
    }
  }
  EXPECT_TRUE(entryOf("aten::empty", "memory_format").traits.is_uninitialised_allocation);
  EXPECT_FALSE(entryOf("aten::zeros").traits.is_uninitialised_allocation);
  EXPECT_FALSE(entryOf("aten::zeros_like").traits.is_uninitialised_allocation);
  EXPECT_FALSE(entryOf("aten::full").traits.is_uninitialised_allocation);
}

// Naming an op is refused exactly when the rule recomputes every call a policy naming it could
// make; the refusal names the rule's reason.
TEST(KeepRule, RefusingANamedOpAgreesWithDecide) {
  size_t refused = 0;
  for (const RegisteredOp& op : everyRegisteredOp()) {
    const OpTraits& traits = op.entry->traits;
    CallFacts every_call = facts(traits.is_random && !randomOnlyPerCall(traits), false);
    Decision named = Policy::decideNamed(*op.entry, every_call);
    std::string error;
    try {
      Policy::create({op.spelling}, {});
    } catch (const c10::ValueError& e) {
      error = e.what_without_backtrace();
    }
    if (named.held) {
      EXPECT_EQ(error, "") << op.spelling;
      continue;
    }
    ++refused;
    ASSERT_FALSE(error.empty()) << op.spelling << " is never kept (" << reasonText(named.reason)
                                << ") but naming it is accepted";
    EXPECT_NE(error.find("which " + std::string(whyNeverKeptText(named.reason))), std::string::npos)
        << op.spelling << ": " << error;
  }
  EXPECT_GT(refused, 100u);
}

// A call profile offers a call to a plan exactly when a policy naming the call would keep it,
// except for calls that hold no storage of their own (views, out= ops), which it labels itself.
TEST(KeepRule, CallProfileKeepabilityAgreesWithDecide) {
  for (const RegisteredOp& op : everyRegisteredOp()) {
    const OpTraits& traits = op.entry->traits;
    for (bool draws : {false, true}) {
      for (bool casts : {false, true}) {
        Decision named = Policy::decideNamed(*op.entry, facts(draws, casts));
        std::string label = whyNotKeepable(*op.entry, facts(draws, casts));
        if (!named.held) {
          EXPECT_EQ(label, reasonText(named.reason)) << op.spelling;
        } else if (traits.is_view) {
          EXPECT_EQ(label, "view") << op.spelling;
        } else if (traits.writes_out_arguments) {
          EXPECT_EQ(label, "out= op") << op.spelling;
        } else {
          EXPECT_EQ(label, "") << op.spelling;
        }
      }
    }
  }
  EXPECT_EQ(std::string(whyNotKeepable(entryOf("aten::add_", "Tensor"), facts(false, false))), "mutates an input");
  EXPECT_EQ(std::string(whyNotKeepable(entryOf("aten::empty_like"), facts(false, false))), "uninitialised allocation");
  EXPECT_EQ(std::string(whyNotKeepable(entryOf("aten::mm"), facts(false, false))), "");
}

TEST(CallDecider, CountsEachPassLikeTheFallback) {
  PolicySpec spec;
  spec.every_nth_op = {{"aten::mm.default", 2}};
  spec.recomputed_units = {"gate"};
  CallDecider decider(Policy::create(spec));
  const OpEntry& mm = entryOf("aten::mm");
  const UnitId gate = internUnit("gate");
  auto reasons = [&](Pass pass, const std::vector<UnitId>& units, int calls) {
    std::vector<Reason> got;
    for (int i = 0; i < calls; ++i) got.push_back(decider.decide(mm, pass, units, CallFacts{}).reason);
    return got;
  };
  EXPECT_EQ(reasons(Pass::kForward, {}, 3),
            (std::vector<Reason>{Reason::kEveryNthCall, Reason::kNotSelected, Reason::kEveryNthCall}));
  // A call inside a recomputed unit takes no index: the next forward call is index 3.
  EXPECT_EQ(reasons(Pass::kForward, {gate}, 1), std::vector<Reason>{Reason::kInsideRecomputedUnit});
  EXPECT_EQ(reasons(Pass::kForward, {}, 1), std::vector<Reason>{Reason::kNotSelected});
  // The recompute counts from 0 again.
  EXPECT_EQ(reasons(Pass::kRecompute, {}, 2), (std::vector<Reason>{Reason::kEveryNthCall, Reason::kNotSelected}));
}

}  // namespace
}  // namespace sac
