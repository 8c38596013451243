#include "ops/op_counters.h"

#include <cstring>

#if defined(__linux__)
#include <pthread.h>
#endif

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
  diff.skipped = skipped - earlier.skipped;
  diff.never_served = never_served - earlier.never_served;
  diff.never_served_bytes = never_served_bytes - earlier.never_served_bytes;
  return diff;
}

CounterSnapshot CounterSnapshot::plus(const CounterSnapshot& other) const {
  CounterSnapshot sum;
  for (int i = 0; i < kNumPhases; ++i) sum.executions[i] = executions[i] + other.executions[i];
  sum.hits = hits + other.hits;
  sum.skipped = skipped + other.skipped;
  sum.never_served = never_served + other.never_served;
  sum.never_served_bytes = never_served_bytes + other.never_served_bytes;
  return sum;
}

bool CounterSnapshot::empty() const { return totalExecutions() == 0 && hits == 0 && skipped == 0 && never_served == 0; }

CounterSnapshot CountSlot::snapshot() const {
  CounterSnapshot snap;
  for (int i = 0; i < kNumPhases; ++i) snap.executions[i] = executions[i].load(std::memory_order_relaxed);
  snap.hits = hits.load(std::memory_order_relaxed);
  snap.skipped = skipped.load(std::memory_order_relaxed);
  snap.never_served = never_served.load(std::memory_order_relaxed);
  snap.never_served_bytes = never_served_bytes.load(std::memory_order_relaxed);
  return snap;
}

thread_local bool ThreadCounts::tls_decided_ = false;
thread_local ThreadCounts* ThreadCounts::tls_table_ = nullptr;

namespace {

// Owns this thread's table. When the thread ends, calls counted by destructors that run after
// this one (other thread-locals') go to the shared counts rather than to a freed table.
struct ThisThreadsTable {
  std::shared_ptr<ThreadCounts> table;
  ~ThisThreadsTable() { ThreadCounts::forgetThisThread(); }
};
thread_local ThisThreadsTable this_threads_table;

// torch's autograd engine names its device threads "pt_autograd_<device>" when it starts them
// (Engine::thread_init), before they run any node.
bool isAutogradDeviceThread() {
#if defined(__linux__)
  char name[16] = {};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) return false;
  return std::strncmp(name, "pt_autograd_", std::strlen("pt_autograd_")) == 0;
#else
  return false;
#endif
}

}  // namespace

void ThreadCounts::decideForThisThread() {
  if (!isAutogradDeviceThread()) {
    this_threads_table.table = std::make_shared<ThreadCounts>();
    tls_table_ = this_threads_table.table.get();
  }
  tls_decided_ = true;
}

std::shared_ptr<ThreadCounts> ThreadCounts::currentShared() {
  current();
  return this_threads_table.table;
}

void ThreadCounts::forgetThisThread() {
  tls_table_ = nullptr;
  tls_decided_ = true;
}

ThreadCounts::~ThreadCounts() {
  for (std::atomic<CountSlot*>& chunk : chunks_) delete[] chunk.load(std::memory_order_acquire);
}

CountSlot* ThreadCounts::newChunk(uint32_t chunk) {
  CountSlot* slots = new CountSlot[kSlotsPerChunk];
  chunks_[chunk].store(slots, std::memory_order_release);
  return slots;
}

CounterSnapshot ThreadCounts::snapshot(uint32_t id) const {
  if (id >= kCapacity) return CounterSnapshot{};
  const CountSlot* chunk = chunks_[id / kSlotsPerChunk].load(std::memory_order_acquire);
  return chunk == nullptr ? CounterSnapshot{} : chunk[id % kSlotsPerChunk].snapshot();
}

namespace {
std::atomic<uint32_t> next_counter_id{0};
}  // namespace

OpCounters::OpCounters() : id_(next_counter_id.fetch_add(1, std::memory_order_relaxed)) {}

CounterSnapshot OpCounters::snapshot(const ThreadCounts* table) const {
  CounterSnapshot shared = shared_.snapshot();
  return table == nullptr ? shared : shared.plus(table->snapshot(id_));
}

}  // namespace sac
