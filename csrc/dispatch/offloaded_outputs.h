#pragma once
// The kept outputs a region holds in pinned host memory (NOTE: [Offloading kept outputs] in
// offload.cpp): offloading an entry's outputs after keep, the copies back ahead of the recompute,
// and the host bytes they hold. The offloaded tensors live in their entries (KeptOutputs, in
// kept_outputs.h); this part guards them and counts them. One part of a Region, with one job.

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <mutex>
#include <utility>

#include "dispatch/held_inputs.h"
#include "dispatch/site.h"
#include "ops/hash_containers.h"

namespace sac {

struct KeptOutputs;

class OffloadedOutputs {
 public:
  // Forward: offloads the outputs of `kept` (just stored by the kept-output store) that can be,
  // after the checks of NOTE: [Offloading kept outputs]; the rest stay kept. Returns whether any
  // was offloaded. `site` says each refusal once.
  bool offload(KeptOutputs& kept, Site& site);
  // Recompute: checks that no offloaded output of `kept` was written since the forward, then
  // sets `values` to its outputs with each offloaded slot filled by its tensor on the device.
  // `keep_host` (a backward that keeps its graph) leaves the host copies for the next.
  void take(KeptOutputs& kept, bool keep_host, c10::SmallVectorImpl<c10::IValue>& values);
  // Frees the offloaded outputs of `kept` (their host buffers back to the pool).
  void drop(KeptOutputs& kept);
  // Forward, before a write: the host copies of these offloaded outputs (an entry, and the index
  // in its `offloaded`) hold the value from before it (NOTE: [Kept outputs written in the
  // forward] in preserved_writes.cpp).
  void detachBeforeWrite(c10::ArrayRef<std::pair<KeptOutputs*, size_t>> outputs);
  // Starts copying back `inputs`' offloaded inputs, then every offloaded output in `entries`, in
  // the order the forward made them (a prefetch, which another region's recompute may start).
  void fetch(HashMap<uint64_t, KeptOutputs>& entries, HeldInputs& inputs);

  // Pinned host bytes the offloaded outputs hold, and how many of `entries` have any.
  int64_t bytes() const;
  int64_t calls(const HashMap<uint64_t, KeptOutputs>& entries) const;

 private:
  // Guards the offloaded outputs' copies, which the recompute of another region may start
  // (fetch) while this region is idle.
  mutable std::mutex mutex_;
  int64_t bytes_ = 0;
};

}  // namespace sac
