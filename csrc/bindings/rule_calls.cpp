#include "bindings/rule_calls.h"

#include <c10/util/Exception.h>

#include "ops/op_resolution.h"
#include "ops/routing.h"

namespace sac {
namespace {

constexpr int64_t kFactDrawsRandom = 1;
constexpr int64_t kFactCastsAParameter = 2;
constexpr int64_t kFactRoutesTokens = 4;
constexpr int64_t kFactRoutingFromOp = 8;

}  // namespace

int64_t encodeDecision(const Decision& decision) {
  int64_t unit_plus_one = decision.unit == kNoUnit ? 0 : static_cast<int64_t>(decision.unit) + 1;
  return static_cast<int64_t>(decision.outcome) | (static_cast<int64_t>(decision.reason) << 8) |
         (decision.mutating_in_kept_unit ? int64_t{1} << 16 : 0) |
         (decision.random_call_of_kept_op ? int64_t{1} << 17 : 0) | (unit_plus_one << 32);
}

CallFacts callFactsOf(int64_t facts, const OpEntry& op) {
  TORCH_CHECK_VALUE((facts & ~(kFactDrawsRandom | kFactCastsAParameter | kFactRoutesTokens | kFactRoutingFromOp)) == 0,
                    "sac: call facts are bit 0 (draws random numbers), bit 1 (casts a parameter), bit 2 (routes "
                    "tokens) and bit 3 (whether it routes tokens follows from the op), got ",
                    facts);
  CallFacts call;
  call.draws_random = (facts & kFactDrawsRandom) != 0;
  call.casts_a_parameter = (facts & kFactCastsAParameter) != 0;
  call.routes_tokens =
      (facts & kFactRoutesTokens) != 0 || ((facts & kFactRoutingFromOp) != 0 && routesTokens(op.traits, nullptr));
  return call;
}

bool validUnitIdPlusOne(int64_t id_plus_one) {
  if (id_plus_one < 1 || id_plus_one - 1 > int64_t{UINT32_MAX} - 1) return false;
  const UnitId unit = static_cast<UnitId>(id_plus_one - 1);
  if (unit != baseUnit(unit) && !isRegionOpening(unit)) return false;
  return static_cast<size_t>(baseUnit(unit)) < internedUnitCount();
}

int64_t unitIdPlusOne(const std::string& name) { return static_cast<int64_t>(internUnit(name)) + 1; }

const std::vector<UnitId>& openUnitsOf(const std::vector<int64_t>& unit_ids_plus_one) {
  thread_local std::vector<UnitId> units;
  units.clear();
  for (int64_t id_plus_one : unit_ids_plus_one) {
    TORCH_CHECK_VALUE(validUnitIdPlusOne(id_plus_one), "sac: no recompute unit has id ", id_plus_one - 1,
                      " (units cross as unit_id returns them: id + 1)");
    units.push_back(static_cast<UnitId>(id_plus_one - 1));
  }
  return units;
}

const OpEntry& singleOverload(const std::string& name) {
  std::vector<c10::OperatorHandle> handles = resolveOpSpelling(name);
  TORCH_CHECK_VALUE(!handles.empty(), "sac: ", describeUnknownOp(name));
  if (handles.size() == 1) return lookupOp(handles.front());
  const OpEntry* match = nullptr;
  for (const c10::OperatorHandle& handle : handles) {
    const OpEntry& entry = lookupOp(handle);
    if (entry.traits.qualified_name == name) match = &entry;
  }
  TORCH_CHECK_VALUE(match != nullptr, "sac: '", printableName(name), "' names ", handles.size(),
                    " overloads; name one, such as '", lookupOp(handles.front()).traits.qualified_name, "'");
  return *match;
}

int64_t decideIndexedCall(const Policy& policy, const OpEntry& op, const std::vector<int64_t>& unit_ids_plus_one,
                          int64_t call_index, int64_t facts) {
  TORCH_CHECK_VALUE(call_index >= 0, "sac: a call index counts from 0, got ", call_index);
  CallFacts call = callFactsOf(facts, op);
  call.call_index = static_cast<uint64_t>(call_index);
  return encodeDecision(policy.decide(op, openUnitsOf(unit_ids_plus_one), call));
}

int64_t decideNextCall(CallDecider& decider, const OpEntry& op, int64_t pass,
                       const std::vector<int64_t>& unit_ids_plus_one, int64_t facts) {
  TORCH_CHECK_VALUE(pass == 0 || pass == 1, "sac: pass is 0 (forward) or 1 (recompute), got ", pass);
  const CallFacts call = callFactsOf(facts, op);
  return encodeDecision(
      decider.decide(op, pass == 0 ? Pass::kForward : Pass::kRecompute, openUnitsOf(unit_ids_plus_one), call));
}

}  // namespace sac
