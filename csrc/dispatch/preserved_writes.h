#pragma once
// Kept outputs that the forward itself writes after keeping them: the region's copy of their
// storage from before the write, which the recompute is served (NOTE: [Kept outputs written in
// the forward] in preserved_writes.cpp). One part of a Region, with one job.

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

#include "dispatch/kept_outputs.h"
#include "dispatch/offloaded_outputs.h"
#include "ops/hash_containers.h"

namespace sac {

// The region's copy of a storage that a write in the forward was about to change: `pristine`
// holds the value from before the write. The recompute writes again what it is served, so a
// backward that keeps its graph is served views of `working`, a copy of it made once per
// recompute pass, which keeps the outputs that shared the storage aliased.
struct PreservedStorage {
  at::Tensor pristine;  // 1-D, over the whole storage
  at::Tensor working;
  uint64_t working_pass = 0;

  // The copy recompute pass `pass` is served views of, made at its first serve.
  const at::Tensor& workingFor(uint64_t pass);
};

// Holds the value from before a write of every kept output living in `storage`, made by `calls`
// (entries of `entries`): the device ones as views of one copy of the storage, the offloaded
// ones (`offloaded`) copied out first. Returns false, changing nothing, when they cannot be.
bool preserveBeforeWrite(const c10::StorageImpl* storage, c10::ArrayRef<uint64_t> calls,
                         HashMap<uint64_t, KeptOutputs>& entries, OffloadedOutputs& offloaded);

}  // namespace sac
