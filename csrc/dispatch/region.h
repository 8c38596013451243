#pragma once
// One checkpointed region instance: one call of checkpoint(fn, ...) and its recompute(s).
// It owns the kept outputs of that call, keyed by (op overload, call signature, how many such
// calls this region has kept so far), so forward and recompute agree on which output belongs
// to which call. Only kept calls are numbered, and per signature: calls that run in one pass
// only (FSDP2's all-gather path, profiler ops) cannot shift the numbering unless they would be
// kept themselves and have the very same argument shapes (NOTE: [Matching kept calls]).
//
// A region is used by one thread at a time: the forward on the caller's thread, the recompute
// on whichever thread autograd runs the backward on (the autograd engine orders the two).

#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "hash_containers.h"
#include "policy/policy.h"

namespace c10 {
class OperatorHandle;
}

namespace sac {

// Whether this thread is running an autograd graph task, and whether that backward keeps its
// graph (retain_graph=True), in which case kept outputs must survive for the next backward.
bool inAutogradGraphTask();
bool currentBackwardKeepsGraph();

// Regions are reference counted: the Python handle owns one reference, and every open
// activation of the region owns another, so a region cannot be freed while it is active.
class Region : public c10::intrusive_ptr_target {
 public:
  explicit Region(std::shared_ptr<const Policy> policy);

  const Policy& policy() const { return *policy_; }
  bool intercepts() const { return !policy_->keepsNothing(); }

  // Forward: the kept op's outputs are the last `num_returns` values on the stack; `signature`
  // is its call's (callSignature, taken before the kernel consumed the arguments).
  void keep(const OpEntry& op, uint64_t signature, UnitId unit, const torch::jit::Stack& stack, size_t num_returns);

  // Forward: an op is about to write these storages in place. Kept outputs living in them are
  // demoted: freed now and recomputed later, so that the recompute sees the value before the
  // write and applies the write again (see NOTE: [Kept outputs written in the forward]).
  void demoteKeptOutputsIn(const std::vector<const c10::StorageImpl*>& written);

  // Recompute: replace the op's arguments on the stack with its kept outputs and return true.
  // `consume` frees them (a backward that will not run again); otherwise they stay for the next
  // recompute. Returns false, leaving the stack alone, when the forward kept nothing for this
  // call (demoted, or a call the forward never made): the caller runs the kernel.
  bool serve(const OpEntry& op, uint64_t signature, const c10::OperatorHandle& handle, torch::jit::Stack* stack,
             bool consume);

  // The 0-based index of this call among the region's calls of `op` in the current pass
  // (forward and recompute counted apart), for every-nth rules.
  uint32_t nextCallIndex(const OpEntry& op, bool recompute) {
    return (recompute ? recompute_nth_calls_ : forward_nth_calls_)[&op]++;
  }

  void beginRecompute();
  // Frees every kept output unless the backward keeps its graph (retain_graph=True).
  void endRecompute(bool keep_entries);

  void setUnitsAroundForward(const std::vector<UnitId>& units) { units_around_forward_ = units; }
  const std::vector<UnitId>& unitsAroundForward() const { return units_around_forward_; }

  // Bytes of the unique storages this region holds, and how many op calls it kept.
  int64_t keptBytes() const;
  int64_t keptCalls() const;
  // The kept tensors themselves (shallow copies), for memory accounting across regions.
  std::vector<at::Tensor> keptTensors() const;

 private:
  struct KeptOutputs {
    std::vector<c10::IValue> outputs;  // tensors stored detached (shallow copies)
    std::vector<int64_t> versions;     // version of each stored tensor, in output order
    UnitId unit = kNoUnit;
    uint32_t call = 0;  // 0-based, among the region's calls of this op with this signature
    bool consumed = false;
    bool demoted = false;
  };
  // (op, signature): calls are numbered per pair. Key mixes the call number into the signature.
  using CallKind = std::pair<const OpEntry*, uint64_t>;
  using Key = std::pair<const OpEntry*, uint64_t>;
  static Key keyOf(const OpEntry* op, uint64_t signature, uint32_t call);

  HashMap<const c10::StorageImpl*, std::vector<Key>> kept_storages_;

  std::shared_ptr<const Policy> policy_;
  HashMap<Key, KeptOutputs> kept_;
  HashMap<CallKind, uint32_t> forward_calls_;
  HashMap<CallKind, uint32_t> recompute_calls_;
  HashMap<const OpEntry*, uint32_t> forward_nth_calls_;
  HashMap<const OpEntry*, uint32_t> recompute_nth_calls_;
  std::vector<UnitId> units_around_forward_;
  int recomputes_ = 0;
};

}  // namespace sac
