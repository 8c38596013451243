#include "dispatch/offloaded_outputs.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dispatch/kept_outputs.h"
#include "dispatch/offload.h"
#include "ops/user_warning.h"
#include "policy/offload_rule.h"

namespace sac {

bool OffloadedOutputs::offload(KeptOutputs& kept, Site& site) {
  const std::string& name = kept.op->traits.qualified_name;
  int64_t bytes = 0;
  bool on_accelerator = false;
  bool copyable = true;
  HashSet<const c10::StorageImpl*> storages;
  for (const c10::IValue& value : kept.outputs) {
    if (value.isTensorList()) {
      copyable = false;
      continue;
    }
    if (!value.isTensor() || !value.toTensor().defined()) continue;
    const at::Tensor& tensor = value.toTensor();
    if (tensor.device().is_cpu()) continue;
    on_accelerator = true;
    if (!offloadable(tensor) || !storages.insert(tensor.storage().unsafeGetStorageImpl()).second) {
      copyable = false;
      continue;
    }
    // As the copies count them, so that what is reserved here is what drop() gives back.
    bytes += sac::offloadedBytes(tensor);
  }
  if (!on_accelerator) {
    if (site.claimNotice(Site::Notice::kRunsOnCpu)) {
      SAC_WARN_USER("sac: ", name,
                    " is offloaded by the policy but runs on the CPU, so its outputs are kept where "
                    "they are, in host memory already; offloading moves outputs off an accelerator (said once per "
                    "checkpoint site)");
    }
    return false;
  }
  if (!copyable) {
    if (site.claimNotice(Site::Notice::kCannotCopy)) {
      SAC_WARN_USER("sac: the outputs of ", name,
                    " cannot be offloaded (a tensor list, a CPU tensor, or outputs "
                    "that overlap or share storage), so they are kept on the device (said once per checkpoint site)");
    }
    return false;
  }
  const Policy& policy = site.policy();
  // NOTE: [Where an offloaded call's outputs live] (policy/offload_rule.cpp): the floor here, the
  // host cap in the pool, which counts what it holds.
  if (offloadPlacement(bytes, 0, policy.offloadMinBytes(), -1) == OffloadPlacement::kDeviceBelowFloor) return false;
  // One pinned buffer per output, all or none: a refused one leaves every output on the device.
  std::vector<c10::Storage> buffers;
  for (const c10::IValue& value : kept.outputs) {
    if (!value.isTensor() || !value.toTensor().defined() || value.toTensor().device().is_cpu()) continue;
    c10::Storage buffer = takePinnedBuffer(sac::offloadedBytes(value.toTensor()), policy.hostMemoryLimit());
    if (!buffer) {
      for (c10::Storage& taken : buffers) returnPinnedBuffer(std::move(taken));
      if (site.claimNotice(Site::Notice::kHostLimitReached)) {
        SAC_WARN_USER("sac: the policy's host_memory_limit of ", policy.hostMemoryLimit(),
                      " bytes is reached: the "
                      "offload pool cannot hold the outputs of ",
                      name,
                      " as well, so they and later offloaded outputs "
                      "that do not fit are kept on the device (said once per checkpoint site)");
      }
      return false;
    }
    buffers.push_back(std::move(buffer));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  size_t next_buffer = 0;
  c10::SmallVector<int64_t, 1> versions;
  size_t version = 0;
  for (size_t slot = 0; slot < kept.outputs.size(); ++slot) {
    c10::IValue& value = kept.outputs[slot];
    if (!value.isTensor()) continue;  // a list was ruled out above; other values carry no version
    const at::Tensor tensor = value.toTensor();
    const int64_t saved_version = kept.versions[version++];
    if (!tensor.defined() || tensor.device().is_cpu()) {
      versions.push_back(saved_version);
      continue;
    }
    kept.offloaded_storages.push_back(tensor.storage().getWeakStorageImpl());
    OffloadedTensor offloaded = OffloadedTensor::start(tensor, std::move(buffers[next_buffer++]));
    offloaded.setSavedVersion(saved_version);
    kept.offloaded.emplace_back(slot, std::move(offloaded));
    value = c10::IValue();
  }
  kept.versions = std::move(versions);
  bytes_ += bytes;
  return true;
}

// NOTE: [Offloading kept outputs] (offload.cpp): checked before the host copy is used.
void OffloadedOutputs::take(KeptOutputs& kept, bool keep_host, c10::SmallVectorImpl<c10::IValue>& values) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [slot, offloaded] : kept.offloaded) {
    checkServedVersion(kept, offloaded.savedVersion(), offloaded.currentVersion());
  }
  values = kept.outputs;
  for (auto& [slot, offloaded] : kept.offloaded) values[slot] = offloaded.take(keep_host);
}

void OffloadedOutputs::drop(KeptOutputs& kept) {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t bytes = 0;
  for (auto& [slot, offloaded] : kept.offloaded) bytes += offloaded.bytes();
  kept.offloaded.clear();  // each returns its host buffer to the pool
  kept.offloaded_storages.clear();
  bytes_ -= bytes;
}

void OffloadedOutputs::detachBeforeWrite(c10::ArrayRef<std::pair<KeptOutputs*, size_t>> outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [kept, index] : outputs) kept->offloaded[index].second.detachBeforeWrite();
}

void OffloadedOutputs::fetch(HashMap<uint64_t, KeptOutputs>& entries, HeldInputs& inputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The inputs first: the recompute reads them before any kept output.
  inputs.fetch();
  // Then in the order the forward made them, which the recompute reads them in: the copy stream
  // runs them one after another, so a copy queued early that is needed late delays every one
  // after it (the planner's copy model assumes this order: NOTE: [The copy queues] in
  // sac_plugin/planner/_cost.py).
  std::vector<KeptOutputs*> in_forward_order;
  for (auto& [call, kept] : entries) {
    if (!kept.offloaded.empty()) in_forward_order.push_back(&kept);
  }
  std::sort(in_forward_order.begin(), in_forward_order.end(),
            [](const KeptOutputs* a, const KeptOutputs* b) { return a->position < b->position; });
  for (KeptOutputs* kept : in_forward_order) {
    for (auto& [slot, offloaded] : kept->offloaded) offloaded.fetch();
  }
}

int64_t OffloadedOutputs::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_;
}

int64_t OffloadedOutputs::calls(const HashMap<uint64_t, KeptOutputs>& entries) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t calls = 0;
  for (const auto& [key, kept] : entries) calls += kept.offloaded.empty() ? 0 : 1;
  return calls;
}

}  // namespace sac
