#include "dispatch/call_trace.h"

#include <algorithm>

#include "policy/policy.h"

namespace sac {

const char* callOutcomeName(CallOutcome outcome) {
  switch (outcome) {
    case CallOutcome::kKept:
      return "kept";
    case CallOutcome::kOffloaded:
      return "offloaded";
    case CallOutcome::kRecomputed:
      return "recomputed";
    case CallOutcome::kServed:
      return "served";
    case CallOutcome::kSkipped:
      return "skipped";
  }
  return "unknown";
}

namespace detail {
std::atomic<int> threads_tracing{0};
thread_local bool tracing_calls = false;
}  // namespace detail

namespace {
// The traces installed on this thread, in installation order. A thread that ends with traces
// installed no longer counts as tracing.
struct InstalledTraces : std::vector<std::shared_ptr<CallTrace>> {
  ~InstalledTraces() {
    if (!empty()) detail::threads_tracing.fetch_sub(1, std::memory_order_relaxed);
  }
};
thread_local InstalledTraces installed;
}  // namespace

void CallTrace::record(const TracedCall& call) {
  std::lock_guard<std::mutex> lock(mutex_);
  calls_.push_back(call);
}

size_t CallTrace::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_.size();
}

std::vector<TracedCall> CallTrace::calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_;
}

void CallTrace::install(const std::shared_ptr<CallTrace>& trace) {
  installed.push_back(trace);
  if (installed.size() == 1) detail::threads_tracing.fetch_add(1, std::memory_order_relaxed);
  detail::tracing_calls = true;
}

void CallTrace::uninstall(const CallTrace* trace) {
  auto it = std::find_if(installed.rbegin(), installed.rend(), [&](const auto& t) { return t.get() == trace; });
  if (it == installed.rend()) return;
  installed.erase(std::next(it).base());
  if (installed.empty()) detail::threads_tracing.fetch_sub(1, std::memory_order_relaxed);
  detail::tracing_calls = !installed.empty();
}

void detail::traceCallSlow(const OpEntry& op, Phase phase, CallOutcome outcome) {
  const std::vector<UnitId>& units = UnitStack::current().units();
  const TracedCall call{&op, phase, outcome, units.empty() ? kNoUnit : units.back()};
  for (size_t i = 0; i < installed.size(); ++i) {
    // A trace installed more than once on this thread (passes of nested regions) records once.
    bool earlier = false;
    for (size_t j = 0; j < i && !earlier; ++j) earlier = installed[j] == installed[i];
    if (!earlier) installed[i]->record(call);
  }
}

}  // namespace sac
