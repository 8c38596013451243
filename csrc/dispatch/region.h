#pragma once
// One checkpointed region instance: one call of checkpoint(fn, ...) and its recompute(s).
// It owns the kept outputs of that call, keyed by the data-flow identity of the call that
// produced them (NOTE: [Matching kept calls by data flow] in data_flow.cpp), so a recompute call
// is served only the output of its own twin in the forward, whatever ran in one pass only.
//
// A region is used by one thread at a time: the forward on the caller's thread, the recompute
// on whichever thread autograd runs the backward on (the autograd engine orders the two).

#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/offload.h"
#include "ops/hash_containers.h"
#include "policy/policy.h"

namespace c10 {
class OperatorHandle;
}

namespace sac {

class CallProfile;

// Whether this thread is running an autograd graph task, and whether that backward keeps its
// graph (retain_graph=True), in which case kept outputs must survive for the next backward.
bool inAutogradGraphTask();
bool currentBackwardKeepsGraph();

// Regions are reference counted: the Python handle owns one reference, and every open
// activation of the region owns another, so a region cannot be freed while it is active.
class Region : public c10::intrusive_ptr_target {
 public:
  explicit Region(std::shared_ptr<const Policy> policy);
  // A profiling region: it keeps nothing, but intercepts every call and hands it to `profile`
  // (NOTE: [Profiling a region] in dispatch/call_profile.cpp).
  Region(std::shared_ptr<const Policy> policy, std::shared_ptr<CallProfile> profile);
  ~Region() override;

  // Regions alive in the process: tests check that checkpointed steps free theirs.
  static int64_t liveCount();

  const Policy& policy() const { return *policy_; }
  bool intercepts() const { return intercepts_; }
  // Null except in a profiling region: one predictable branch in the fallback.
  CallProfile* profile() const { return profile_.get(); }

  // The data flow of the pass under way (forward or recompute).
  DataFlow& flow() { return flow_; }

  // Forward: the held call's outputs are the last `num_returns` values on the stack; `call` is
  // its data-flow identity; `decision` what the rule decided (kKeep or kOffload, and the unit
  // that selected it); `ordinal` its 1-based number among the op's held calls in this forward
  // (nextKeptOrdinal), or 0 to take the next one here. An offloaded call whose outputs cannot be
  // offloaded is kept on its device (NOTE: [Offloading kept outputs] in offload.cpp).
  void keep(const OpEntry& op, uint64_t call, const Decision& decision, const torch::jit::Stack& stack,
            size_t num_returns, uint32_t ordinal = 0);
  // Forward: the number of the op's next kept call (1-based), taken whether or not it is held.
  uint32_t nextKeptOrdinal(const OpEntry& op) { return ++kept_per_op_[&op]; }

  // Forward: one more call of the region was decided (its position, for releaseUnreached).
  void advancePosition() { ++forward_position_; }
  int64_t forwardPosition() const { return static_cast<int64_t>(forward_position_); }
  // End of the forward: frees the kept outputs of calls after `last_saved_position` (the position
  // at the forward's last tensor saved for backward), which the recompute's early stop never
  // reaches, and tells the policy, so later regions do not hold them. Returns how many were freed.
  // NOTE: [Kept outputs the recompute never reaches]
  int64_t releaseUnreached(int64_t last_saved_position);

  // Forward: an op is about to write these storages in place. Kept outputs living in them are
  // demoted: freed now and recomputed later, so that the recompute sees the value before the
  // write and applies the write again (see NOTE: [Kept outputs written in the forward]).
  void demoteKeptOutputsIn(const std::vector<WrittenStorage>& written);

  // Whether the forward kept anything (the recompute skips the lookup otherwise). Entries that
  // were consumed stay, so that a backward that runs an extra time is told so.
  bool keptAnything() const { return !kept_.empty(); }

  // Recompute: whether a call may still be served in this pass. Once every kept output has been
  // served, the rest of the recompute needs neither lookups nor data-flow records (NOTE: [The
  // recompute after the last kept call]).
  bool servesMore() const { return left_to_serve_ > 0; }
  // Recompute: whether served outputs are freed (this backward does not keep its graph), read
  // once per pass rather than per call.
  bool consumesServed() const { return consume_served_; }

  // Recompute: replace the op's arguments on the stack with the outputs the forward kept for the
  // call with identity `call` and return true. They are freed unless this backward keeps its
  // graph (retain_graph=True), in which case they stay for the next recompute. Returns false, leaving the stack
  // alone, when the forward kept nothing for this call (not kept, demoted, or a call the forward
  // never made): the caller runs the kernel.
  bool serve(const OpEntry& op, uint64_t call, const c10::OperatorHandle& handle, torch::jit::Stack* stack);

  // Forward: the 0-based index of this call among the region's calls of `op`, for every-nth rules.
  uint64_t nextCallIndex(const OpEntry& op) { return forward_nth_calls_[&op]++; }

  void beginForward();
  // Drops the forward's data-flow records; the kept outputs stay for the recompute.
  void endForward();
  // Also starts copying back this region's offloaded outputs, and those of the region of the
  // same policy that the backward reaches next (the one whose forward ran just before).
  void beginRecompute();
  // Starts copying back every offloaded output still on the host (a prefetch).
  void fetchOffloaded();
  // Frees every kept output unless the backward keeps its graph (retain_graph=True).
  void endRecompute(bool keep_entries);

  void setUnitsAroundForward(const std::vector<UnitId>& units) { units_around_forward_ = units; }
  const std::vector<UnitId>& unitsAroundForward() const { return units_around_forward_; }

  // Bytes of the unique device (or CPU) storages this region holds, and how many op calls it
  // holds outputs of (kept or offloaded).
  int64_t keptBytes() const;
  int64_t keptCalls() const;
  // The kept tensors themselves (shallow copies), for memory accounting across regions; not the
  // offloaded ones, which hold no device memory.
  std::vector<at::Tensor> keptTensors() const;
  // Pinned host bytes this region's offloaded outputs hold, and how many calls they belong to.
  int64_t offloadedBytes() const;
  int64_t offloadedCalls() const;

 private:
  struct KeptOutputs {
    const OpEntry* op = nullptr;
    // Tensors stored detached (shallow copies); an offloaded output's slot holds None.
    std::vector<c10::IValue> outputs;
    std::vector<int64_t> versions;     // version of each stored tensor, in output order
    // Offloaded outputs, by their slot in `outputs`.
    std::vector<std::pair<size_t, OffloadedTensor>> offloaded;
    // The storages the offloaded outputs lived in on the device, held weakly: while a write to
    // one can still demote the call, its address cannot be reused by another storage.
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> offloaded_storages;
    UnitId unit = kNoUnit;
    uint32_t ordinal = 0;  // 1-based, among the calls of this op the forward kept (for messages)
    uint64_t position = 0;  // the forward's calls decided up to and including this one
    bool consumed = false;
    bool demoted = false;
  };

  // Frees what an entry holds: its kept outputs, and its offloaded outputs' host buffers.
  void drop(KeptOutputs& kept);
  // Offloads the outputs of `kept` (stored in keep()) that can be, after the checks of NOTE:
  // [Offloading kept outputs]; the rest stay kept.
  void offload(KeptOutputs& kept);

  std::shared_ptr<const Policy> policy_;
  std::shared_ptr<CallProfile> profile_;
  // Guards the offloaded outputs' copies, which the recompute of another region may start
  // (fetchOffloaded) while this region is idle.
  mutable std::mutex offload_mutex_;
  int64_t offloaded_bytes_ = 0;
  bool any_offloaded_ = false;
  bool intercepts_ = false;
  DataFlow flow_;
  HashMap<uint64_t, KeptOutputs> kept_;  // by the producing call's data-flow identity
  HashMap<const c10::StorageImpl*, std::vector<uint64_t>> kept_storages_;
  HashMap<const OpEntry*, uint32_t> kept_per_op_;
  HashMap<const OpEntry*, uint64_t> forward_nth_calls_;
  std::vector<UnitId> units_around_forward_;
  uint64_t passes_ = 0;
  uint64_t forward_position_ = 0;
  size_t left_to_serve_ = 0;
  size_t calls_per_pass_ = 0;  // calls the forward named: what the recompute's records reserve
  bool consume_served_ = true;
};

}  // namespace sac
