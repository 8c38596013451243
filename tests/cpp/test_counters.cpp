#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <thread>
#include <vector>

#include "diagnostics/audit.h"
#include "ops/op_counters.h"
#include "dispatch/fallback.h"
#include "dispatch/thread_state.h"

namespace sac {
namespace {

TEST(OpCountersTest, RecordsPerPhaseAndHits) {
  OpCounters counters;
  counters.recordExecution(Phase::kForward);
  counters.recordExecution(Phase::kRecompute);
  counters.recordExecution(Phase::kRecompute);
  counters.recordHit();
  CounterSnapshot snap = counters.snapshot();
  EXPECT_EQ(snap.executions[0], 1u);
  EXPECT_EQ(snap.executions[1], 2u);
  EXPECT_EQ(snap.executions[2], 0u);
  EXPECT_EQ(snap.hits, 1u);
  EXPECT_EQ(snap.totalExecutions(), 3u);
}

TEST(OpCountersTest, SnapshotDifference) {
  OpCounters counters;
  counters.recordExecution(Phase::kBackward);
  CounterSnapshot before = counters.snapshot();
  counters.recordExecution(Phase::kBackward);
  counters.recordHit();
  CounterSnapshot diff = counters.snapshot().minus(before);
  EXPECT_EQ(diff.executions[2], 1u);
  EXPECT_EQ(diff.hits, 1u);
  EXPECT_FALSE(diff.empty());
  EXPECT_TRUE(counters.snapshot().minus(counters.snapshot()).empty());
}

TEST(OpCountersTest, ConcurrentIncrementsAreExact) {
  OpCounters counters;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) counters.recordExecution(Phase::kForward);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(counters.snapshot().executions[0], 40000u);
}

TEST(AuditTest, CountsOpsRunUnderAnAuditActivation) {
  installInterception();
  at::Tensor x = at::ones({4});
  CounterBaseline baseline = CounterBaseline::capture();
  {
    ActivationScope audit(ActivationKind::kAudit, nullptr);
    at::Tensor y = at::tanh(x);
    y = at::tanh(y);
    y = at::sin(y);
  }
  at::tanh(x);  // after the audit: not counted
  std::vector<AuditRow> rows = baseline.changesSince();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].op, "aten::sin");
  EXPECT_EQ(rows[0].counts.executions[0], 1u);
  EXPECT_EQ(rows[1].op, "aten::tanh");
  EXPECT_EQ(rows[1].counts.executions[0], 2u);
  EXPECT_EQ(formatAuditTable(rows),
            "op            forward  recompute   backward       hits\n"
            "aten::sin           1          0          0          0\n"
            "aten::tanh          2          0          0          0\n");
}

}  // namespace
}  // namespace sac
