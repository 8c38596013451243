#pragma once
// Op-count audits: a baseline of every op's counters taken when an audit starts, and the
// difference since then. Counters are process-wide, so an audit sees every thread: the
// autograd engine's device threads, which inherit the caller's thread-local key set, included.


#include <string>
#include <vector>

#include "ops/hash_containers.h"
#include "ops/op_counters.h"

namespace sac {

struct OpEntry;

struct AuditRow {
  std::string op;  // qualified overload name, "aten::tanh" or "aten::add.Tensor"
  CounterSnapshot counts;
};

class CounterBaseline {
 public:
  static CounterBaseline capture();
  // Ops whose counters moved since the baseline, sorted by name.
  std::vector<AuditRow> changesSince() const;

 private:
  HashMap<const OpEntry*, CounterSnapshot> baseline_;
};

// A fixed-width table of audit rows, the way `audit().table()` prints it.
std::string formatAuditTable(const std::vector<AuditRow>& rows);

}  // namespace sac
