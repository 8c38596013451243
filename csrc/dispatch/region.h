#pragma once
// One checkpointed region instance: one call of checkpoint(fn, ...) and its recompute(s).
// It composes the parts that hold what that call keeps for its recompute (the kept outputs, keyed
// by the data-flow identity of the call that produced them: NOTE: [Matching kept calls by data
// flow] in data_flow.cpp; the inputs it holds; what its forward wrote outside it), and owns the
// data flow of each pass, its links to the regions around it, and its checkpoint site.
//
// A region is used by one thread at a time: the forward on the caller's thread, the recompute
// on whichever thread autograd runs the backward on (the autograd engine orders the two).

#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/dead_calls.h"
#include "dispatch/held_inputs.h"
#include "dispatch/kept_outputs.h"
#include "dispatch/outside_writes.h"
#include "dispatch/routing_check.h"
#include "dispatch/site.h"
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
            size_t num_returns, uint32_t ordinal = 0) {
    KeptOutputs* kept = kept_.store(op, call, decision.unit, ordinal, forward_position_, stack, num_returns);
    if (kept != nullptr && decision.outcome == Outcome::kOffload) {
      any_offloaded_ = kept_.offload(*kept, *site_) || any_offloaded_;
    }
  }
  // Forward: the number of the op's next kept call (1-based), taken whether or not it is held.
  uint32_t nextKeptOrdinal(const OpEntry& op) { return kept_.nextOrdinal(op); }

  // Forward: one more call of the region was decided (its position, for releaseUnreached).
  void advancePosition() { ++forward_position_; }
  int64_t forwardPosition() const { return static_cast<int64_t>(forward_position_); }
  // End of the forward: frees the kept outputs of calls after `last_saved_position` (the position
  // at the forward's last tensor saved for backward), which the recompute's early stop never
  // reaches, and tells the site, so later regions do not hold them. Returns how many were freed.
  // (NOTE: [Kept outputs the recompute never reaches] in kept_outputs.cpp)
  int64_t releaseUnreached(int64_t last_saved_position) { return kept_.releaseUnreached(last_saved_position, *site_); }

  // Forward: an op is about to write these storages. Kept outputs living in them are preserved:
  // the region holds their value from before the write, and serves it (see NOTE: [Kept outputs
  // written in the forward] in preserved_writes.cpp).
  void preserveKeptOutputsIn(const std::vector<WrittenStorage>& written) { kept_.preserveIn(written); }

  // Forward: whether this forward replays a nested checkpoint inside the recompute of the region
  // around it, and so holds nothing (NOTE: [A checkpoint replayed by the recompute around it holds
  // nothing] in region.cpp).
  bool replaysOnly() const { return replays_only_; }

  // Recompute: whether a call may still be served in this pass. Once every kept output has been
  // served, the rest of the recompute needs neither lookups nor data-flow records (NOTE: [The
  // recompute after the last kept call] in kept_outputs.cpp).
  // Routing calls still to check (NOTE: [Unpinned routing must repeat itself] in
  // routing_check.cpp) keep the pass named as well.
  // A region with checkpoints nested in it names every call of its recompute for them (NOTE: [A
  // nested checkpoint names its inputs as the outer does] in data_flow.cpp).
  // So does one whose forward wrote outside it: the recompute's copies of what it wrote are named
  // as their originals (NOTE: [The recompute writes nothing outside its region]).
  bool servesMore() const {
    return kept_.leftToServe() > 0 || routing_.pending() > 0 || has_nested_regions_ || outside_writes_.any();
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
  bool serve(const OpEntry& op, uint64_t call, const c10::OperatorHandle& handle, torch::jit::Stack* stack) {
    return kept_.serve(op, call, handle, stack, consume_served_, passes_);
  }

  // Forward: the 0-based index of this call among the region's calls of `op`, for every-nth rules.
  uint64_t nextCallIndex(const OpEntry& op) { return forward_nth_calls_[&op]++; }

  void beginForward();
  // Drops the forward's data-flow records; the kept outputs stay for the recompute.
  void endForward();
  // Also starts copying back this region's offloaded outputs, and those of the region the
  // backward reaches next (the one that offloaded just before this one's forward ended).
  void beginRecompute();
  // Starts copying back every offloaded input and output still on the host (a prefetch).
  void fetchOffloaded() {
    if (any_offloaded_) kept_.fetchOffloaded(inputs_);
  }
  // Frees every kept output unless the backward keeps its graph (retain_graph=True); counts the
  // ones the recompute never asked for and, once per site, words the warning that names them
  // (NOTE: [Served, or named] in kept_outputs.cpp), which takeNeverServedNotice hands over.
  void endRecompute(bool keep_entries);
  // The warning the last recompute left for the user, once per checkpoint site; empty if none.
  // The caller issues it where the user's warning filters apply (a HeldNeverServedWarning).
  std::string takeNeverServedNotice() { return std::exchange(never_served_notice_, std::string()); }

  void setUnitsAroundForward(const std::vector<UnitId>& units) { units_around_forward_ = units; }
  const std::vector<UnitId>& unitsAroundForward() const { return units_around_forward_; }

  // Bytes of the unique device (or CPU) storages this region holds, and how many op calls it
  // holds outputs of (kept or offloaded).
  int64_t keptBytes() const { return kept_.bytes(); }
  int64_t keptCalls() const { return kept_.calls(); }
  // The kept tensors themselves (shallow copies), for memory accounting across regions; not the
  // offloaded ones, which hold no device memory.
  std::vector<at::Tensor> keptTensors() const { return kept_.tensors(); }
  // Pinned host bytes this region's offloaded outputs hold, and how many calls they belong to.
  int64_t offloadedBytes() const { return kept_.offloadedBytes(); }
  int64_t offloadedCalls() const { return kept_.offloadedCalls(); }

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
  // Frees every entry and the prefetch link, once (NOTE: [A region owns what it holds]).
  void releaseHeld();

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
  // Whether the forward offloaded anything, inputs or kept outputs: the recompute fetches them.
  bool any_offloaded_ = false;
  bool intercepts_ = false;
  DataFlow flow_;
  RoutingCheck routing_;
  OutsideWrites outside_writes_;
  DeadCalls dead_calls_;
  // What the forward kept for the recompute, offloaded outputs included.
  KeptOutputStore kept_;
  HashMap<const OpEntry*, uint64_t> forward_nth_calls_;
  std::vector<UnitId> units_around_forward_;
  uint64_t passes_ = 0;
  uint64_t forward_position_ = 0;
  size_t calls_per_pass_ = 0;  // calls the forward named: what the recompute's records reserve
  std::string never_served_notice_;
  // Whether this recompute frees what it is served: its backward does not keep its graph.
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
