#pragma once
// Execution counters for one op overload. They live inside the op's catalog entry, so
// recording an execution is a relaxed atomic increment with no lookup: cheap enough to
// stay on for every intercepted op, on every thread.

#include <array>
#include <atomic>
#include <cstdint>

namespace sac {

// The pass an op executes in. Forward and recompute are decided by the checkpointed region
// the op runs in; backward is any autograd graph task outside a recompute.
enum class Phase : uint8_t { kForward = 0, kRecompute = 1, kBackward = 2 };
inline constexpr int kNumPhases = 3;
const char* phaseName(Phase phase);

struct CounterSnapshot {
  std::array<uint64_t, kNumPhases> executions{};
  uint64_t hits = 0;  // kept outputs served in the recompute instead of running the kernel

  uint64_t totalExecutions() const;
  CounterSnapshot minus(const CounterSnapshot& earlier) const;
  bool empty() const;
};

class OpCounters {
 public:
  void recordExecution(Phase phase) {
    executions_[static_cast<int>(phase)].fetch_add(1, std::memory_order_relaxed);
  }
  void recordHit() { hits_.fetch_add(1, std::memory_order_relaxed); }
  // A call first counted as a recompute execution turned out to be served (the dispatch-mode
  // engine on torch 2.11, where the key sits above Python and sees a call before torch's cache
  // serves it): it becomes a hit.
  void reclassifyRecomputeAsHit() {
    executions_[static_cast<int>(Phase::kRecompute)].fetch_sub(1, std::memory_order_relaxed);
    hits_.fetch_add(1, std::memory_order_relaxed);
  }
  CounterSnapshot snapshot() const;

 private:
  std::array<std::atomic<uint64_t>, kNumPhases> executions_{};
  std::atomic<uint64_t> hits_{0};
};

}  // namespace sac
