#include "dispatch/preserved_writes.h"

#include <optional>
#include <utility>
#include <vector>

#include "dispatch/ivalue_tensors.h"
#include "dispatch/sac_key.h"
#include "dispatch/storage_copy.h"

namespace sac {

// NOTE: [Kept outputs written in the forward]
// A kept output that the checkpointed function itself later writes, in place or as an out=
// argument (an in-place activation, a mask added into attention scores, an in-place collective
// on a buffer made inside a kept unit, x.view(...).add_(), torch.sin(y, out=y)), cannot be
// served as it is: the recompute would apply the write a second time to an already-written
// value. torch's SAC raises an error at backward. We preserve the value instead: before the
// writing kernel runs, the region copies the storage (once, made below every mode) and stores
// every kept output living in it as the same view of the copy, so outputs that shared the
// storage still share one; for an offloaded output it makes the compute stream wait until the
// copy to the host is done. The recompute is served the value the call made and applies the
// write again, so a backward that keeps its graph is served views of a copy of the region's
// copy, made once per pass. A write after the forward is another matter: serve() finds it by
// the version counter and raises, naming the op.
// Why preserve rather than recompute: whether the forward writes can depend on whether a
// Python mode is on. F.linear on a 3-D input adds its bias in place into its mm's output only
// without one (torch decomposes it out of place under any dispatch mode), so recomputing written
// outputs would make the native engine recompute an mm that the dispatch-mode engine, a trace
// or a user's FlopCounterMode sees served. Preserved, the same calls are served either way, and
// the copy holds the bytes the mode's out-of-place add holds.
// Outputs that cannot be copied this way (one in a tensor list, outputs of two element types in
// one storage, a tensor subclass) are not: their calls are released and recomputed. Nor is a
// storage a kept view op's output lives in: the view's call did not make it, and the forward
// may fill it by calls its recompute does not make again (FSDP2 all-gathers into the buffer its
// parameter views point into in the forward only), where a copy from before the write would
// serve what was never read; recomputed, the view reads the storage as the recompute finds it.

bool preserveBeforeWrite(const c10::StorageImpl* storage, c10::ArrayRef<uint64_t> calls,
                         HashMap<uint64_t, KeptOutputs>& entries, OffloadedOutputs& offloaded) {
  // All checks first: a refusal changes nothing.
  struct DeviceSlot {
    KeptOutputs* kept;
    size_t slot;
    size_t version;  // index in kept->versions
  };
  std::vector<DeviceSlot> on_device;
  std::optional<caffe2::TypeMeta> element_type;                  // of the device outputs: one copy, one view type
  std::vector<std::pair<KeptOutputs*, size_t>> offloaded_slots;  // index in kept->offloaded
  HashSet<uint64_t> seen;
  auto in_storage = [storage](const at::Tensor& tensor) {
    return tensor.defined() && tensor.has_storage() && tensor.storage().unsafeGetStorageImpl() == storage;
  };
  for (uint64_t call : calls) {
    if (!seen.insert(call).second) continue;  // one entry per output in the storage
    KeptOutputs& kept = entries.at(call);
    if (kept.op->traits.is_view) return false;
    size_t version = 0;
    for (size_t slot = 0; slot < kept.outputs.size(); ++slot) {
      const c10::IValue& value = kept.outputs[slot];
      if (value.isTensorList()) {
        bool listed = false;
        forEachTensor(value, [&](const at::Tensor& tensor) {
          listed = listed || in_storage(tensor);
          ++version;  // one stored version per tensor
        });
        if (listed) return false;
        continue;
      }
      if (!value.isTensor()) continue;
      const at::Tensor& tensor = value.toTensor();
      if (in_storage(tensor)) {
        if (!preservableFromWrites(tensor) || element_type.value_or(tensor.dtype()) != tensor.dtype()) return false;
        element_type = tensor.dtype();
        on_device.push_back({&kept, slot, version});
      }
      ++version;
    }
    for (size_t i = 0; i < kept.offloaded_storages.size(); ++i) {
      if (kept.offloaded_storages[i]._unsafe_get_target() == storage) offloaded_slots.emplace_back(&kept, i);
    }
  }
  if (on_device.empty() && offloaded_slots.empty()) return false;
  if (!on_device.empty()) {
    auto preserved = std::make_shared<PreservedStorage>();
    preserved->pristine = copyOfStorage(on_device.front().kept->outputs[on_device.front().slot].toTensor());
    for (const DeviceSlot& at : on_device) {
      at::Tensor view = aliasOver(preserved->pristine, at.kept->outputs[at.slot].toTensor());
      at.kept->versions[at.version] = versionOf(view);
      at.kept->outputs[at.slot] = std::move(view);
      at.kept->preserved.emplace_back(at.slot, preserved);
    }
  }
  if (!offloaded_slots.empty()) offloaded.detachBeforeWrite(offloaded_slots);
  return true;
}

const at::Tensor& PreservedStorage::workingFor(uint64_t pass) {
  if (working_pass != pass) {
    PluginCallGuard not_the_models;
    working = pristine.clone();
    working_pass = pass;
  }
  return working;
}

}  // namespace sac
