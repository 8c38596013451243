#include "policy/policy.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "policy/op_resolution.h"

namespace sac {
namespace {

// Why an overload can never be kept, or nullptr when it can.
const char* whyNeverKept(const OpTraits& traits) {
  if (traits.is_collective) {
    return "is a collective; collectives are never kept, because the recompute must run them "
           "again on every rank";
  }
  if (traits.is_random && !randomOnlyPerCall(traits)) {
    return "is a random op; random ops are never kept, because skipping one in the recompute "
           "would shift the generator for every random op after it";
  }
  if (traits.mutates_inputs) {
    return "mutates an input; only functional (or out=) ops can be kept, because the recompute "
           "must apply the mutation again";
  }
  if (traits.never_counts) {
    return "carries no activation (metadata, detach, profiler or sac bookkeeping) and is never "
           "intercepted";
  }
  return nullptr;
}

std::vector<const OpEntry*> resolveKeptSpelling(const char* field, const std::string& spelling) {
  std::vector<c10::OperatorHandle> handles = resolveOpSpelling(spelling);
  TORCH_CHECK_VALUE(!handles.empty(), "sac: ", field, ": ", describeUnknownOp(spelling));
  std::vector<const OpEntry*> keepable;
  std::string refusal;
  for (const c10::OperatorHandle& handle : handles) {
    const OpEntry& entry = lookupOp(handle);
    const char* why = whyNeverKept(entry.traits);
    // A collective is refused even inside an every-overload spelling: asking for it is a bug.
    TORCH_CHECK_VALUE(why == nullptr || !entry.traits.is_collective, "sac: ", field, ": '", spelling,
                      "' names ", entry.traits.qualified_name, ", which ", why);
    if (why == nullptr) {
      keepable.push_back(&entry);
    } else if (refusal.empty()) {
      refusal = entry.traits.qualified_name + ", which " + why;
    }
  }
  bool single_overload = !parseOpSpelling(spelling).every_overload;
  TORCH_CHECK_VALUE(!keepable.empty() && (!single_overload || refusal.empty()), "sac: ", field, ": '",
                    spelling, "' names ", refusal);
  return keepable;
}

UnitId internUnitOf(const char* field, const std::string& unit) {
  TORCH_CHECK_VALUE(!unit.empty(), "sac: ", field, ": a unit name must be non-empty, e.g. 'attn' or 'moe_gate'");
  return internUnit(unit);
}

}  // namespace

std::shared_ptr<const Policy> Policy::create(const PolicySpec& spec) {
  std::shared_ptr<Policy> policy(new Policy());
  for (const std::string& spelling : spec.kept_ops) {
    for (const OpEntry* entry : resolveKeptSpelling("kept_ops", spelling)) policy->kept_ops_.insert(entry);
  }
  for (const auto& [spelling, n] : spec.every_nth_ops) {
    TORCH_CHECK_VALUE(n >= 1, "sac: every_nth_op: '", spelling, "' needs n >= 1 (2 keeps every other call), got ", n);
    for (const OpEntry* entry : resolveKeptSpelling("every_nth_op", spelling)) {
      // n is stored exactly (it used to be cut to 32 bits: 2**32 kept nothing, 2**32 + 1 kept
      // every call). Two spellings of one overload ("aten::mm", "aten.mm.default") must agree,
      // or one rule would silently replace the other.
      auto [it, inserted] = policy->every_nth_.try_emplace(entry, static_cast<uint64_t>(n));
      TORCH_CHECK_VALUE(inserted || it->second == static_cast<uint64_t>(n), "sac: every_nth_op: '", spelling,
                        "' gives ", entry->traits.qualified_name, " n = ", n,
                        ", but another entry already gave it n = ", it->second, "; give each op one n");
    }
  }
  for (const auto& [spelling, indices] : spec.kept_calls) {
    for (int64_t index : indices) {
      TORCH_CHECK_VALUE(index >= 0, "sac: kept_calls: '", spelling,
                        "' lists call index ", index, "; indices count the op's calls in a region from 0");
    }
    std::vector<uint64_t> sorted(indices.begin(), indices.end());
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    for (const OpEntry* entry : resolveKeptSpelling("kept_calls", spelling)) {
      // One rule per overload: a kept-calls list beside kept_ops or an every-nth rule for the
      // same overload would make one of them meaningless.
      const char* other = policy->kept_ops_.count(entry) > 0      ? "kept_ops"
                          : policy->every_nth_.count(entry) > 0   ? "every_nth_op"
                          : policy->kept_calls_.count(entry) > 0 ? "kept_calls (another spelling)"
                                                                 : nullptr;
      TORCH_CHECK_VALUE(other == nullptr, "sac: kept_calls: '", spelling, "' names ",
                        entry->traits.qualified_name, ", which ", other,
                        " already names; give each op one rule (kept_ops, every_nth_op or kept_calls)");
      policy->kept_calls_.emplace(entry, sorted);
    }
  }
  for (const std::string& unit : spec.kept_units) policy->kept_units_.insert(internUnitOf("kept_units", unit));
  for (const std::string& unit : spec.recomputed_units) {
    policy->recomputed_units_.insert(internUnitOf("recomputed_units", unit));
  }
  return policy;
}

std::shared_ptr<const Policy> Policy::create(const std::vector<std::string>& kept_ops,
                                             const std::vector<std::string>& kept_units) {
  PolicySpec spec;
  spec.kept_ops = kept_ops;
  spec.kept_units = kept_units;
  return create(spec);
}

Decision Policy::decide(const OpEntry& op, const std::vector<UnitId>& open_units, const CallFacts& call) const {
  Decision decision;
  const OpTraits& traits = op.traits;
  if (traits.is_collective || traits.never_counts || call.casts_a_parameter) return decision;
  if (insideRecomputedUnit(open_units)) return decision;
  if (kept_ops_.count(&op) > 0) {
    decision.keep = !call.draws_random;
    decision.random_call_of_kept_op = call.draws_random;
    return decision;
  }
  if (uint64_t n = everyNth(op); n > 0 && call.call_index % n == 0) {
    decision.keep = !call.draws_random;
    decision.random_call_of_kept_op = call.draws_random;
    return decision;
  }
  if (!kept_calls_.empty()) {
    auto rule = kept_calls_.find(&op);
    if (rule != kept_calls_.end() &&
        std::binary_search(rule->second.begin(), rule->second.end(), static_cast<uint64_t>(call.call_index))) {
      decision.keep = !call.draws_random;
      decision.random_call_of_kept_op = call.draws_random;
      return decision;
    }
  }
  if (kept_units_.empty()) return decision;
  for (auto it = open_units.rbegin(); it != open_units.rend(); ++it) {
    if (kept_units_.count(*it) == 0) continue;
    decision.unit = *it;
    if (traits.mutates_inputs) {
      decision.mutating_in_kept_unit = true;
    } else if (call.draws_random) {
      decision.random_call_of_kept_op = randomOnlyPerCall(traits);
    } else {
      decision.keep = !traits.is_view;
    }
    return decision;
  }
  return decision;
}

std::vector<std::string> Policy::keptOpNames() const {
  std::vector<std::string> names;
  for (const OpEntry* entry : kept_ops_) names.push_back(entry->traits.qualified_name);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> Policy::keptUnitNames() const {
  std::vector<std::string> names;
  for (UnitId unit : kept_units_) names.push_back(unitName(unit));
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> Policy::recomputedUnitNames() const {
  std::vector<std::string> names;
  for (UnitId unit : recomputed_units_) names.push_back(unitName(unit));
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::pair<std::string, int64_t>> Policy::everyNthOps() const {
  std::vector<std::pair<std::string, int64_t>> rules;
  for (const auto& [entry, n] : every_nth_) rules.emplace_back(entry->traits.qualified_name, static_cast<int64_t>(n));
  std::sort(rules.begin(), rules.end());
  return rules;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> Policy::keptCalls() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> rules;
  for (const auto& [entry, indices] : kept_calls_) {
    rules.emplace_back(entry->traits.qualified_name, std::vector<int64_t>(indices.begin(), indices.end()));
  }
  std::sort(rules.begin(), rules.end());
  return rules;
}

bool Policy::claimWarning(const OpEntry& op) const {
  std::lock_guard<std::mutex> lock(warned_mutex_);
  return warned_.insert(&op).second;
}

std::vector<std::string> resolvableOpNames(const std::vector<std::string>& names) {
  std::vector<std::string> resolvable;
  std::string first_problem = "the list is empty";
  for (const std::string& name : names) {
    try {
      if (!resolveOpSpelling(name).empty()) {
        resolvable.push_back(name);
      } else if (resolvable.empty()) {
        first_problem = describeUnknownOp(name);
      }
    } catch (const c10::ValueError& error) {
      if (resolvable.empty()) first_problem = error.what_without_backtrace();
    }
  }
  TORCH_CHECK_VALUE(!resolvable.empty(), "sac: none of the op names resolves to a registered op: [",
                    c10::Join(", ", names), "]; ", first_problem);
  return resolvable;
}

}  // namespace sac
