#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <thread>
#include <vector>

#include "diagnostics/audit.h"
#include "dispatch/call_trace.h"
#include "dispatch/fallback.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_counters.h"
#include "policy/policy.h"

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

// NOTE: [Counts are their thread's]
TEST(OpCountersTest, EachThreadSeesItsOwnCountsExactly) {
  OpCounters counters;
  std::vector<std::thread> threads;
  std::vector<uint64_t> seen(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000 * (t + 1); ++i) counters.recordExecution(Phase::kForward);
      counters.recordHit();
      seen[t] = counters.snapshot().executions[0];
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(seen, (std::vector<uint64_t>{10000, 20000, 30000, 40000}));
  EXPECT_TRUE(counters.snapshot().empty());  // none of it was this thread's
}

TEST(OpCountersTest, AutogradDeviceThreadsCountForEveryThread) {
  OpCounters counters;
  counters.recordExecution(Phase::kForward);
  std::thread device([&] {
    pthread_setname_np(pthread_self(), "pt_autograd_0");
    counters.recordExecution(Phase::kBackward);
    counters.recordExecution(Phase::kRecompute);
    counters.reclassifyRecomputeAsHit();
  });
  device.join();
  CounterSnapshot here = counters.snapshot();
  EXPECT_EQ(here.executions, (std::array<uint64_t, kNumPhases>{1, 0, 1}));
  EXPECT_EQ(here.hits, 1u);
  CounterSnapshot elsewhere;
  std::thread other([&] { elsewhere = counters.snapshot(); });
  other.join();
  EXPECT_EQ(elsewhere.executions, (std::array<uint64_t, kNumPhases>{0, 0, 1}));
  EXPECT_EQ(elsewhere.hits, 1u);
}

TEST(AuditTest, ABaselineCountsItsOwnThreadOnly) {
  installInterception();
  at::Tensor x = at::ones({4});
  CounterBaseline baseline = CounterBaseline::capture();
  ActivationScope audit(ActivationKind::kAudit, nullptr);
  std::thread other([&] {
    ActivationScope its_audit(ActivationKind::kAudit, nullptr);
    for (int i = 0; i < 5; ++i) at::tanh(x);
  });
  other.join();
  at::tanh(x);
  std::vector<AuditRow> rows = baseline.changesSince();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].op, "aten::tanh");
  EXPECT_EQ(rows[0].counts.executions[0], 1u);
}

// NOTE: [The per-op trace is recorded below Python]
TEST(CallTraceTest, RecordsOnlyWhileInstalledOnceEachAndNests) {
  const OpEntry& tanh = lookupOp(c10::Dispatcher::singleton().findSchemaOrThrow("aten::tanh", ""));
  auto outer = std::make_shared<CallTrace>();
  auto inner = std::make_shared<CallTrace>();
  traceCall(tanh, Phase::kForward, CallOutcome::kKept);  // nothing installed: not recorded
  CallTrace::install(outer);
  traceCall(tanh, Phase::kForward, CallOutcome::kKept);
  CallTrace::install(inner);
  CallTrace::install(outer);  // a nested pass of the same trace
  traceCall(tanh, Phase::kRecompute, CallOutcome::kServed);
  std::thread other([&] { traceCall(tanh, Phase::kForward, CallOutcome::kKept); });  // not installed there
  other.join();
  CallTrace::uninstall(outer.get());
  CallTrace::uninstall(outer.get());  // out of order: the outer goes, the inner stays
  traceCall(tanh, Phase::kRecompute, CallOutcome::kRecomputed);
  CallTrace::uninstall(inner.get());
  traceCall(tanh, Phase::kForward, CallOutcome::kOffloaded);
  ASSERT_EQ(outer->size(), 2u);
  ASSERT_EQ(inner->size(), 2u);
  std::vector<TracedCall> calls = outer->calls();
  EXPECT_EQ(calls[0].outcome, CallOutcome::kKept);
  EXPECT_EQ(calls[1].outcome, CallOutcome::kServed);
  EXPECT_EQ(calls[1].phase, Phase::kRecompute);
  EXPECT_EQ(calls[1].op, &tanh);
  EXPECT_EQ(calls[1].unit, kNoUnit);
  EXPECT_EQ(inner->calls()[1].outcome, CallOutcome::kRecomputed);
  EXPECT_STREQ(callOutcomeName(CallOutcome::kOffloaded), "offloaded");
}

// Whether a thread traces is its own: another thread installing, removing or leaving a trace
// installed as it ends never stops this thread's trace recording.
TEST(CallTraceTest, AThreadsTraceRecordsWhateverOtherThreadsInstallAndRemove) {
  const OpEntry& tanh = lookupOp(c10::Dispatcher::singleton().findSchemaOrThrow("aten::tanh", ""));
  auto mine = std::make_shared<CallTrace>();
  auto theirs = std::make_shared<CallTrace>();
  auto left_installed = std::make_shared<CallTrace>();
  CallTrace::install(mine);
  std::thread other([&] {
    CallTrace::install(theirs);
    traceCall(tanh, Phase::kForward, CallOutcome::kKept);
    CallTrace::uninstall(theirs.get());
    CallTrace::uninstall(theirs.get());  // not installed any more: changes nothing
    traceCall(tanh, Phase::kForward, CallOutcome::kKept);
    CallTrace::install(left_installed);  // the thread ends with it installed
  });
  other.join();
  traceCall(tanh, Phase::kRecompute, CallOutcome::kServed);
  CallTrace::uninstall(mine.get());
  traceCall(tanh, Phase::kForward, CallOutcome::kKept);
  EXPECT_EQ(theirs->size(), 1u);
  EXPECT_EQ(left_installed->size(), 0u);
  ASSERT_EQ(mine->size(), 1u);
  EXPECT_EQ(mine->calls()[0].outcome, CallOutcome::kServed);
  EXPECT_FALSE(tracingCalls());
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
            "op            forward  recompute   backward       hits    skipped  never_served\n"
            "aten::sin           1          0          0          0          0             0\n"
            "aten::tanh          2          0          0          0          0             0\n");
}

}  // namespace
}  // namespace sac
