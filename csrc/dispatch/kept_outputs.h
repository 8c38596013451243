#pragma once
// The outputs a region keeps from its forward for its recompute, keyed by the data-flow identity
// of the call that produced them (NOTE: [Matching kept calls by data flow] in data_flow.cpp), so
// a recompute call is served only the output of its own twin in the forward: keeping them,
// serving them, and freeing them (served, released before the backward, or never asked for).
// One part of a Region, with one job; it owns the offloaded ones' part (offloaded_outputs.h),
// whose tensors live in its entries.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/held_inputs.h"
#include "dispatch/offload.h"
#include "dispatch/offloaded_outputs.h"
#include "dispatch/site.h"
#include "ops/hash_containers.h"
#include "policy/policy.h"

namespace c10 {
class OperatorHandle;
}

namespace sac {

struct PreservedStorage;  // preserved_writes.h

// Most calls return one tensor: held inline, a kept call allocates nothing for its outputs.
using KeptValues = c10::SmallVector<c10::IValue, 1>;

// What the forward kept of one call.
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

// How messages say where a kept output comes from: " (kept in unit 'attn')", " (offloaded by the
// op list)".
std::string unitSuffix(UnitId unit, bool offloaded);

// Recompute: raises, naming the call, when a kept tensor's version moved from `saved` (at the
// forward) to `now`: the recompute would read the mutated value.
inline void checkServedVersion(const KeptOutputs& kept, int64_t saved, int64_t now) {
  const std::string& name = kept.op->traits.qualified_name;
  TORCH_CHECK(saved == now, "sac: a tensor kept for backward was mutated after it was saved: the output of ", name,
              unitSuffix(kept.unit, !kept.offloaded.empty()), ", call ", kept.ordinal,
              " of this region, changed version from ", saved, " to ", now,
              ". The recompute would read the mutated value; clone it before mutating in place, or do not "
              "keep ",
              name);
}

class KeptOutputStore {
 public:
  // Forward: stores the held call's outputs, the last `num_returns` values on the stack, as the
  // outputs of the call with identity `call`, kept in `unit`, the op's `ordinal`-th kept call (0:
  // take the next, nextOrdinal), at `position` among the forward's decided calls. Returns the
  // entry, or null when the identity already has one (a 64-bit hash collision: the first stays,
  // the second runs again in the recompute).
  KeptOutputs* store(const OpEntry& op, uint64_t call, UnitId unit, uint32_t ordinal, uint64_t position,
                     const torch::jit::Stack& stack, size_t num_returns);
  // Forward: the number of the op's next kept call (1-based).
  uint32_t nextOrdinal(const OpEntry& op) { return ++ordinals_[&op]; }
  // Forward: offloads what it can of `kept`, just stored; whether any was offloaded.
  bool offload(KeptOutputs& kept, Site& site) { return offloaded_.offload(kept, site); }

  // Forward: an op is about to write these storages. Kept outputs living in them are preserved
  // from before the write, or released where they cannot be (NOTE: [Kept outputs written in the
  // forward] in preserved_writes.cpp).
  void preserveIn(const std::vector<WrittenStorage>& written);
  // End of the forward: releases the outputs of calls after `last_saved_position` and tells
  // `site` (NOTE: [Kept outputs the recompute never reaches] in kept_outputs.cpp). Returns how
  // many were released.
  int64_t releaseUnreached(int64_t last_saved_position, Site& site);
  // Whether the call with identity `call` has outputs held for the recompute.
  bool holds(uint64_t call) const {
    auto found = entries_.find(call);
    return found != entries_.end() && !found->second.released && !found->second.outputs.empty();
  }

  // Recompute: counts what is left to serve (NOTE: [The recompute after the last kept call] in
  // kept_outputs.cpp).
  void beginRecompute();
  size_t leftToServe() const { return left_to_serve_; }
  // Recompute: pushes the outputs kept for the call with identity `call` of `op` on the stack and
  // returns true, or returns false, leaving the stack alone, when none are held. `consume`: this
  // backward frees what it is served; otherwise they stay, and a write the recompute makes again
  // goes to a copy made once per `pass` (NOTE: [Kept outputs written in the forward]).
  bool serve(const OpEntry& op, uint64_t call, const c10::OperatorHandle& handle, torch::jit::Stack* stack,
             bool consume, uint64_t pass);
  // End of a recompute that frees what it holds: counts, per op, each held output it never served
  // and returns the warning naming them if `site` has not said it yet, else an empty string
  // (NOTE: [Served, or named] in kept_outputs.cpp).
  std::string countNeverServed(Site& site);
  // Frees every entry: a later recompute is told its outputs were freed.
  void consumeAll();
  // Frees every entry and forgets them (NOTE: [A region owns what it holds] in region.h).
  void releaseAll();

  // Bytes of the unique storages the kept outputs live in, how many calls have outputs held
  // (kept or offloaded), and the kept tensors themselves (not the offloaded ones).
  int64_t bytes() const;
  int64_t calls() const;
  std::vector<at::Tensor> tensors() const;
  // Pinned host bytes the offloaded outputs hold, and how many calls they belong to.
  int64_t offloadedBytes() const { return offloaded_.bytes(); }
  int64_t offloadedCalls() const { return offloaded_.calls(entries_); }
  // Starts copying back `inputs`' offloaded inputs, then the offloaded outputs (a prefetch).
  void fetchOffloaded(HeldInputs& inputs) { offloaded_.fetch(entries_, inputs); }

 private:
  // Frees what an entry holds: its kept outputs, and its offloaded outputs' host buffers.
  void drop(KeptOutputs& kept) {
    kept.outputs.clear();
    kept.preserved.clear();
    if (!kept.offloaded.empty()) offloaded_.drop(kept);
  }
  // Frees an entry before the backward: the recompute runs its call again.
  void release(KeptOutputs& kept) {
    drop(kept);
    kept.released = true;
  }

  OffloadedOutputs offloaded_;
  HashMap<uint64_t, KeptOutputs> entries_;  // by the producing call's data-flow identity
  // The calls whose kept outputs live in each storage, until a write preserves them.
  HashMap<const c10::StorageImpl*, c10::SmallVector<uint64_t, 1>> storages_;
  HashMap<const OpEntry*, uint32_t> ordinals_;
  size_t left_to_serve_ = 0;
};

}  // namespace sac
