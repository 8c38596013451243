#pragma once
// Op-count audits: a baseline of every op's counters taken when an audit starts, and the
// difference since then, as the thread that took it sees them: its own calls and those of
// autograd's device threads (NOTE: [Counts are their thread's] in ops/op_counters.h). Another
// thread's training is not in them.

#include <memory>
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
  // This thread's counts now. Baselines nest and overlap freely: each is a copy of counts.
  static CounterBaseline capture();
  // Ops whose counters moved since the baseline, sorted by name; the same counts whichever
  // thread asks.
  std::vector<AuditRow> changesSince() const;

 private:
  std::shared_ptr<ThreadCounts> table_;  // the capturing thread's (null on a device thread)
  HashMap<const OpEntry*, CounterSnapshot> baseline_;
};

// A fixed-width table of audit rows, the way `audit().table()` prints it.
std::string formatAuditTable(const std::vector<AuditRow>& rows);

}  // namespace sac
