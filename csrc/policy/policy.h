#pragma once
// A selective-checkpointing policy: which ops keep their outputs for backward and which are
// recomputed. An op is kept when its overload is in the kept-op set, or when it runs inside a
// kept recompute unit; everything else is recomputed. The invariants come first and no
// declaration overrides them:
//   - collectives (c10d, _c10d_functional, _c10d_functional_autograd) are never kept, and
//     naming one is refused;
//   - calls that draw random numbers are never kept (the recompute must draw the same numbers
//     in the same order), and naming a random op is refused; attention ops, tagged random for
//     their dropout, can be named and are kept in the calls where dropout_p == 0;
//   - ops that mutate an input are never kept; inside a kept unit they are recomputed, with one
//     warning per policy and op; naming one is refused;
//   - views inside a kept unit are recomputed (free, and keeping one would pin its base);
//   - ops inside a recomputed unit are recomputed, whatever else would keep them;
//   - casts of parameters are recomputed (NOTE: [Autocast's weight casts] in op_traits.h).


#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hash_containers.h"
#include "policy/op_catalog.h"
#include "policy/unit_stack.h"

namespace sac {

inline constexpr UnitId kNoUnit = UINT32_MAX;

struct Decision {
  bool keep = false;
  // The kept unit the op runs in (kNoUnit when kept by the op set or not in a kept unit).
  UnitId unit = kNoUnit;
  // A mutating op inside a kept unit: recomputed, and worth a warning.
  bool mutating_in_kept_unit = false;
  // An attention call the policy would keep, but whose dropout draws random numbers.
  bool random_call_of_kept_op = false;
};

struct PolicySpec {
  std::vector<std::string> kept_ops;
  std::vector<std::string> kept_units;
  // (op, n): keep calls 1, n+1, 2n+1, ... of the op in each region ("every other matmul" is n=2),
  // counting every call of the op in the region, so forward and recompute count alike.
  std::vector<std::pair<std::string, int64_t>> every_nth_ops;
  // (op, indices): keep exactly these calls of the op in each region, by 0-based index among the
  // region's forward calls of it, counted as every-nth rules count them (a memory-budget plan
  // is one). Indices are >= 0; repeats are merged; an op has one rule of one kind.
  std::vector<std::pair<std::string, std::vector<int64_t>>> kept_calls;
  // Units whose ops are always recomputed, whatever else would keep them: how a config forces
  // an op back to recompute by the module it runs in.
  std::vector<std::string> recomputed_units;
};

// What the fallback knows about one call beyond the op itself.
struct CallFacts {
  // The call draws from a generator (drawsRandomNumbers); it is recomputed so that forward and
  // recompute draw the same numbers in the same order.
  bool draws_random = false;
  // For an op with an every-nth or kept-calls rule (countsCalls): this call's 0-based index among
  // the region's forward calls of it that ran inside no recomputed unit.
  uint64_t call_index = 0;
  // The call casts a parameter (castsAParameter): never kept.
  bool casts_a_parameter = false;
};

class Policy {
 public:
  // Throws c10::ValueError naming the offending entry: an unknown op (with the closest
  // registered names), a collective, a random or mutating op, an empty unit name, n < 1, two
  // every-nth rules that give one overload different n, a negative kept-call index, an overload
  // named by more than one of kept_ops, every_nth_ops and kept_calls.
  static std::shared_ptr<const Policy> create(const PolicySpec& spec);
  static std::shared_ptr<const Policy> create(const std::vector<std::string>& kept_ops,
                                              const std::vector<std::string>& kept_units);

  Decision decide(const OpEntry& op, const std::vector<UnitId>& open_units, const CallFacts& call) const;

  bool keepsNothing() const {
    return kept_ops_.empty() && kept_units_.empty() && every_nth_.empty() && kept_calls_.empty();
  }
  // Whether this call takes the next CallFacts::call_index of its op: it has an every-nth or
  // kept-calls rule and runs inside no recomputed unit. A call that a recomputed unit forces back
  // to recompute takes no index, so it does not use up a keep slot: with every_nth_op {mm: 2} and
  // a recomputed router gate, the mms around the gate alternate as if the gate's mm were not
  // there (torchtitan's selective AC counts its matmuls the same way; so do torch_policy_fn and
  // the dispatch-mode engine, which return before counting).
  bool countsCalls(const OpEntry& op, const std::vector<UnitId>& open_units) const {
    if ((every_nth_.empty() || every_nth_.count(&op) == 0) && (kept_calls_.empty() || kept_calls_.count(&op) == 0)) {
      return false;
    }
    return !insideRecomputedUnit(open_units);
  }
  // Whether any open unit is a recomputed unit: then nothing is kept, whatever else would keep it.
  bool insideRecomputedUnit(const std::vector<UnitId>& open_units) const {
    if (recomputed_units_.empty()) return false;
    for (UnitId unit : open_units) {
      if (recomputed_units_.count(unit) > 0) return true;
    }
    return false;
  }
  // n of the op's every-nth rule, or 0: the caller then need not count its calls. Stored as
  // given (any n >= 1 that fits int64): an n beyond the calls a region makes keeps only the first.
  uint64_t everyNth(const OpEntry& op) const {
    if (every_nth_.empty()) return 0;
    auto it = every_nth_.find(&op);
    return it == every_nth_.end() ? 0 : it->second;
  }
  // Whether the op's overload is named by the kept-op set or an every-nth rule (not by a unit).
  bool namesOp(const OpEntry& op) const {
    return kept_ops_.count(&op) > 0 || everyNth(op) > 0 || (!kept_calls_.empty() && kept_calls_.count(&op) > 0);
  }
  std::vector<std::string> keptOpNames() const;   // sorted qualified overload names
  std::vector<std::string> keptUnitNames() const;  // sorted
  std::vector<std::string> recomputedUnitNames() const;  // sorted
  std::vector<std::pair<std::string, int64_t>> everyNthOps() const;  // sorted by op
  // Sorted by op; each op's indices ascending, without repeats.
  std::vector<std::pair<std::string, std::vector<int64_t>>> keptCalls() const;

  // True once per policy and op: the caller warns then.
  bool claimWarning(const OpEntry& op) const;

  // How many calls a forward of a region with this policy named last time: a sizing hint for
  // the next region's data-flow tables (relaxed: any recent value will do).
  size_t callsPerPassHint() const { return calls_per_pass_hint_.load(std::memory_order_relaxed); }
  void noteCallsPerPass(size_t calls) const { calls_per_pass_hint_.store(calls, std::memory_order_relaxed); }

 private:
  Policy() = default;

  HashSet<const OpEntry*> kept_ops_;
  HashSet<UnitId> kept_units_;
  HashMap<const OpEntry*, uint64_t> every_nth_;
  // Each op's kept call indices, ascending and unique (binary search per counted call).
  HashMap<const OpEntry*, std::vector<uint64_t>> kept_calls_;
  HashSet<UnitId> recomputed_units_;
  mutable std::atomic<size_t> calls_per_pass_hint_{0};
  mutable std::mutex warned_mutex_;
  mutable HashSet<const OpEntry*> warned_;
};

// The spellings among `names` that name at least one registered overload, in input order.
// Lets a model list every spelling of an op (flash-attention v2 and v3) and keep those present.
std::vector<std::string> resolvableOpNames(const std::vector<std::string>& names);

}  // namespace sac
