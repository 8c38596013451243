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
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/dead_calls.h"
#include "dispatch/held_inputs.h"
#include "dispatch/offload.h"
#include "dispatch/outside_writes.h"
#include "dispatch/routing_check.h"
#include "dispatch/site.h"
#include "dispatch/storage_copy.h"
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

// NOTE: [A region owns what it holds]
// Regions are reference counted: the Python handle owns one reference (torch's checkpoint holds
// it through the contexts it made, which live as long as the graph that holds the checkpoint),
// and every open activation of the region owns another, so a region cannot be freed while it is
// active. Everything a region holds (kept outputs on the device, offloaded outputs' pinned
// buffers, their copies in flight and copies fetched back ahead of the backward) is released the
// moment its last strong reference goes, however the step ended: a backward, a forward whose
// graph was dropped without one, an exception. Only weak references to a region exist elsewhere
// (the prefetch link to the region the backward reaches next), and a weak reference keeps no
// resource: release_resources() frees them before the object itself is gone.
class Region : public c10::intrusive_ptr_target {
 public:
  // A region of `site`, which learns from it (NOTE: [What a site learns] in site.h).
  explicit Region(std::shared_ptr<Site> site);
  // A region with a site of its own.
  explicit Region(std::shared_ptr<const Policy> policy);
  // A profiling region: it keeps nothing, but intercepts every call and hands it to `profile`
  // (NOTE: [Profiling a region] in dispatch/call_profile.cpp).
  Region(std::shared_ptr<const Policy> policy, std::shared_ptr<CallProfile> profile);
  ~Region() override;
  // Called when the last strong reference goes while weak ones remain.
  void release_resources() override;

  // Regions alive in the process (not yet released): tests check that steps free theirs.
  static int64_t liveCount();

  const Policy& policy() const { return site_->policy(); }
  Site& site() const { return *site_; }
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
  // reaches, and tells the site, so later regions do not hold them. Returns how many were freed.
  // (NOTE: [Kept outputs the recompute never reaches] in region.cpp)
  int64_t releaseUnreached(int64_t last_saved_position);

  // Forward: an op is about to write these storages. Kept outputs living in them are preserved:
  // the region holds their value from before the write, and serves it (see NOTE: [Kept outputs
  // written in the forward]).
  void preserveKeptOutputsIn(const std::vector<WrittenStorage>& written);

  // Recompute: whether a call may still be served in this pass. Once every kept output has been
  // served, the rest of the recompute needs neither lookups nor data-flow records (NOTE: [The
  // recompute after the last kept call]).
  // Routing calls still to check (NOTE: [Unpinned routing must repeat itself] in
  // routing_check.cpp) keep the pass named as well.
  // Forward: whether this forward replays a nested checkpoint inside the recompute of the region
  // around it, and so holds nothing (NOTE: [A checkpoint replayed by the recompute around it holds
  // nothing] in region.cpp).
  bool replaysOnly() const { return replays_only_; }

  // A region with checkpoints nested in it names every call of its recompute for them (NOTE: [A
  // nested checkpoint names its inputs as the outer does] in data_flow.cpp).
  // So does one whose forward wrote outside it: the recompute's copies of what it wrote are named
  // as their originals (NOTE: [The recompute writes nothing outside its region]).
  bool servesMore() const {
    return left_to_serve_ > 0 || routing_.pending() > 0 || has_nested_regions_ || outside_writes_.any();
  }

  // The calls the recompute skips (NOTE: [The recompute runs only what backward needs] in
  // dead_calls.cpp).
  DeadCalls& deadCalls() { return dead_calls_; }
  // Forward, before its first call: the caller notes every tensor autograd saves
  // (deadCalls().noteSaved), so this forward finds its dead calls. Nothing to find where the
  // region keeps nothing, replays a nested checkpoint, or has its site's answer already.
  void watchSaves();

  // What the forward routed, where the policy recomputes the routing (pin_routing off).
  RoutingCheck& routing() { return routing_; }

  // What the forward wrote outside the region, kept from the recompute (NOTE: [The recompute
  // writes nothing outside its region] in outside_writes.cpp).
  OutsideWrites& outsideWrites() { return outside_writes_; }
  const OutsideWrites& outsideWrites() const { return outside_writes_; }
  // The pass under way (forward or recompute), counted from 1; what a pass's copies are made for.
  uint64_t pass() const { return passes_; }

  // Recompute: push the outputs the forward kept for the call with identity `call` after the
  // op's arguments on the stack (the engine drops the arguments) and return true. They are freed
  // unless this backward keeps its graph (retain_graph=True), in which case they stay for the
  // next recompute. Returns false, leaving the stack alone, when the forward kept nothing for
  // this call (not kept, released, or a call the forward never made): the caller runs the kernel.
  bool serve(const OpEntry& op, uint64_t call, const c10::OperatorHandle& handle, torch::jit::Stack* stack);

  // Forward: the 0-based index of this call among the region's calls of `op`, for every-nth rules.
  uint64_t nextCallIndex(const OpEntry& op) { return forward_nth_calls_[&op]++; }

  void beginForward();
  // Drops the forward's data-flow records; the kept outputs stay for the recompute.
  void endForward();
  // Also starts copying back this region's offloaded outputs, and those of the region the
  // backward reaches next (the one that offloaded just before this one's forward ended).
  void beginRecompute();
  // Starts copying back every offloaded output still on the host (a prefetch).
  void fetchOffloaded();
  // Frees every kept output unless the backward keeps its graph (retain_graph=True); counts the
  // ones the recompute never asked for and, once per site, words the warning that names them
  // (NOTE: [Served, or named] in region.cpp), which takeNeverServedNotice hands over.
  void endRecompute(bool keep_entries);
  // The warning the last recompute left for the user, once per checkpoint site; empty if none.
  // The caller issues it where the user's warning filters apply (a HeldNeverServedWarning).
  std::string takeNeverServedNotice() { return std::exchange(never_served_notice_, std::string()); }

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

  // NOTE: [Offloading a layer's inputs] (offload.cpp)
  // Forward, at the end of the region's function: holds `inputs` (the region's positional inputs
  // that carry the stack's activation) for its recompute, each offloaded to pinned host memory
  // when it can be, else held on its device; `names` say which argument each is, for messages.
  // Returns, per input, whether it was offloaded; `notice`, when given, receives the warning to
  // show the user (the host limit reached, said once per checkpoint site), which the caller
  // issues where the user's warning filters apply.
  std::vector<bool> holdInputs(const std::vector<at::Tensor>& inputs, const std::vector<std::string>& names,
                               std::string* notice = nullptr);
  // Recompute: the held inputs on their devices, in the order holdInputs took them; raises,
  // naming the input, when one was written in place after the forward. The host copies stay for
  // another backward when this one keeps its graph (retain_graph=True).
  std::vector<at::Tensor> takeInputs();
  // The region that holds the inputs of the function this region's scopes run: this one, or the
  // one delegateInputsTo named (a dispatch-mode engine's marker region hands them to the region
  // that holds its kept and offloaded outputs, NOTE: [The dispatch-mode engine's region]).
  c10::intrusive_ptr<Region> inputsOwner();
  // The region that decides this one's calls: this one, or, for a dispatch-mode engine's marker,
  // the region it delegates to (null if that is gone).
  Region* decidingRegion();
  void delegateInputsTo(const c10::intrusive_ptr<Region>& owner);
  // Pinned host bytes the offloaded inputs hold, and how many inputs are offloaded.
  int64_t offloadedInputBytes() const;
  int64_t offloadedInputs() const;

 private:
  // The region's copy of a storage that a write in the forward was about to change (NOTE: [Kept
  // outputs written in the forward]): `pristine` holds the value from before the write. The
  // recompute writes again what it is served, so a backward that keeps its graph is served views
  // of `working`, a copy of it made once per recompute pass, which keeps the outputs that shared
  // the storage aliased.
  struct PreservedStorage {
    at::Tensor pristine;  // 1-D, over the whole storage
    at::Tensor working;
    uint64_t working_pass = 0;
  };
  // Most calls return one tensor: held inline, a kept call allocates nothing for its outputs.
  using KeptValues = c10::SmallVector<c10::IValue, 1>;
  struct KeptOutputs {
    const OpEntry* op = nullptr;
    // Tensors stored detached (shallow copies); an offloaded output's slot holds None.
    KeptValues outputs;
    c10::SmallVector<int64_t, 1> versions;  // version of each stored tensor, in output order
    // Offloaded outputs, by their slot in `outputs`.
    std::vector<std::pair<size_t, OffloadedTensor>> offloaded;
    // The storages the offloaded outputs lived in on the device, held weakly: while a write to
    // one can still reach the region before the backward, its address cannot be reused by another
    // storage.
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> offloaded_storages;
    UnitId unit = kNoUnit;
    uint32_t ordinal = 0;   // 1-based, among the calls of this op the forward kept (for messages)
    uint64_t position = 0;  // the forward's calls decided up to and including this one
    bool consumed = false;
    // Freed before the backward and not served: its outputs could not be preserved from a write
    // in the forward, or the recompute never reaches the call.
    bool released = false;
    // The outputs stored as views of a region's copy of their storage (a write in the forward
    // followed), by their slot in `outputs`.
    std::vector<std::pair<size_t, std::shared_ptr<PreservedStorage>>> preserved;
  };

  // Holds the value from before a write of every kept output living in `storage`, made by
  // `calls` (the device ones as views of one copy of the storage, the offloaded ones copied out
  // first); false, changing nothing, when they cannot be (NOTE: [Kept outputs written in the
  // forward]).
  bool preserveBeforeWrite(const c10::StorageImpl* storage, c10::ArrayRef<uint64_t> calls);

  // Frees what an entry holds: its kept outputs, and its offloaded outputs' host buffers.
  void drop(KeptOutputs& kept);
  // Frees every entry and the prefetch link, once (NOTE: [A region owns what it holds]).
  void releaseHeld();
  // Offloads the outputs of `kept` (stored in keep()) that can be, after the checks of NOTE:
  // [Offloading kept outputs]; the rest stay kept.
  void offload(KeptOutputs& kept);

  std::shared_ptr<Site> site_;
  std::shared_ptr<CallProfile> profile_;
  // The region that offloaded just before this one's forward ended, on the same thread: the
  // backward reaches it next, so this region's recompute fetches its offloaded outputs ahead.
  struct WeakLink;  // a c10::weak_intrusive_ptr<Region>, which needs Region complete
  std::unique_ptr<WeakLink> offloaded_before_;
  // Where this region's function's inputs are held, when not here (delegateInputsTo).
  std::unique_ptr<WeakLink> inputs_owner_;
  HeldInputs inputs_;
  bool released_ = false;
  // Guards the offloaded outputs' copies, which the recompute of another region may start
  // (fetchOffloaded) while this region is idle.
  mutable std::mutex offload_mutex_;
  int64_t offloaded_bytes_ = 0;
  bool any_offloaded_ = false;
  bool intercepts_ = false;
  DataFlow flow_;
  RoutingCheck routing_;
  OutsideWrites outside_writes_;
  DeadCalls dead_calls_;
  HashMap<uint64_t, KeptOutputs> kept_;  // by the producing call's data-flow identity
  HashMap<const c10::StorageImpl*, c10::SmallVector<uint64_t, 1>> kept_storages_;
  HashMap<const OpEntry*, uint32_t> kept_per_op_;
  HashMap<const OpEntry*, uint64_t> forward_nth_calls_;
  std::vector<UnitId> units_around_forward_;
  uint64_t passes_ = 0;
  uint64_t forward_position_ = 0;
  size_t left_to_serve_ = 0;
  size_t calls_per_pass_ = 0;  // calls the forward named: what the recompute's records reserve
  std::string never_served_notice_;
  bool consume_served_ = true;
  // NOTE: [A nested checkpoint names its inputs as the outer does] (data_flow.cpp): the region
  // around this one's forward; whether regions were nested in this one's forward; and what this
  // one's last recompute named, for them.
  std::unique_ptr<WeakLink> enclosing_;
  c10::intrusive_ptr<Region> enclosing_in_recompute_;  // held while this one's recompute reads its names
  bool has_nested_regions_ = false;
  bool replays_only_ = false;
  NamesForNested names_for_nested_;
};

}  // namespace sac
