#pragma once
// The part of a region that finds the recompute calls nothing the backward needs reads, and
// stands in for them in the recompute (NOTE: [The recompute runs only what backward needs] in
// dead_calls.cpp).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dispatch/data_flow.h"
#include "ops/hash_containers.h"

namespace sac {

struct OpEntry;

class DeadCalls {
 public:
  // Forward: forgets the last forward's calls and what it found dead.
  void beginForward();
  // Forward, before its first call: this forward notes its calls, and what autograd saves is
  // noted too (noteSaved), so its end can find the dead calls.
  void track() { tracking_ = true; }
  bool tracking() const { return tracking_; }

  // Forward, before the kernel of a call the region named (and will finish): `identity` names it
  // (NOTE: [Matching kept calls by data flow] in data_flow.cpp), `arguments` are its
  // `num_arguments` arguments, `written` the storages it writes, and `may_skip` whether nothing
  // but its outputs' readers keeps it (a random draw, a routing call, a parameter cast do).
  void noteInputs(const OpEntry& op, uint64_t identity, bool may_skip, const c10::IValue* arguments,
                  size_t num_arguments, const std::vector<WrittenStorage>& written);
  // Forward, after that kernel: its outputs are the last `num_returns` values on `stack`.
  void noteOutputs(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t num_returns,
                   const std::vector<WrittenStorage>& written);
  // Forward: autograd saved a tensor for backward that lives in `storage` (a StorageImpl's
  // address, never dereferenced).
  void noteSaved(uintptr_t storage);
  // Forward: something the region cannot follow happened: autograd saved a tensor the region
  // cannot place (no storage, a subclass it cannot open), or a call ran that the region does not
  // see into (a tensor subclass's handler below the key, on torch 2.11). This forward's recompute
  // skips nothing.
  void noteWhatItCannotFollow() { cannot_follow_ = true; }

  // End of the forward: decides which calls the recompute skips. `served(identity)` says whether
  // the recompute is served that call's outputs. Returns how many it skips; the records go.
  size_t endForward(const std::function<bool(uint64_t)>& served);

  // Recompute, before its first call.
  void beginRecompute();
  // Recompute: when the forward found the call named `identity` dead, pushes stand-in outputs
  // after its arguments on the stack (the engine drops the arguments) and returns true.
  bool skip(const OpEntry& op, const c10::OperatorHandle& handle, uint64_t identity, torch::jit::Stack* stack,
            size_t num_arguments);
  // Recompute: before a call that runs reads its arguments, each stand-in among them is given
  // its values by running the call it stands in for. `label` names the layer, for the error a
  // skipped collective raises instead.
  void materializeReadsOf(const OpEntry& op, const c10::IValue* arguments, size_t num_arguments,
                          const std::string& label);
  bool skippedAny() const { return !stand_ins_.empty(); }
  bool any() const { return !dead_.empty(); }
  // End of the recompute: the stand-ins and what they would run are forgotten.
  void endRecompute();

 private:
  // What a skipped call's outputs look like, to make stand-ins with the same metadata: its data
  // flow names its readers by storage geometry (NOTE: [Matching kept calls by data flow]).
  struct Geometry {
    c10::SmallVector<int64_t, 4> sizes;
    c10::SmallVector<int64_t, 4> strides;
    int64_t offset = 0;
    int64_t storage_elements = 0;
    c10::TensorOptions options;
  };
  // One return of a call: -1 one tensor, -2 None, n >= 0 a list of n tensors.
  struct Outputs {
    c10::SmallVector<int32_t, 1> shape;
    c10::SmallVector<Geometry, 1> tensors;
  };
  struct ForwardCall {
    const OpEntry* op = nullptr;
    uint64_t identity = 0;
    bool candidate = false;  // its outputs can be stood in for, and nothing else keeps it
    bool saved = false;      // autograd saved one of its outputs
    bool read = false;       // a later call the region named reads one of its outputs
    bool may_skip = false;
    bool from_device = false;              // reads a tensor off the CPU
    c10::SmallVector<uint32_t, 2> inputs;  // the calls that produced what it reads
    Outputs outputs;                       // candidates only
  };
  struct DeadCall {
    const OpEntry* op = nullptr;
    Outputs outputs;
  };
  // A stand-in handed out in this recompute, held weakly (the memory goes with its last reader),
  // and its call in skipped_.
  struct StandIn {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    size_t skipped;
  };
  struct SkippedCall {
    const OpEntry* op = nullptr;
    std::optional<c10::OperatorHandle> handle;
    torch::jit::Stack arguments;  // held for materializing; empty for a collective
    const Outputs* outputs = nullptr;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> stand_ins;
    bool materialized = false;
  };

  void producedBy(const c10::StorageImpl* storage, uint32_t call) { producers_[storage] = call; }
  void materialize(size_t skipped, const std::string& label);

  bool tracking_ = false;
  bool cannot_follow_ = false;
  // A call of the forward read values on the host (NOTE: [The recompute runs only what backward
  // needs]: collectives are then never skipped).
  bool read_values_ = false;
  std::vector<ForwardCall> calls_;
  HashMap<const c10::StorageImpl*, uint32_t> producers_;
  HashMap<uint64_t, DeadCall> dead_;
  HashMap<const c10::StorageImpl*, StandIn> stand_ins_;
  std::vector<SkippedCall> skipped_;
};

}  // namespace sac
