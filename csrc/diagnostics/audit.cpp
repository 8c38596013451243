#include "diagnostics/audit.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "ops/op_catalog.h"

namespace sac {

CounterBaseline CounterBaseline::capture() {
  CounterBaseline baseline;
  baseline.table_ = ThreadCounts::currentShared();
  forEachOp([&](const OpEntry& entry) { baseline.baseline_[&entry] = entry.counters.snapshot(baseline.table_.get()); });
  return baseline;
}

std::vector<AuditRow> CounterBaseline::changesSince() const {
  std::vector<AuditRow> rows;
  forEachOp([&](const OpEntry& entry) {
    CounterSnapshot now = entry.counters.snapshot(table_.get());
    auto it = baseline_.find(&entry);
    CounterSnapshot diff = it == baseline_.end() ? now : now.minus(it->second);
    if (!diff.empty()) rows.push_back(AuditRow{entry.traits.qualified_name, diff});
  });
  std::sort(rows.begin(), rows.end(), [](const AuditRow& a, const AuditRow& b) { return a.op < b.op; });
  return rows;
}

std::string formatAuditTable(const std::vector<AuditRow>& rows) {
  size_t width = 2;
  for (const AuditRow& row : rows) width = std::max(width, row.op.size());
  std::ostringstream out;
  char line[512];
  std::snprintf(line, sizeof(line), "%-*s %10s %10s %10s %10s %10s %13s\n", static_cast<int>(width), "op", "forward",
                "recompute", "backward", "hits", "skipped", "never_served");
  out << line;
  for (const AuditRow& row : rows) {
    std::snprintf(line, sizeof(line), "%-*s %10llu %10llu %10llu %10llu %10llu %13llu\n", static_cast<int>(width),
                  row.op.c_str(), static_cast<unsigned long long>(row.counts.executions[0]),
                  static_cast<unsigned long long>(row.counts.executions[1]),
                  static_cast<unsigned long long>(row.counts.executions[2]),
                  static_cast<unsigned long long>(row.counts.hits), static_cast<unsigned long long>(row.counts.skipped),
                  static_cast<unsigned long long>(row.counts.never_served));
    out << line;
  }
  return out.str();
}

}  // namespace sac
