#pragma once
// The writes a region's forward makes to tensors it did not produce, and how its recompute is
// kept from making them again (NOTE: [The recompute writes nothing outside its region] in
// outside_writes.cpp). One part of a Region, with one job.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dispatch/data_flow.h"
#include "ops/hash_containers.h"

namespace sac {

struct OpEntry;

class OutsideWrites {
 public:
  // Forward, before a call of `op` writes `written` (its arguments start at `arguments`): each
  // storage no call of this pass produced is outside the region, and what the recompute needs of
  // it is noted at its first write. `layer` is what messages call the region.
  void noteForward(const DataFlow& flow, const OpEntry& op, const c10::IValue* arguments,
                   const std::vector<WrittenStorage>& written, const std::string& layer);

  // Whether the forward wrote anything outside the region.
  bool any() const { return !preserved_.empty(); }

  // Recompute pass `pass`, before a call of `op` is named: replaces each of its `count` arguments
  // (from `arguments`) that must not touch the storage it lives in by the same view over the
  // pass's own copy. Raises, naming the layer, the op and the tensor, where the forward's write
  // could not be preserved. Returns whether any argument was replaced.
  bool redirect(DataFlow& flow, const OpEntry& op, c10::IValue* arguments, size_t count, uint64_t pass);

  // Frees what the forward preserved.
  void clear() { preserved_.clear(); }

  // Bytes the forward preserved for the recompute (the pass's copies live only during it).
  int64_t preservedBytes() const;

 private:
  struct Preserved {
    // The storage's value from before the forward's first write: where the forward read it
    // before writing it, or wrote only part of it. Undefined where the first write replaced the
    // whole storage without reading it (the recompute's copy starts uninitialised).
    at::Tensor pristine;
    int64_t elements = 0;
    c10::TensorOptions options;
    int64_t forward_shift = 0;  // where the forward's storage began in what the name names
    // Whether the forward read the storage before it wrote it: then the recompute reads the
    // preserved value from its first use; otherwise from its first write (a write the forward
    // made in one pass only, such as FSDP2's all-gather, is not replayed, and the recompute reads
    // the storage as it finds it).
    bool read_before_write = false;
    at::Tensor working;  // the recompute's copy, made once per pass
    uint64_t working_pass = 0;
    std::string refusal;  // why it could not be preserved: raised where the recompute uses it
  };
  // `tensor` redirected to the pass's copy, or undefined where it stays as it is; `writes`: the
  // call writes it.
  at::Tensor redirected(DataFlow& flow, const at::Tensor& tensor, bool writes, uint64_t pass);

  // By the name the data flow gives the storage (NOTE: [Matching kept calls by data flow]), which
  // a copy of a region input brought back for the recompute shares with its original.
  HashMap<uint64_t, Preserved> preserved_;
};

}  // namespace sac
