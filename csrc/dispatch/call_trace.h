#pragma once
// The per-op trace (sac_plugin.trace, report(model, trace=True)): what the fallback decided for
// each call, recorded where it decides, with no Python dispatch mode on.
//
// NOTE: [The per-op trace is recorded below Python]
// A trace that watched the calls from a TorchDispatchMode would change what it watches: with
// any Python dispatch mode on, at::isTensorSubclassLike holds for every tensor, so composite
// ops decompose differently (F.linear on a non-contiguous 3-D input adds its bias out of place
// into the mm output instead of in place; a kept mm is served either way, NOTE: [Kept outputs
// written in the forward] in preserved_writes.cpp). So the fallback itself tells the
// trace each decided call: its op, its phase, its innermost open unit and what became of it.
// Without a trace on the thread that is one predictable branch on a thread-local flag. Python
// names the layer and module of each call from the positions it notes (CallTrace::size) when
// passes and modules open and close.

#include <c10/macros/Macros.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ops/op_catalog.h"
#include "ops/op_counters.h"
#include "policy/unit_stack.h"

namespace sac {

enum class CallOutcome : uint8_t { kKept, kOffloaded, kRecomputed, kServed, kSkipped };
const char* callOutcomeName(CallOutcome outcome);

struct TracedCall {
  const OpEntry* op;
  Phase phase;
  CallOutcome outcome;
  UnitId unit;  // innermost open unit, kNoUnit for none
};

// One trace, filled from every thread it is installed on (a forward on the caller's thread, a
// recompute on autograd's device thread), in the order the calls were decided.
class CallTrace {
 public:
  void record(const TracedCall& call);
  size_t size() const;
  std::vector<TracedCall> calls() const;

  // Installs this trace on the calling thread until uninstall() there. Traces nest (a report
  // inside a report): every trace installed on a thread records its calls. Installing one twice
  // on a thread records each call once; uninstall removes it whatever else was installed since.
  static void install(const std::shared_ptr<CallTrace>& trace);
  static void uninstall(const CallTrace* trace);

 private:
  mutable std::mutex mutex_;
  std::vector<TracedCall> calls_;
};

namespace detail {
extern std::atomic<int> threads_tracing;  // threads with a trace installed
extern thread_local bool tracing_calls;
void traceCallSlow(const OpEntry& op, Phase phase, CallOutcome outcome);
}  // namespace detail

// The fallback's one call per decided call (NOTE: [The per-op trace is recorded below Python]).
// Whether a trace records this thread's calls: callers whose phase costs a lookup test it first.
// The process-wide count is read first: it costs no thread-local lookup, and is zero unless a
// report watches (NOTE: [One lookup per thread-local object]).
inline bool tracingCalls() {
  return C10_UNLIKELY(detail::threads_tracing.load(std::memory_order_relaxed) > 0) && detail::tracing_calls;
}

inline void traceCall(const OpEntry& op, Phase phase, CallOutcome outcome) {
  if (C10_UNLIKELY(tracingCalls())) detail::traceCallSlow(op, phase, outcome);
}

}  // namespace sac
