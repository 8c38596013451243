#include "ops/op_counters.h"

namespace sac {

const char* phaseName(Phase phase) {
  switch (phase) {
    case Phase::kForward:
      return "forward";
    case Phase::kRecompute:
      return "recompute";
    case Phase::kBackward:
      return "backward";
  }
  return "unknown";
}

uint64_t CounterSnapshot::totalExecutions() const {
  uint64_t total = 0;
  for (uint64_t n : executions) total += n;
  return total;
}

CounterSnapshot CounterSnapshot::minus(const CounterSnapshot& earlier) const {
  CounterSnapshot diff;
  for (int i = 0; i < kNumPhases; ++i) diff.executions[i] = executions[i] - earlier.executions[i];
  diff.hits = hits - earlier.hits;
  return diff;
}

bool CounterSnapshot::empty() const { return totalExecutions() == 0 && hits == 0; }

CounterSnapshot OpCounters::snapshot() const {
  CounterSnapshot snap;
  for (int i = 0; i < kNumPhases; ++i) snap.executions[i] = executions_[i].load(std::memory_order_relaxed);
  snap.hits = hits_.load(std::memory_order_relaxed);
  return snap;
}

}  // namespace sac
