#pragma once
// A checkpoint site: one policy applied at one place of a model (a checkpointed module, or one
// context_fn(policy)), and what the runtime learns there (NOTE: [What a site learns]).

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "ops/hash_containers.h"
#include "ops/op_catalog.h"
#include "policy/policy.h"

namespace sac {

// NOTE: [What a site learns]
// A Policy is a value: what it selects, and nothing else. What the runtime learns while running
// it is a fact about one layer's code, not about the policy: which kept calls torch's early stop
// never lets the recompute reach (NOTE: [Kept outputs the recompute never reaches] in
// kept_outputs.cpp), which warnings were already said, how many calls a pass names. One policy applied
// to a dense and an MoE layer must decide each by its own first forward, so these facts live in
// a Site: one per place the policy is applied, shared by the regions made there (each holds it),
// and freed with the last of them and the Python object that made it.
class Site {
 public:
  // `label` is what messages call the place: the checkpointed layer ("LlamaDecoderLayer"), or
  // empty for a region nothing names.
  // `watches_outside_writes`: whether its regions find out what their forward writes outside them
  // (NOTE: [The recompute writes nothing outside its region] in outside_writes.cpp); false for
  // the regions that only mark passes (a dispatch-mode engine's marker), whose calls another
  // region decides.
  explicit Site(std::shared_ptr<const Policy> policy, std::string label = {}, bool watches_outside_writes = true);

  const Policy& policy() const { return *policy_; }
  // The layer the site checkpoints, as messages name it: its label, or "a checkpointed region".
  std::string label() const { return label_.empty() ? std::string("a checkpointed region") : label_; }
  const std::shared_ptr<const Policy>& sharedPolicy() const { return policy_; }

  // The calls, as (op, 1-based ordinal among the region's kept calls of the op), that a region of
  // this site kept although the recompute's early stop never reached them: later regions of the
  // site decide them as kept but do not hold them.
  void noteNeverReached(const OpEntry& op, uint32_t ordinal);
  bool neverReached(const OpEntry& op, uint32_t ordinal) const {
    if (!any_never_reached_.load(std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    return never_reached_.count({&op, ordinal}) > 0;
  }

  // True once per site and op: the caller warns then (a selected call the rule recomputes).
  bool claimWarning(const OpEntry& op);
  // True once per site and notice: the caller says then why an offloaded call stays on the device,
  // or which kept outputs the recompute never asked for (NOTE: [Served, or named] in kept_outputs.cpp).
  enum class Notice : uint8_t { kRunsOnCpu = 0, kHostLimitReached = 1, kCannotCopy = 2, kHeldNeverServed = 3 };
  bool claimNotice(Notice notice) {
    const uint8_t bit = static_cast<uint8_t>(uint8_t{1} << static_cast<int>(notice));
    return (notices_.fetch_or(bit) & bit) == 0;
  }

  // Whether a forward of this site may have recompute calls to skip (NOTE: [The recompute runs
  // only what backward needs] in dead_calls.cpp): unknown until a watched forward ended, then
  // whether any had one. Once one did, every forward of the site is watched.
  enum class DeadCallsSeen : uint8_t { kUnknown = 0, kNone = 1, kSome = 2 };
  bool deadCallsPossible() const { return deadCallsSeen() != DeadCallsSeen::kNone; }
  DeadCallsSeen deadCallsSeen() const { return dead_calls_.load(std::memory_order_relaxed); }
  void noteDeadCalls(bool any) {
    if (any) {
      dead_calls_.store(DeadCallsSeen::kSome, std::memory_order_relaxed);
    } else {
      DeadCallsSeen unknown = DeadCallsSeen::kUnknown;
      dead_calls_.compare_exchange_strong(unknown, DeadCallsSeen::kNone, std::memory_order_relaxed);
    }
  }

  // Whether a region of this site may write outside itself in its forward: unknown until a forward
  // of the site has been intercepted, then what the forwards showed. A region whose policy keeps
  // nothing intercepts only while this holds.
  enum class OutsideWritesSeen : uint8_t { kUnknown = 0, kNone = 1, kSome = 2 };
  bool mayWriteOutside() const {
    return watches_outside_writes_ && outside_writes_.load(std::memory_order_relaxed) != OutsideWritesSeen::kNone;
  }
  OutsideWritesSeen outsideWritesSeen() const { return outside_writes_.load(std::memory_order_relaxed); }
  // At the end of an intercepted forward: whether it wrote outside its region. Once one did, the
  // site stays watched.
  void noteOutsideWrites(bool any) {
    if (!watches_outside_writes_) return;
    if (any) {
      outside_writes_.store(OutsideWritesSeen::kSome, std::memory_order_relaxed);
    } else {
      OutsideWritesSeen unknown = OutsideWritesSeen::kUnknown;
      outside_writes_.compare_exchange_strong(unknown, OutsideWritesSeen::kNone, std::memory_order_relaxed);
    }
  }

  // How many calls a forward of a region of this site named last time: a sizing hint for the
  // next region's data-flow tables (relaxed: any recent value will do).
  size_t callsPerPassHint() const { return calls_per_pass_hint_.load(std::memory_order_relaxed); }
  void noteCallsPerPass(size_t calls) { calls_per_pass_hint_.store(calls, std::memory_order_relaxed); }

 private:
  std::shared_ptr<const Policy> policy_;
  std::string label_;
  std::atomic<uint8_t> notices_{0};
  std::atomic<size_t> calls_per_pass_hint_{0};
  std::atomic<bool> any_never_reached_{false};
  bool watches_outside_writes_ = true;
  std::atomic<OutsideWritesSeen> outside_writes_{OutsideWritesSeen::kUnknown};
  std::atomic<DeadCallsSeen> dead_calls_{DeadCallsSeen::kUnknown};
  mutable std::mutex mutex_;  // guards warned_ and never_reached_
  HashSet<const OpEntry*> warned_;
  HashSet<std::pair<const OpEntry*, uint32_t>> never_reached_;
};

}  // namespace sac
