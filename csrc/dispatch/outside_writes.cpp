#include "dispatch/outside_writes.h"

#include <ATen/ops/empty_strided.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

#include "dispatch/ivalue_tensors.h"
#include "dispatch/sac_key.h"
#include "dispatch/storage_copy.h"
#include "ops/op_catalog.h"

namespace sac {

// NOTE: [The recompute writes nothing outside its region]
// A checkpointed forward may write tensors it did not produce: BatchNorm's running statistics
// and num_batches_tracked, a mixture-of-experts load counter (self.load.add_(...)), a parameter, a
// region input, a global. torch's recompute runs the forward again, so it makes each write a
// second time (the statistics move twice a step, the counter counts double), and a read of such
// a tensor in the recompute sees what the forward left behind rather than what the forward read,
// so a tensor saved for backward from it is silently wrong. Only an engine that sees every call
// below autograd can tell those writes apart, for unmodified models, so the region does:
//   - forward: before a call writes a storage no call of this pass produced (the data flow has no
//     origin for it: NOTE: [Matching kept calls by data flow] in data_flow.cpp), the region copies
//     the whole storage, once, below every mode: its value from before the forward's first write.
//     The data flow notes which such storages the forward read, and so whether it read this one
//     before writing it;
//   - recompute: a tensor argument that lives in such a storage (the same storage, or a copy the
//     data flow names as it, such as an offloaded input brought back) is replaced, before the
//     call is named or run, by the same view over the pass's own copy of that value, named as the
//     original (NOTE: [A copy the region makes is named as its original]): from the storage's
//     first use where the forward read it before writing it, else from its first write. So the
//     recompute reads what the forward read, computes what the forward computed (BatchNorm still
//     normalises by the batch and returns what it saved), and writes into its copy, which goes
//     with the pass: the tensors outside the region keep the values the forward left (autograd's
//     in-place layer above the key still counts the write in their version counters). A write the forward made in one
//     pass only (FSDP2 all-gathers into its parameters' buffer in the forward only) is not replayed, so the recompute
//     reads that storage as it finds it, as before.
// A first write that replaces a whole storage without reading it (an out= argument covering it)
// needs no value from before it: the forward copies nothing, and the recompute's copy starts
// uninitialised.
// A storage that cannot be copied whole (a tensor subclass, a storage that does not hold a whole
// number of the tensor's elements) is not preserved; a recompute call that reads or writes it
// raises, naming the layer, the op and the tensor: never a silently wrong value.
// The preserved values are freed with the region (NOTE: [A region owns what it holds] in
// region.h): their bytes are the outside state the forward wrote (a BatchNorm's statistics, a
// counter), held from the forward to the backward. A policy that keeps nothing intercepts the
// first forward of its checkpoint site to find out whether the layer writes outside state, and
// keeps intercepting only where it does (NOTE: [What a site learns] in site.h).

namespace {

// The tensors of `argument` that live in `storage`.
template <class Visit>
void forEachTensorIn(const c10::IValue& argument, const c10::StorageImpl* storage, Visit&& visit) {
  forEachTensor(argument, [&](const at::Tensor& tensor) {
    if (tensor.defined() && tensor.has_storage() && tensor.storage().unsafeGetStorageImpl() == storage) visit(tensor);
  });
}

const std::string& writtenArgumentName(const OpEntry& op, uint32_t argument) {
  const auto& indices = op.traits.written_arguments;
  const auto found = std::find(indices.begin(), indices.end(), argument);
  static const std::string unnamed = "an argument";
  if (found == indices.end() || op.traits.written_argument_names.size() != indices.size()) return unnamed;
  return op.traits.written_argument_names[static_cast<size_t>(found - indices.begin())];
}

// Whether `op`'s write of `tensor` replaces its whole storage without reading it: an out=
// argument (every argument an out= op writes is one) that covers its storage, densely.
bool replacesWholeStorage(const OpEntry& op, const at::Tensor& tensor) {
  if (!op.traits.writes_out_arguments || op.traits.mutates_inputs) return false;
  return tensor.storage_offset() == 0 && tensor.is_non_overlapping_and_dense() &&
         static_cast<size_t>(tensor.numel()) * tensor.itemsize() == tensor.storage().nbytes();
}

}  // namespace

void OutsideWrites::noteForward(const DataFlow& flow, const OpEntry& op, const c10::IValue* arguments,
                                const std::vector<WrittenStorage>& written, const std::string& layer) {
  for (const WrittenStorage& write : written) {
    const c10::StorageImpl* storage = write.storage.unsafeGetStorageImpl();
    if (flow.originOf(storage) != 0) continue;  // produced (or written already) in this pass
    int64_t shift = 0;
    const uint64_t name = flow.nameOfInput(storage, &shift);
    auto [it, inserted] = preserved_.try_emplace(name);
    if (!inserted) continue;
    Preserved& preserved = it->second;
    preserved.forward_shift = shift;
    preserved.read_before_write = flow.readAsExternal(storage);
    at::Tensor written_tensor;
    forEachTensorIn(arguments[write.argument], storage, [&](const at::Tensor& tensor) {
      if (!written_tensor.defined()) written_tensor = tensor;
    });
    if (written_tensor.defined() && preservableFromWrites(written_tensor)) {
      preserved.elements = static_cast<int64_t>(written_tensor.storage().nbytes() / written_tensor.itemsize());
      preserved.options = written_tensor.options();
      if (preserved.read_before_write || !replacesWholeStorage(op, written_tensor)) {
        preserved.pristine = copyOfStorage(written_tensor);
      }
      continue;
    }
    preserved.refusal = c10::str(
        "sac: the forward of ", layer, " writes '", writtenArgumentName(op, write.argument), "' of ",
        op.traits.qualified_name,
        ", a tensor the region did not produce (a buffer, a parameter, an input or a global), which the region "
        "cannot copy to keep the recompute from writing it again (a tensor subclass, or a storage that does not "
        "hold a whole number of its elements); the recompute would read and write it as the forward left it. "
        "Make the write outside the checkpointed function, or do not checkpoint ",
        layer);
  }
}

at::Tensor OutsideWrites::redirected(DataFlow& flow, const at::Tensor& tensor, bool writes, uint64_t pass) {
  if (!tensor.defined() || !tensor.has_storage()) return at::Tensor();
  const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (flow.originOf(storage) != 0) return at::Tensor();  // produced in this pass
  int64_t shift = 0;
  auto found = preserved_.find(flow.nameOfInput(storage, &shift));
  if (found == preserved_.end()) return at::Tensor();
  Preserved& preserved = found->second;
  const bool has_copy = preserved.working.defined() && preserved.working_pass == pass;
  if (has_copy && storage == preserved.working.storage().unsafeGetStorageImpl()) return at::Tensor();
  if (!has_copy) {
    if (!writes && !preserved.read_before_write) return at::Tensor();  // read as the recompute finds it
    TORCH_CHECK(preserved.refusal.empty(), preserved.refusal);
    if (preserved.pristine.defined()) {
      preserved.working = copyOfStorage(preserved.pristine);
    } else {
      PluginCallGuard not_the_models;
      preserved.working = at::empty_strided({preserved.elements}, {1}, preserved.options);
    }
    preserved.working_pass = pass;
    flow.nameCopyAs(preserved.working, found->first, preserved.forward_shift);
  }
  return aliasOver(preserved.working, tensor, shift - preserved.forward_shift);
}

bool OutsideWrites::redirect(DataFlow& flow, const OpEntry& op, c10::IValue* arguments, size_t count, uint64_t pass) {
  const auto& written = op.traits.written_arguments;
  bool any_replaced = false;
  for (size_t i = 0; i < count; ++i) {
    c10::IValue& argument = arguments[i];
    const bool writes = std::find(written.begin(), written.end(), static_cast<uint32_t>(i)) != written.end();
    if (argument.isTensor()) {
      at::Tensor replacement = redirected(flow, argument.toTensor(), writes, pass);
      if (replacement.defined()) {
        argument = std::move(replacement);
        any_replaced = true;
      }
    } else if (argument.isTensorList()) {
      c10::List<at::Tensor> list = argument.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor replacement = redirected(flow, list.get(j), writes, pass);
        if (replacement.defined()) {
          list.set(j, std::move(replacement));
          any_replaced = true;
        }
      }
    }
  }
  return any_replaced;
}

int64_t OutsideWrites::preservedBytes() const {
  int64_t bytes = 0;
  for (const auto& [name, preserved] : preserved_) {
    if (preserved.pristine.defined()) bytes += static_cast<int64_t>(preserved.pristine.storage().nbytes());
  }
  return bytes;
}

}  // namespace sac
