// The region's offloaded outputs: a Region's member functions for NOTE: [Offloading kept outputs]
// (offload.cpp), apart from keeping and serving (region.cpp).
#include <c10/util/Exception.h>

#include <algorithm>

#include "dispatch/region.h"
#include "ops/hash_containers.h"
#include "ops/user_warning.h"
#include "policy/offload_rule.h"

namespace sac {

void Region::offload(KeptOutputs& kept) {
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
    if (site_->claimNotice(Site::Notice::kRunsOnCpu)) {
      SAC_WARN_USER("sac: ", name,
                    " is offloaded by the policy but runs on the CPU, so its outputs are kept where "
                    "they are, in host memory already; offloading moves outputs off an accelerator (said once per "
                    "checkpoint site)");
    }
    return;
  }
  if (!copyable) {
    if (site_->claimNotice(Site::Notice::kCannotCopy)) {
      SAC_WARN_USER("sac: the outputs of ", name,
                    " cannot be offloaded (a tensor list, a CPU tensor, or outputs "
                    "that overlap or share storage), so they are kept on the device (said once per checkpoint site)");
    }
    return;
  }
  const Policy& policy = site_->policy();
  // NOTE: [Where an offloaded call's outputs live] (policy/offload_rule.cpp): the floor here, the
  // host cap in the pool, which counts what it holds.
  if (offloadPlacement(bytes, 0, policy.offloadMinBytes(), -1) == OffloadPlacement::kDeviceBelowFloor) return;
  // One pinned buffer per output, all or none: a refused one leaves every output on the device.
  std::vector<c10::Storage> buffers;
  for (const c10::IValue& value : kept.outputs) {
    if (!value.isTensor() || !value.toTensor().defined() || value.toTensor().device().is_cpu()) continue;
    c10::Storage buffer = takePinnedBuffer(sac::offloadedBytes(value.toTensor()), policy.hostMemoryLimit());
    if (!buffer) {
      for (c10::Storage& taken : buffers) returnPinnedBuffer(std::move(taken));
      if (site_->claimNotice(Site::Notice::kHostLimitReached)) {
        SAC_WARN_USER("sac: the policy's host_memory_limit of ", policy.hostMemoryLimit(),
                      " bytes is reached: the "
                      "offload pool cannot hold the outputs of ",
                      name,
                      " as well, so they and later offloaded outputs "
                      "that do not fit are kept on the device (said once per checkpoint site)");
      }
      return;
    }
    buffers.push_back(std::move(buffer));
  }
  std::lock_guard<std::mutex> lock(offload_mutex_);
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
  offloaded_bytes_ += bytes;
  any_offloaded_ = true;
}

void Region::drop(KeptOutputs& kept) {
  kept.outputs.clear();
  kept.preserved.clear();
  if (kept.offloaded.empty()) return;
  std::lock_guard<std::mutex> lock(offload_mutex_);
  int64_t bytes = 0;
  for (auto& [slot, offloaded] : kept.offloaded) bytes += offloaded.bytes();
  kept.offloaded.clear();  // each returns its host buffer to the pool
  kept.offloaded_storages.clear();
  offloaded_bytes_ -= bytes;
}

void Region::fetchOffloaded() {
  if (!any_offloaded_) return;
  std::lock_guard<std::mutex> lock(offload_mutex_);
  // The inputs first: the recompute reads them before any kept output.
  inputs_.fetch();
  // Then in the order the forward made them, which the recompute reads them in: the copy stream
  // runs them one after another, so a copy queued early that is needed late delays every one
  // after it (the planner's copy model assumes this order: NOTE: [The copy queues] in
  // sac_plugin/planner/_cost.py).
  std::vector<KeptOutputs*> in_forward_order;
  for (auto& [call, kept] : kept_) {
    if (!kept.offloaded.empty()) in_forward_order.push_back(&kept);
  }
  std::sort(in_forward_order.begin(), in_forward_order.end(),
            [](const KeptOutputs* a, const KeptOutputs* b) { return a->position < b->position; });
  for (KeptOutputs* kept : in_forward_order) {
    for (auto& [slot, offloaded] : kept->offloaded) offloaded.fetch();
  }
}

int64_t Region::offloadedBytes() const {
  std::lock_guard<std::mutex> lock(offload_mutex_);
  return offloaded_bytes_;
}

int64_t Region::offloadedCalls() const {
  std::lock_guard<std::mutex> lock(offload_mutex_);
  int64_t calls = 0;
  for (const auto& [key, kept] : kept_) calls += kept.offloaded.empty() ? 0 : 1;
  return calls;
}

}  // namespace sac
