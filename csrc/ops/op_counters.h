#pragma once
// Execution counters for one op overload. They live inside the op's catalog entry, so
// recording an execution is an increment with no lookup: cheap enough to stay on for every
// intercepted op, on every thread.

#include <c10/macros/Macros.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>

namespace sac {

// The pass an op executes in. Forward and recompute are decided by the checkpointed region
// the op runs in; backward is any autograd graph task outside a recompute.
enum class Phase : uint8_t { kForward = 0, kRecompute = 1, kBackward = 2 };
inline constexpr int kNumPhases = 3;
const char* phaseName(Phase phase);

struct CounterSnapshot {
  std::array<uint64_t, kNumPhases> executions{};
  uint64_t hits = 0;  // kept outputs served in the recompute instead of running the kernel
  // Recompute calls given stand-in outputs instead of running, because nothing the backward needs
  // reads them (NOTE: [The recompute runs only what backward needs] in dispatch/dead_calls.cpp).
  uint64_t skipped = 0;
  // Kept (or offloaded) outputs held from the forward to the backward and freed unserved (NOTE:
  // [Served, or named] in dispatch/kept_outputs.cpp), and the bytes they held.
  uint64_t never_served = 0;
  uint64_t never_served_bytes = 0;

  uint64_t totalExecutions() const;
  CounterSnapshot minus(const CounterSnapshot& earlier) const;
  CounterSnapshot plus(const CounterSnapshot& other) const;
  bool empty() const;
};

// One op's counts in one place: a thread's table, or the counts every thread shares.
struct CountSlot {
  std::array<std::atomic<uint64_t>, kNumPhases> executions{};
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> skipped{0};
  std::atomic<uint64_t> never_served{0};
  std::atomic<uint64_t> never_served_bytes{0};

  CounterSnapshot snapshot() const;
};

// NOTE: [Counts are their thread's]
// Two threads training at once (two models, or one model twice) must not see each other's
// calls in their audits. So every thread counts into a table of its own, indexed by the op's
// counter id, and an audit reads the table of the thread it runs on. One kind of thread has
// no table: autograd's device threads, which run the backward (and the recompute in it) for
// whichever thread called backward() on that device, with that thread's key set (NOTE:
// [Autograd threads inherit the key set]); nothing on them says which thread that was. Their
// calls go to counts every thread shares, which every audit reads as well: exact on the CPU,
// where the backward runs on the caller's thread, and on an accelerator as long as one thread
// at a time runs a backward there. A table is only written by its own thread (a load and a
// store, no locked instruction) and may be read by any, so its counts are atomics; the shared
// counts take relaxed atomic increments.
class ThreadCounts {
 public:
  static constexpr uint32_t kSlotsPerChunk = 256;
  static constexpr uint32_t kChunks = 1024;
  // Ops beyond this many (never seen: a process meets a few thousand) count in the shared counts.
  static constexpr uint32_t kCapacity = kSlotsPerChunk * kChunks;

  ~ThreadCounts();

  // This thread's table, created on first use; null on autograd's device threads.
  static ThreadCounts* current() {
    if (C10_UNLIKELY(!tls_decided_)) decideForThisThread();
    return tls_table_;
  }
  // The same, owned: an audit keeps its thread's table readable after the thread ends.
  static std::shared_ptr<ThreadCounts> currentShared();
  // The thread is ending: whatever it counts from now on goes to the shared counts.
  static void forgetThisThread();

  CountSlot& slot(uint32_t id) {  // the owning thread only; id < kCapacity
    CountSlot* chunk = chunks_[id / kSlotsPerChunk].load(std::memory_order_acquire);
    if (C10_UNLIKELY(chunk == nullptr)) chunk = newChunk(id / kSlotsPerChunk);
    return chunk[id % kSlotsPerChunk];
  }
  CounterSnapshot snapshot(uint32_t id) const;  // any thread

 private:
  static void decideForThisThread();
  CountSlot* newChunk(uint32_t chunk);

  std::array<std::atomic<CountSlot*>, kChunks> chunks_{};
  static thread_local bool tls_decided_;
  static thread_local ThreadCounts* tls_table_;
};

class OpCounters {
 public:
  OpCounters();
  OpCounters(const OpCounters&) = delete;
  OpCounters& operator=(const OpCounters&) = delete;

  void recordExecution(Phase phase) {
    const int i = static_cast<int>(phase);
    if (ThreadCounts* table = ownTable()) {
      addOwn(table->slot(id_).executions[i], 1);
    } else {
      shared_.executions[i].fetch_add(1, std::memory_order_relaxed);
    }
  }
  void recordHit() {
    if (ThreadCounts* table = ownTable()) {
      addOwn(table->slot(id_).hits, 1);
    } else {
      shared_.hits.fetch_add(1, std::memory_order_relaxed);
    }
  }
  void recordSkipped() {
    if (ThreadCounts* table = ownTable()) {
      addOwn(table->slot(id_).skipped, 1);
    } else {
      shared_.skipped.fetch_add(1, std::memory_order_relaxed);
    }
  }
  void recordNeverServed(uint64_t bytes) {
    if (ThreadCounts* table = ownTable()) {
      CountSlot& counts = table->slot(id_);
      addOwn(counts.never_served, 1);
      addOwn(counts.never_served_bytes, bytes);
    } else {
      shared_.never_served.fetch_add(1, std::memory_order_relaxed);
      shared_.never_served_bytes.fetch_add(bytes, std::memory_order_relaxed);
    }
  }
  // A call first counted as a recompute execution turned out to be served (the dispatch-mode
  // engine on torch 2.11, where the key sits above Python and sees a call before torch's cache
  // serves it): it becomes a hit.
  void reclassifyRecomputeAsHit() {
    const int i = static_cast<int>(Phase::kRecompute);
    if (ThreadCounts* table = ownTable()) {
      CountSlot& counts = table->slot(id_);
      addOwn(counts.executions[i], static_cast<uint64_t>(-1));
      addOwn(counts.hits, 1);
    } else {
      shared_.executions[i].fetch_sub(1, std::memory_order_relaxed);
      shared_.hits.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // A recompute call first given stand-in outputs had to run after all, for a call that read them
  // (NOTE: [The recompute runs only what backward needs] in dispatch/dead_calls.cpp): it becomes a
  // recompute execution.
  void reclassifySkippedAsExecution() {
    const int i = static_cast<int>(Phase::kRecompute);
    if (ThreadCounts* table = ownTable()) {
      CountSlot& counts = table->slot(id_);
      addOwn(counts.skipped, static_cast<uint64_t>(-1));
      addOwn(counts.executions[i], 1);
    } else {
      shared_.skipped.fetch_sub(1, std::memory_order_relaxed);
      shared_.executions[i].fetch_add(1, std::memory_order_relaxed);
    }
  }

  // What an audit on the thread owning `table` sees: that table's counts plus the shared ones
  // (NOTE: [Counts are their thread's]); a null table: the shared counts alone.
  CounterSnapshot snapshot(const ThreadCounts* table) const;
  // This thread's view: snapshot(ThreadCounts::current()).
  CounterSnapshot snapshot() const { return snapshot(ThreadCounts::current()); }

 private:
  ThreadCounts* ownTable() const { return id_ < ThreadCounts::kCapacity ? ThreadCounts::current() : nullptr; }
  // Only the owning thread writes its table: a plain read-modify-write, atomic for readers.
  static void addOwn(std::atomic<uint64_t>& counter, uint64_t delta) {
    counter.store(counter.load(std::memory_order_relaxed) + delta, std::memory_order_relaxed);
  }

  uint32_t id_;
  CountSlot shared_;  // autograd's device threads (NOTE: [Counts are their thread's])
};

}  // namespace sac
