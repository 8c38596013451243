#pragma once
// A selective-checkpointing policy: which calls keep their outputs for backward and which are
// recomputed. A policy selects calls by op (kept ops, every-nth rules, kept call indices) and by
// the recompute units they run in (kept units, recomputed units); Policy::decide applies the
// keep rule to one call, and is the only place the rule is written: NOTE: [The keep rule] in
// policy.cpp (docs/semantics.md states it for users).

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ops/hash_containers.h"
#include "ops/op_catalog.h"
#include "ops/routing.h"  // CallFacts::routes_tokens: the callers that set it include only this header
#include "policy/unit_stack.h"

namespace sac {

inline constexpr UnitId kNoUnit = UINT32_MAX;

// What happens to a call's outputs. Values cross to Python (bindings/rule_calls.h), which mirrors
// them (sac_plugin/_native.py). An offloaded output is served in the recompute like a kept one, but
// lives in pinned host memory between the forward and the backward (NOTE: [Offloading kept
// outputs] in dispatch/offload.cpp).
enum class Outcome : uint8_t { kRecompute = 0, kKeep = 1, kOffload = 2 };

// Why decide reached its outcome. Values cross to Python, which mirrors them
// (sac_plugin/_native.py): append new reasons, never renumber.
enum class Reason : uint8_t {
  // Kept: the call is selected, and nothing vetoes it.
  kKeptOp = 0,         // its overload is in the kept-op set
  kEveryNthCall = 1,   // its index is a multiple of its op's every-nth n
  kKeptCallIndex = 2,  // its index is in its op's kept-call list
  kKeptUnit = 3,       // it runs inside a kept unit
  // Recomputed.
  kCollective = 4,
  kNeverCounted = 5,              // metadata, detach, profiler or sac bookkeeping
  kRandomDraw = 6,                // the call draws from a generator
  kMutatesInput = 7,              // selected (by a kept unit) but writes an input
  kViewInKeptUnit = 8,            // a view selected by a kept unit
  kParameterCast = 9,             // NOTE: [Autocast's weight casts] in op_traits.h
  kUninitialisedAllocation = 10,  // OpTraits::is_uninitialised_allocation
  kInsideRecomputedUnit = 11,
  kNotSelected = 12,
  // Offloaded: selected by an offload rule, and nothing vetoes it.
  kOffloadedOp = 13,         // its overload is in the offloaded-op set
  kOffloadedCallIndex = 14,  // its index is in its op's offloaded-call list
  kOffloadedUnit = 15,       // it runs inside an offloaded unit
  // Kept: NOTE: [Routing is served from the forward] in policy.cpp.
  kRoutesTokens = 16,
};
inline constexpr int kNumReasons = 17;

// A short label ("mutates an input", "kept unit"), as call profiles and Python report it;
// "unknown reason" for a value that is no Reason.
const char* reasonText(Reason reason);
// Why no policy may name an op whose calls are all recomputed for `reason` ("is a collective;
// collectives are never kept, because ..."), the clause of a declaration's refusal; the label for
// reasons that depend on the call rather than on the op.
const char* whyNeverKeptText(Reason reason);

struct Decision {
  Outcome outcome = Outcome::kRecompute;
  Reason reason = Reason::kNotSelected;
  // The outputs are held for the recompute: outcome is kKeep or kOffload.
  bool held = false;
  // The kept or offloaded unit that selected the call (kNoUnit when selected by op or not
  // selected).
  UnitId unit = kNoUnit;
  // Worth a warning, once per checkpoint site and op: a mutating op selected by a kept unit, and a call
  // of a selected op that draws random numbers only in some calls (attention with dropout_p > 0).
  bool mutating_in_kept_unit = false;
  bool random_call_of_kept_op = false;
};

// Unit names in a policy's lists are names ('attn', 'layers.0.attention') or patterns, where
// each '*' matches any run of characters, dots and slashes included, and every other character
// matches itself, as torchtitan's region patterns do ('*', '*routed_experts.w13.*').
struct PolicySpec {
  std::vector<std::string> kept_ops;
  std::vector<std::string> kept_units;
  // (op, n): keep calls 1, n+1, 2n+1, ... of the op in each region ("every other matmul" is n=2),
  // counting every call of the op in the region, so forward and recompute count alike.
  std::vector<std::pair<std::string, int64_t>> every_nth_op;
  // (op, indices): keep exactly these calls of the op in each region, by 0-based index among the
  // region's forward calls of it, counted as every-nth rules count them (a memory-budget plan
  // is one). Indices are >= 0; repeats are merged; an op has one rule of one kind.
  std::vector<std::pair<std::string, std::vector<int64_t>>> kept_calls;
  // Units whose ops are always recomputed, whatever else would keep them: how a config forces
  // an op back to recompute by the module it runs in.
  std::vector<std::string> recomputed_units;
  // The offload counterparts of kept_ops, kept_units and kept_calls: the same selection, with
  // the outputs held in pinned host memory between forward and backward. An op has one rule of
  // kept_ops, every_nth_op, kept_calls, offloaded_ops, offloaded_calls, except that kept_calls
  // and offloaded_calls may share an op with disjoint indices; a unit is kept or offloaded.
  std::vector<std::string> offloaded_ops;
  std::vector<std::string> offloaded_units;
  std::vector<std::pair<std::string, std::vector<int64_t>>> offloaded_calls;
  // A call whose outputs take fewer bytes is kept on the device rather than offloaded.
  int64_t offload_min_bytes = int64_t{1} << 20;
  // The most pinned host bytes the offload pool may hold, in use and cached, when a call of this
  // policy offloads (-1: no limit); past it (after freeing idle buffers), the call is kept on the
  // device (NOTE: [A bounded pinned pool] in dispatch/offload.cpp).
  int64_t host_memory_limit = -1;
  // NOTE: [Routing is served from the forward] in policy.cpp; false opts out.
  bool pin_routing = true;
  // The region's activation inputs are held in pinned host memory between the forward and the
  // backward, within host_memory_limit (NOTE: [Offloading a layer's inputs] in dispatch/offload.cpp).
  bool offload_inputs = false;
};

// Whether a unit name is a pattern ('*' in it) rather than a name.
bool isUnitPattern(const std::string& name);
// Whether `name` matches `pattern` (see PolicySpec).
bool unitPatternMatches(const std::string& pattern, const std::string& name);

// A policy's list of units: interned names, and patterns matched against an open unit's name.
class UnitList {
 public:
  void add(UnitId unit) { units_.insert(unit); }
  void addPattern(const std::string& pattern) { patterns_.push_back(pattern); }
  bool empty() const { return units_.empty() && patterns_.empty(); }
  // Whether the list names `unit` (a base id, see baseUnit) exactly or by a pattern.
  bool names(UnitId unit) const {
    if (units_.count(unit) > 0) return true;
    return !patterns_.empty() && matchesPattern(unit);
  }
  bool namesExactly(UnitId unit) const { return units_.count(unit) > 0; }
  bool hasPattern(const std::string& pattern) const;
  std::vector<std::string> sortedNames() const;  // names and patterns

 private:
  bool matchesPattern(UnitId unit) const;
  HashSet<UnitId> units_;
  std::vector<std::string> patterns_;
};

// What the caller knows about one call beyond the op itself.
struct CallFacts {
  // The call draws from a generator (drawsRandomNumbers).
  bool draws_random = false;
  // For an op with an every-nth or kept-calls rule (countsCalls): this call's 0-based index among
  // the region's forward calls of it that ran inside no recomputed unit.
  uint64_t call_index = 0;
  // The call casts a parameter (castsAParameter).
  bool casts_a_parameter = false;
  // The call routes tokens or copies a value to the host (routesTokens in ops/routing.h).
  bool routes_tokens = false;
};

// A Policy is a value: what it selects, immutable once created, and nothing the runtime learns
// while running it (that belongs to a checkpoint site: NOTE: [What a site learns] in
// dispatch/site.h).
class Policy {
 public:
  // Throws c10::ValueError naming the offending entry: an unknown op (with the closest
  // registered names), an op the keep rule never keeps (a collective, a random, mutating or
  // never-counted op, an uninitialised allocation), an empty unit name or pattern, n < 1, two
  // every-nth rules that give one overload different n, a negative call index, an overload
  // named by more than one rule (kept_calls and offloaded_calls may share one, with disjoint
  // indices), a view named for offload, a unit both kept and offloaded, a negative byte count.
  static std::shared_ptr<const Policy> create(const PolicySpec& spec);
  static std::shared_ptr<const Policy> create(const std::vector<std::string>& kept_ops,
                                              const std::vector<std::string>& kept_units);

  // The keep rule for one call (NOTE: [The keep rule] in policy.cpp): its outcome and why.
  Decision decide(const OpEntry& op, const std::vector<UnitId>& open_units, const CallFacts& call) const;
  // What decide answers for a call of `op` under a policy that names the op in its kept-op set:
  // the rule with the selection given. A declaration refuses to name an op for which this
  // recomputes every call (whyNeverKept in policy.cpp); a call profile offers a plan only calls
  // it keeps.
  static Decision decideNamed(const OpEntry& op, const CallFacts& call);

  // Nothing is selected by op, call or unit. Region openings with recompute=False select only
  // under a policy that selects something: a policy that selects nothing is full recompute.
  bool keepsNothing() const {
    return kept_ops_.empty() && kept_units_.empty() && every_nth_.empty() && kept_calls_.empty() && offloadsNothing();
  }
  bool offloadsNothing() const {
    return offloaded_ops_.empty() && offloaded_units_.empty() && offloaded_calls_.empty();
  }
  // Whether this call takes the next CallFacts::call_index of its op: it has an every-nth or
  // kept-calls rule and runs inside no recomputed unit. A call that a recomputed unit forces back
  // to recompute takes no index, so it does not use up a keep slot: with every_nth_op {mm: 2} and
  // a recomputed router gate, the mms around the gate alternate as if the gate's mm were not
  // there (torchtitan's selective AC counts its matmuls the same way; so does CallDecider, which
  // the Python front doors decide through).
  bool countsCalls(const OpEntry& op, const std::vector<UnitId>& open_units) const {
    if ((every_nth_.empty() || every_nth_.count(&op) == 0) && (kept_calls_.empty() || kept_calls_.count(&op) == 0) &&
        (offloaded_calls_.empty() || offloaded_calls_.count(&op) == 0)) {
      return false;
    }
    return !insideRecomputedUnit(open_units);
  }
  // The unit (its base id) that selects a call by the units open around it, or kNoUnit: the
  // innermost open unit that the policy keeps or offloads, or that is a region opening with
  // recompute=False which no list names. A region opening with recompute=True which no list
  // names ends the search: the innermost region that decides for itself decides (NOTE: [Region
  // openings carry their flag] in unit_stack.h; torch_remat nests regions the same way).
  UnitId innermostSelectingUnit(const std::vector<UnitId>& open_units) const {
    for (auto it = open_units.rbegin(); it != open_units.rend(); ++it) {
      const UnitId unit = baseUnit(*it);
      if (kept_units_.names(unit) || offloaded_units_.names(unit)) return unit;
      if (isRegionOpening(*it) && !recomputed_units_.names(unit)) return regionRecomputes(*it) ? kNoUnit : unit;
    }
    return kNoUnit;
  }
  // Whether any open unit is a recomputed unit: then nothing is kept, whatever else would keep it.
  bool insideRecomputedUnit(const std::vector<UnitId>& open_units) const {
    if (recomputed_units_.empty()) return false;
    for (UnitId unit : open_units) {
      if (recomputed_units_.names(baseUnit(unit))) return true;
    }
    return false;
  }
  // NOTE: [Routing is served from the forward] (policy.cpp).
  bool pinsRouting() const { return pin_routing_; }
  bool offloadsInputs() const { return offload_inputs_; }
  // n of the op's every-nth rule, or 0: the caller then need not count its calls. Stored as
  // given (any n >= 1 that fits int64): an n beyond the calls a region makes keeps only the first.
  uint64_t everyNth(const OpEntry& op) const {
    if (every_nth_.empty()) return 0;
    auto it = every_nth_.find(&op);
    return it == every_nth_.end() ? 0 : it->second;
  }
  // Whether the op's overload is named by the kept-op set or an every-nth rule (not by a unit).
  bool namesOp(const OpEntry& op) const {
    return kept_ops_.count(&op) > 0 || everyNth(op) > 0 || (!kept_calls_.empty() && kept_calls_.count(&op) > 0) ||
           (!offloadsNothing() && (offloaded_ops_.count(&op) > 0 || offloaded_calls_.count(&op) > 0));
  }
  std::vector<std::string> keptOpNames() const;                      // sorted qualified overload names
  std::vector<std::string> keptUnitNames() const;                    // sorted
  std::vector<std::string> recomputedUnitNames() const;              // sorted
  std::vector<std::pair<std::string, int64_t>> everyNthOps() const;  // sorted by op
  // Sorted by op; each op's indices ascending, without repeats.
  std::vector<std::pair<std::string, std::vector<int64_t>>> keptCalls() const;
  std::vector<std::string> offloadedOpNames() const;                                 // sorted qualified overload names
  std::vector<std::string> offloadedUnitNames() const;                               // sorted
  std::vector<std::pair<std::string, std::vector<int64_t>>> offloadedCalls() const;  // as keptCalls

  // Whether the op has a kept-calls rule that lists this index.
  bool keptCallIndex(const OpEntry& op, uint64_t call_index) const;
  bool offloadedCallIndex(const OpEntry& op, uint64_t call_index) const;
  // Whether an offload rule (op, call index or the innermost selecting unit) selects the call.
  bool selectedForOffload(const OpEntry& op, const std::vector<UnitId>& open_units, const CallFacts& call) const;

  int64_t offloadMinBytes() const { return offload_min_bytes_; }
  int64_t hostMemoryLimit() const { return host_memory_limit_; }  // -1: none

 private:
  Policy() = default;

  HashSet<const OpEntry*> kept_ops_;
  UnitList kept_units_;
  HashMap<const OpEntry*, uint64_t> every_nth_;
  // Each op's kept call indices, ascending and unique (binary search per counted call).
  HashMap<const OpEntry*, std::vector<uint64_t>> kept_calls_;
  UnitList recomputed_units_;
  HashSet<const OpEntry*> offloaded_ops_;
  UnitList offloaded_units_;
  HashMap<const OpEntry*, std::vector<uint64_t>> offloaded_calls_;
  int64_t offload_min_bytes_ = int64_t{1} << 20;
  int64_t host_memory_limit_ = -1;
  bool pin_routing_ = true;
  bool offload_inputs_ = false;
};

// The two passes of a region, each counting its own call indices.
enum class Pass : uint8_t { kForward = 0, kRecompute = 1 };

// Decides the calls of one region for a caller that is not the native fallback (the Python front
// doors, through sac_plugin._C): it numbers each op's calls per pass exactly as the fallback numbers
// the forward's (a call takes the next index when Policy::countsCalls says so), then decides.
class CallDecider {
 public:
  explicit CallDecider(std::shared_ptr<const Policy> policy) : policy_(std::move(policy)) {}
  Decision decide(const OpEntry& op, Pass pass, const std::vector<UnitId>& open_units, CallFacts call);
  const Policy& policy() const { return *policy_; }

 private:
  std::shared_ptr<const Policy> policy_;
  HashMap<const OpEntry*, uint64_t> calls_[2];  // by Pass
};

// The spellings among `names` that name at least one registered overload, in input order.
// Lets a model list every spelling of an op (flash-attention v2 and v3) and keep those present.
std::vector<std::string> resolvableOpNames(const std::vector<std::string>& names);

}  // namespace sac
