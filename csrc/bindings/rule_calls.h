#pragma once
// The keep rule as Python's front doors ask it (torch.compile's policy function, the dispatch-mode
// engine, the planner, through sac_plugin._C's CallDecider and policy_decide): the arguments they
// pass, checked, and the decision they get back, as one int64. Plain C++ that throws
// c10::ValueError for a bad argument, so that GoogleTest checks what Python gets
// (tests/cpp/test_rule_calls.cpp).

#include <cstdint>
#include <string>
#include <vector>

#include "ops/op_catalog.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

namespace sac {

// A decision as one int64, never negative:
//   bits 0-7    Outcome (0 recompute, 1 keep, 2 offload)
//   bits 8-15   Reason (reasonText names it)
//   bit 16      a mutating op selected by a kept unit (worth a warning)
//   bit 17      a selected op's call that draws random numbers, e.g. attention with dropout_p > 0
//               (worth a warning)
//   bits 32-62  the id + 1 of the kept or offloaded unit that selected the call, 0 for none
int64_t encodeDecision(const Decision& decision);

// What the caller knows of a call, as bits: bit 0, it draws random numbers; bit 1, it casts a
// parameter; bit 2, it routes tokens or copies a value to the host (ops/routing.h); bit 3, whether
// it does follows from the op alone (routesTokens without arguments), for a caller that does not
// read the arguments. Other bits are refused.
CallFacts callFactsOf(int64_t facts, const OpEntry& op);

// Units cross as id + 1 (unitIdPlusOne), so that 0 can mean none; a region opening (NOTE: [Region
// openings carry their flag] in policy/unit_stack.h) is valid when the unit it opens is.
bool validUnitIdPlusOne(int64_t id_plus_one);
int64_t unitIdPlusOne(const std::string& name);
// The open units of a decision, checked, in a per-thread vector that keeps its capacity, so a
// decision allocates nothing once warm.
const std::vector<UnitId>& openUnitsOf(const std::vector<int64_t>& unit_ids_plus_one);

// The catalog entry of exactly one op overload: "aten::mm.default", "aten.mm.default", or a
// qualified name as profiles and audits write it ("aten::mm" for the default overload, which is
// how this reads a name that could also mean every overload). Throws c10::ValueError for a name
// that names no overload or several. Entries live as long as the process.
const OpEntry& singleOverload(const std::string& name);

// Decides one call for a caller that knows its 0-based index among the region's counted calls of
// its op (the planner).
int64_t decideIndexedCall(const Policy& policy, const OpEntry& op, const std::vector<int64_t>& unit_ids_plus_one,
                          int64_t call_index, int64_t facts);
// Decides the next call of `op` in pass 0 (forward) or 1 (recompute) of the decider's region.
int64_t decideNextCall(CallDecider& decider, const OpEntry& op, int64_t pass,
                       const std::vector<int64_t>& unit_ids_plus_one, int64_t facts);

}  // namespace sac
