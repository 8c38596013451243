#include "policy/policy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "ops/op_resolution.h"
#include "policy/unit_stack.h"

namespace sac {
namespace {

// Why no policy may name `entry`, or nullptr when one may: the keep rule's reason when it
// recomputes every call of the op that a policy naming it could make. Random ops are asked with
// a call that draws (every call of one does, except attention with dropout_p == 0); whether a
// call casts a parameter is a fact of the call, never of the op.
const char* whyNeverKept(const OpEntry& entry) {
  CallFacts every_call;
  every_call.draws_random = entry.traits.is_random && !randomOnlyPerCall(entry.traits);
  Decision named = Policy::decideNamed(entry, every_call);
  return named.held ? nullptr : whyNeverKeptText(named.reason);
}

std::vector<const OpEntry*> resolveKeptSpelling(const char* field, const std::string& spelling) {
  std::vector<c10::OperatorHandle> handles = resolveOpSpelling(spelling);
  TORCH_CHECK_VALUE(!handles.empty(), "sac: ", field, ": ", describeUnknownOp(spelling));
  std::vector<const OpEntry*> keepable;
  std::string refusal;
  for (const c10::OperatorHandle& handle : handles) {
    const OpEntry& entry = lookupOp(handle);
    const char* why = whyNeverKept(entry);
    // A collective is refused even inside an every-overload spelling: asking for it is a bug.
    TORCH_CHECK_VALUE(why == nullptr || !entry.traits.is_collective, "sac: ", field, ": '", spelling, "' names ",
                      entry.traits.qualified_name, ", which ", why);
    if (why == nullptr) {
      keepable.push_back(&entry);
    } else if (refusal.empty()) {
      refusal = entry.traits.qualified_name + ", which " + why;
    }
  }
  bool single_overload = !parseOpSpelling(spelling).every_overload;
  TORCH_CHECK_VALUE(!keepable.empty() && (!single_overload || refusal.empty()), "sac: ", field, ": '", spelling,
                    "' names ", refusal);
  return keepable;
}

// A call-index list as a policy stores it: every index >= 0, ascending, without repeats.
// The name of the first rule that already names an op (each: the rule's field and whether it
// names the op), or null when none does.
const char* firstNaming(std::initializer_list<std::pair<const char*, bool>> rules) {
  for (const auto& [field, names_it] : rules) {
    if (names_it) return field;
  }
  return nullptr;
}

std::vector<uint64_t> callIndices(const char* field, const std::string& spelling, const std::vector<int64_t>& indices) {
  for (int64_t index : indices) {
    TORCH_CHECK_VALUE(index >= 0, "sac: ", field, ": '", spelling, "' lists call index ", index,
                      "; indices count the op's calls in a region from 0");
  }
  std::vector<uint64_t> sorted(indices.begin(), indices.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  return sorted;
}

UnitId internUnitOf(const char* field, const std::string& unit) {
  TORCH_CHECK_VALUE(!unit.empty(), "sac: ", field, ": a unit name must be non-empty, e.g. 'attn' or 'moe_gate'");
  return internUnit(unit);
}

// Adds a name or a pattern to one of the policy's unit lists. Patterns are not interned: they
// name no unit of their own, and a config may hold many.
void addUnit(const char* field, const std::string& unit, UnitList& list) {
  if (!isUnitPattern(unit)) {
    list.add(internUnitOf(field, unit));
    return;
  }
  TORCH_CHECK_VALUE(unit.size() <= kMaxUnitNameLength && unit.find('\0') == std::string::npos, "sac: ", field,
                    ": a unit pattern has at most ", kMaxUnitNameLength, " characters and no NUL, got '",
                    printableName(unit), "'");
  if (!list.hasPattern(unit)) list.addPattern(unit);
}

bool bothName(const UnitList& kept, const std::string& unit) {
  return isUnitPattern(unit) ? kept.hasPattern(unit) : kept.namesExactly(internUnit(unit));
}

}  // namespace

std::shared_ptr<const Policy> Policy::create(const PolicySpec& spec) {
  std::shared_ptr<Policy> policy(new Policy());
  for (const std::string& spelling : spec.kept_ops) {
    for (const OpEntry* entry : resolveKeptSpelling("kept_ops", spelling)) policy->kept_ops_.insert(entry);
  }
  for (const auto& [spelling, n] : spec.every_nth_op) {
    TORCH_CHECK_VALUE(n >= 1, "sac: every_nth_op: '", spelling, "' needs n >= 1 (2 keeps every other call), got ", n);
    for (const OpEntry* entry : resolveKeptSpelling("every_nth_op", spelling)) {
      // n is stored exactly, as 64 bits. Two spellings of one overload ("aten::mm",
      // "aten.mm.default") must agree, or one rule would silently replace the other.
      auto [it, inserted] = policy->every_nth_.try_emplace(entry, static_cast<uint64_t>(n));
      TORCH_CHECK_VALUE(inserted || it->second == static_cast<uint64_t>(n), "sac: every_nth_op: '", spelling,
                        "' gives ", entry->traits.qualified_name, " n = ", n,
                        ", but another entry already gave it n = ", it->second, "; give each op one n");
    }
  }
  for (const auto& [spelling, indices] : spec.kept_calls) {
    std::vector<uint64_t> sorted = callIndices("kept_calls", spelling, indices);
    for (const OpEntry* entry : resolveKeptSpelling("kept_calls", spelling)) {
      // One rule per overload: a kept-calls list beside kept_ops or an every-nth rule for the
      // same overload would make one of them meaningless.
      const char* other = firstNaming({{"kept_ops", policy->kept_ops_.count(entry) > 0},
                                       {"every_nth_op", policy->every_nth_.count(entry) > 0},
                                       {"kept_calls (another spelling)", policy->kept_calls_.count(entry) > 0}});
      TORCH_CHECK_VALUE(other == nullptr, "sac: kept_calls: '", spelling, "' names ", entry->traits.qualified_name,
                        ", which ", other,
                        " already names; give each op one rule (kept_ops, every_nth_op or kept_calls)");
      policy->kept_calls_.emplace(entry, sorted);
    }
  }
  for (const std::string& spelling : spec.offloaded_ops) {
    for (const OpEntry* entry : resolveKeptSpelling("offloaded_ops", spelling)) {
      // NOTE: [Offloading kept outputs] (dispatch/offload.cpp): a view holds no memory of its own.
      TORCH_CHECK_VALUE(!entry->traits.is_view, "sac: offloaded_ops: '", spelling, "' names ",
                        entry->traits.qualified_name,
                        ", which is a view; a view holds no memory of its own, so offloading it frees nothing "
                        "(name it in kept_ops, or offload the op that makes its base)");
      const char* other = policy->kept_ops_.count(entry) > 0     ? "kept_ops"
                          : policy->every_nth_.count(entry) > 0  ? "every_nth_op"
                          : policy->kept_calls_.count(entry) > 0 ? "kept_calls"
                                                                 : nullptr;
      TORCH_CHECK_VALUE(other == nullptr, "sac: offloaded_ops: '", spelling, "' names ", entry->traits.qualified_name,
                        ", which ", other, " already names; give each op one rule");
      policy->offloaded_ops_.insert(entry);
    }
  }
  for (const auto& [spelling, indices] : spec.offloaded_calls) {
    std::vector<uint64_t> sorted = callIndices("offloaded_calls", spelling, indices);
    for (const OpEntry* entry : resolveKeptSpelling("offloaded_calls", spelling)) {
      TORCH_CHECK_VALUE(!entry->traits.is_view, "sac: offloaded_calls: '", spelling, "' names ",
                        entry->traits.qualified_name,
                        ", which is a view; a view holds no memory of its own, so offloading it frees nothing");
      // Kept and offloaded calls of one op share its call count, so the two lists may share an
      // op as long as no index is in both.
      const char* other =
          firstNaming({{"kept_ops", policy->kept_ops_.count(entry) > 0},
                       {"every_nth_op", policy->every_nth_.count(entry) > 0},
                       {"offloaded_ops", policy->offloaded_ops_.count(entry) > 0},
                       {"offloaded_calls (another spelling)", policy->offloaded_calls_.count(entry) > 0}});
      TORCH_CHECK_VALUE(other == nullptr, "sac: offloaded_calls: '", spelling, "' names ", entry->traits.qualified_name,
                        ", which ", other,
                        " already names; give each op one rule (kept_calls and offloaded_calls may share an op)");
      for (uint64_t index : sorted) {
        TORCH_CHECK_VALUE(!policy->keptCallIndex(*entry, index), "sac: offloaded_calls: '", spelling, "' lists call ",
                          index, " of ", entry->traits.qualified_name,
                          ", which kept_calls lists too; a call is kept or offloaded, not both");
      }
      policy->offloaded_calls_.emplace(entry, sorted);
    }
  }
  TORCH_CHECK_VALUE(spec.offload_min_bytes >= 0, "sac: offload_min_bytes must be >= 0 bytes, got ",
                    spec.offload_min_bytes);
  TORCH_CHECK_VALUE(spec.host_memory_limit >= -1, "sac: host_memory_limit must be >= 0 bytes (or none), got ",
                    spec.host_memory_limit);
  policy->offload_min_bytes_ = spec.offload_min_bytes;
  policy->host_memory_limit_ = spec.host_memory_limit;
  for (const std::string& unit : spec.kept_units) addUnit("kept_units", unit, policy->kept_units_);
  for (const std::string& unit : spec.offloaded_units) {
    TORCH_CHECK_VALUE(unit.empty() || !bothName(policy->kept_units_, unit), "sac: offloaded_units: '", unit,
                      "' is in kept_units too; a unit is kept or offloaded, not both");
    addUnit("offloaded_units", unit, policy->offloaded_units_);
  }
  for (const std::string& unit : spec.recomputed_units) {
    addUnit("recomputed_units", unit, policy->recomputed_units_);
  }
  policy->pin_routing_ = spec.pin_routing;
  policy->offload_inputs_ = spec.offload_inputs;
  return policy;
}

std::shared_ptr<const Policy> Policy::create(const std::vector<std::string>& kept_ops,
                                             const std::vector<std::string>& kept_units) {
  PolicySpec spec;
  spec.kept_ops = kept_ops;
  spec.kept_units = kept_units;
  return create(spec);
}

namespace {

Decision recomputed(Reason reason) {
  Decision decision;
  decision.reason = reason;
  return decision;
}

}  // namespace

// NOTE: [The keep rule]
// One call's outputs are kept for backward, or recomputed in the backward's recompute. The rule,
// in order (the first that applies decides):
//   1. Never kept, whatever the policy says, for what the op or the call is:
//      - a collective (the recompute must run it again on every rank);
//      - an op that is never counted (metadata, detach, profiler, sac's own: no activation);
//      - an uninitialised allocation (empty, empty_like, ...: garbage until its first write,
//        and a kept output holds its value from before a write in the forward);
//      - a call that casts a parameter (NOTE: [Autocast's weight casts] in op_traits.h).
//   2. Kept, under a policy that selects anything: a call that routes tokens or copies a value
//      to the host (NOTE: [Routing is served from the forward], below), unless the policy opts
//      out (pin_routing = false); offloaded instead where an offload rule of 4 selects it.
//   3. Recomputed inside a recomputed unit: any open recomputed unit wins over every selection.
//   4. Selected, by the first that holds: the op is in the kept-op (offloaded-op) set; the call's
//      index is a multiple of the op's every-nth n; the call's index is in the op's kept-call
//      (offloaded-call) list (indices count the region's forward calls of the op outside
//      recomputed units: countsCalls); the call runs inside a kept (offloaded) unit, or inside a
//      torch_remat region with recompute=False that no list names, the innermost such unit or
//      region deciding (a region with recompute=True decides too: not selected; see
//      innermostSelectingUnit), under a policy that selects something (one that selects nothing
//      is full recompute). Anything else is not selected and recomputed. A call
//      selected by an offload rule is offloaded, by a keep rule kept.
//   5. A selected call is still recomputed when it draws random numbers (the recompute must draw
//      the same numbers in the same order), when it mutates an input (the recompute must apply
//      the mutation again), and, when a kept unit selected it, when it is a view (free to
//      recompute, and keeping one would pin its base). A named view is kept: the user asked.
//   Otherwise the call is kept (offloaded). Offloading is how an output is held, not whether:
//   the vetoes of 1, 3 and 5 are the same for both, and where an output cannot be offloaded (it
//   is on the CPU, smaller than offload_min_bytes, past host_memory_limit) the region keeps it
//   on its device (NOTE: [Offloading kept outputs] in dispatch/offload.cpp).
// Declarations ask the same rule: naming an op whose every call the rule recomputes is refused
// (whyNeverKept, through decideNamed), so collectives, random ops other than attention,
// mutating ops, never-counted ops and uninitialised allocations cannot be named. Call profiles
// offer a plan only the calls decideNamed keeps. docs/semantics.md states the rule for users.
Decision Policy::decide(const OpEntry& op, const std::vector<UnitId>& open_units, const CallFacts& call) const {
  const OpTraits& traits = op.traits;
  // 1.
  if (traits.is_collective) return recomputed(Reason::kCollective);
  if (traits.never_counts) return recomputed(Reason::kNeverCounted);
  if (traits.is_uninitialised_allocation) return recomputed(Reason::kUninitialisedAllocation);
  if (call.casts_a_parameter) return recomputed(Reason::kParameterCast);
  // 2. After the vetoes of 1, which no routing call meets except a cast of a parameter to the CPU
  // (whose input is always at hand), and before the units of 3: a recomputed unit recomputes
  // the experts, never the choice of them.
  // A routing call an offload rule selects is held on the host: where it is held is the offload
  // rules' to say, that it is held is routing's.
  if (call.routes_tokens && pin_routing_ && !keepsNothing()) {
    Decision decision;
    decision.outcome = selectedForOffload(op, open_units, call) ? Outcome::kOffload : Outcome::kKeep;
    decision.reason = Reason::kRoutesTokens;
    decision.held = true;
    return decision;
  }
  // 3.
  if (insideRecomputedUnit(open_units)) return recomputed(Reason::kInsideRecomputedUnit);
  // 4. A policy that selects nothing is full recompute, whatever a region's flag says.
  if (keepsNothing()) return recomputed(Reason::kNotSelected);
  Reason selected = Reason::kKeptUnit;
  UnitId unit = kNoUnit;
  if (kept_ops_.count(&op) > 0) {
    selected = Reason::kKeptOp;
  } else if (uint64_t n = everyNth(op); n > 0 && call.call_index % n == 0) {
    selected = Reason::kEveryNthCall;
  } else if (keptCallIndex(op, call.call_index)) {
    selected = Reason::kKeptCallIndex;
  } else if (!offloadsNothing() && offloaded_ops_.count(&op) > 0) {
    selected = Reason::kOffloadedOp;
  } else if (offloadedCallIndex(op, call.call_index)) {
    selected = Reason::kOffloadedCallIndex;
  } else if ((unit = innermostSelectingUnit(open_units)) == kNoUnit) {
    return recomputed(Reason::kNotSelected);
  } else if (offloaded_units_.names(unit)) {
    selected = Reason::kOffloadedUnit;
  }
  const bool offload =
      selected == Reason::kOffloadedOp || selected == Reason::kOffloadedCallIndex || selected == Reason::kOffloadedUnit;
  // 5.
  Decision decision;
  decision.unit = unit;
  decision.mutating_in_kept_unit = unit != kNoUnit && traits.mutates_inputs;
  decision.random_call_of_kept_op = call.draws_random && randomOnlyPerCall(traits);
  if (call.draws_random) {
    decision.reason = Reason::kRandomDraw;
  } else if (traits.mutates_inputs) {
    decision.reason = Reason::kMutatesInput;
  } else if (traits.is_view && unit != kNoUnit) {
    decision.reason = Reason::kViewInKeptUnit;
  } else {
    decision.outcome = offload ? Outcome::kOffload : Outcome::kKeep;
    decision.reason = selected;
    decision.held = true;
  }
  return decision;
}

// NOTE: [Routing is served from the forward]
// A router is not bitwise repeatable where its reductions are not (split-K matmuls, atomics): a
// near-tie that the forward broke one way the recompute may break the other, and then sends
// tokens to other experts. Where the expert counts change, torch's checkpoint fails on tensor
// shapes; where they do not, the gradients are silently wrong. So under any policy that selects
// something, the calls that decide the routing, and the copies that bring a device value to the
// host (which would also make the recompute wait on the device), are kept whatever the units
// say: routesTokens in ops/routing.h lists them. They cost little (tokens x k integers, a few
// scalars). PolicySpec::pin_routing = false opts out: the routing is then recomputed like any
// other call, and must repeat itself.
Decision Policy::decideNamed(const OpEntry& op, const CallFacts& call) {
  Policy naming;
  naming.kept_ops_.insert(&op);
  return naming.decide(op, {}, call);
}

bool Policy::selectedForOffload(const OpEntry& op, const std::vector<UnitId>& open_units, const CallFacts& call) const {
  if (offloadsNothing()) return false;
  if (offloaded_ops_.count(&op) > 0 || offloadedCallIndex(op, call.call_index)) return true;
  const UnitId unit = innermostSelectingUnit(open_units);
  return unit != kNoUnit && offloaded_units_.names(unit);
}

bool Policy::keptCallIndex(const OpEntry& op, uint64_t call_index) const {
  if (kept_calls_.empty()) return false;
  auto rule = kept_calls_.find(&op);
  return rule != kept_calls_.end() && std::binary_search(rule->second.begin(), rule->second.end(), call_index);
}

bool Policy::offloadedCallIndex(const OpEntry& op, uint64_t call_index) const {
  if (offloaded_calls_.empty()) return false;
  auto rule = offloaded_calls_.find(&op);
  return rule != offloaded_calls_.end() && std::binary_search(rule->second.begin(), rule->second.end(), call_index);
}

const char* reasonText(Reason reason) {
  switch (reason) {
    case Reason::kKeptOp:
      return "kept op";
    case Reason::kEveryNthCall:
      return "every-nth call";
    case Reason::kKeptCallIndex:
      return "kept call index";
    case Reason::kKeptUnit:
      return "kept unit";
    case Reason::kCollective:
      return "collective";
    case Reason::kNeverCounted:
      return "never counted";
    case Reason::kRandomDraw:
      return "draws random numbers";
    case Reason::kMutatesInput:
      return "mutates an input";
    case Reason::kViewInKeptUnit:
      return "view in a kept unit";
    case Reason::kParameterCast:
      return "casts a parameter";
    case Reason::kUninitialisedAllocation:
      return "uninitialised allocation";
    case Reason::kInsideRecomputedUnit:
      return "inside a recomputed unit";
    case Reason::kNotSelected:
      return "not selected";
    case Reason::kOffloadedOp:
      return "offloaded op";
    case Reason::kOffloadedCallIndex:
      return "offloaded call index";
    case Reason::kOffloadedUnit:
      return "offloaded unit";
    case Reason::kRoutesTokens:
      return "routes tokens";
  }
  return "unknown reason";
}

const char* whyNeverKeptText(Reason reason) {
  switch (reason) {
    case Reason::kCollective:
      return "is a collective; collectives are never kept, because the recompute must run them again on every rank";
    case Reason::kRandomDraw:
      return "is a random op; random ops are never kept, because skipping one in the recompute would shift the "
             "generator for every random op after it";
    case Reason::kMutatesInput:
      return "mutates an input; only functional (or out=) ops can be kept, because the recompute must apply the "
             "mutation again";
    case Reason::kNeverCounted:
      return "carries no activation (metadata, detach, profiler or sac bookkeeping) and is never intercepted";
    case Reason::kUninitialisedAllocation:
      return "allocates uninitialised memory; keeping it is useless, because its contents are garbage until its "
             "first write, which would discard the kept output";
    default:
      return reasonText(reason);
  }
}

Decision CallDecider::decide(const OpEntry& op, Pass pass, const std::vector<UnitId>& open_units, CallFacts call) {
  if (policy_->countsCalls(op, open_units)) call.call_index = calls_[static_cast<int>(pass)][&op]++;
  return policy_->decide(op, open_units, call);
}

bool isUnitPattern(const std::string& name) { return name.find('*') != std::string::npos; }

bool unitPatternMatches(const std::string& pattern, const std::string& name) {
  // Greedy wildcard matching with one backtrack point: linear in practice, never exponential.
  size_t p = 0, n = 0, star = std::string::npos, resume = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

bool UnitList::matchesPattern(UnitId unit) const {
  const std::string& name = unitName(unit);
  for (const std::string& pattern : patterns_) {
    if (unitPatternMatches(pattern, name)) return true;
  }
  return false;
}

bool UnitList::hasPattern(const std::string& pattern) const {
  return std::find(patterns_.begin(), patterns_.end(), pattern) != patterns_.end();
}

std::vector<std::string> UnitList::sortedNames() const {
  std::vector<std::string> names(patterns_.begin(), patterns_.end());
  for (UnitId unit : units_) names.push_back(unitName(unit));
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> Policy::keptUnitNames() const { return kept_units_.sortedNames(); }

std::vector<std::string> Policy::recomputedUnitNames() const { return recomputed_units_.sortedNames(); }

std::vector<std::pair<std::string, int64_t>> Policy::everyNthOps() const {
  std::vector<std::pair<std::string, int64_t>> rules;
  for (const auto& [entry, n] : every_nth_) rules.emplace_back(entry->traits.qualified_name, static_cast<int64_t>(n));
  std::sort(rules.begin(), rules.end());
  return rules;
}

namespace {

std::vector<std::string> sortedOpNames(const HashSet<const OpEntry*>& ops) {
  std::vector<std::string> names;
  for (const OpEntry* entry : ops) names.push_back(entry->traits.qualified_name);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> sortedCallRules(
    const HashMap<const OpEntry*, std::vector<uint64_t>>& calls) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> rules;
  for (const auto& [entry, indices] : calls) {
    rules.emplace_back(entry->traits.qualified_name, std::vector<int64_t>(indices.begin(), indices.end()));
  }
  std::sort(rules.begin(), rules.end());
  return rules;
}

}  // namespace

std::vector<std::string> Policy::keptOpNames() const { return sortedOpNames(kept_ops_); }
std::vector<std::string> Policy::offloadedOpNames() const { return sortedOpNames(offloaded_ops_); }
std::vector<std::pair<std::string, std::vector<int64_t>>> Policy::keptCalls() const {
  return sortedCallRules(kept_calls_);
}

std::vector<std::string> Policy::offloadedUnitNames() const { return offloaded_units_.sortedNames(); }

std::vector<std::pair<std::string, std::vector<int64_t>>> Policy::offloadedCalls() const {
  return sortedCallRules(offloaded_calls_);
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
