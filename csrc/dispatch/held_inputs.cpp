#include "dispatch/held_inputs.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <utility>

#include "dispatch/ivalue_tensors.h"

namespace sac {

// NOTE: [Offloading a layer's inputs] (offload.cpp)
std::vector<bool> HeldInputs::hold(const std::vector<at::Tensor>& inputs, const std::vector<std::string>& names,
                                   const DataFlow& flow, Site& site, std::string* notice) {
  TORCH_CHECK_VALUE(inputs.size() == names.size(), "sac: holding a region's inputs needs one name per input, got ",
                    inputs.size(), " inputs and ", names.size(), " names");
  TORCH_CHECK(!holds_ && !consumed_,
              "sac: a region holds its function's inputs once, at the end of "
              "its forward; this region holds them already");
  const Policy& policy = site.policy();
  std::vector<bool> offloaded(inputs.size(), false);
  std::lock_guard<std::mutex> lock(mutex_);
  inputs_.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& tensor = inputs[i];
    HeldInput held;
    held.name = names[i];
    held.saved_version = versionOf(tensor);
    if (tensor.defined() && tensor.has_storage()) {
      held.original_name = flow.nameOfInput(tensor.storage().unsafeGetStorageImpl());
      held.original_offset = tensor.storage_offset();
    }
    if (offloadable(tensor)) {
      c10::Storage buffer = takePinnedBuffer(sac::offloadedBytes(tensor), policy.hostMemoryLimit());
      if (buffer) {
        held.offloaded = OffloadedTensor::start(tensor, std::move(buffer));
        held.offloaded.setSavedVersion(held.saved_version);
        held.is_offloaded = true;
        offloaded_bytes_ += held.offloaded.bytes();
        ++offloaded_count_;
        offloaded[i] = true;
      } else if (notice != nullptr && notice->empty() && site.claimNotice(Site::Notice::kHostLimitReached)) {
        *notice = c10::str("sac: the policy's host_memory_limit of ", policy.hostMemoryLimit(),
                           " bytes is reached: "
                           "the offload pool cannot hold ",
                           held.name,
                           " as well, so it and later offloaded tensors "
                           "that do not fit are kept on the device (said once per checkpoint site)");
      }
    }
    if (!held.is_offloaded) held.on_device = detachedAlias(tensor);
    inputs_.push_back(std::move(held));
  }
  holds_ = true;
  return offloaded;
}

std::vector<at::Tensor> HeldInputs::take(DataFlow& flow, bool keep) {
  TORCH_CHECK(!consumed_,
              "sac: the inputs this region held for its recompute were already used by an earlier "
              "backward and freed. Trying to backward an extra time: a checkpointed region supports a second "
              "backward only when the first runs with retain_graph=True");
  TORCH_CHECK(holds_, "sac: the recompute of a region asked for inputs its forward did not hold");
  std::lock_guard<std::mutex> lock(mutex_);
  // Checked before any host copy is used (NOTE: [Offloading kept outputs]): a write may have raced it.
  for (const HeldInput& input : inputs_) {
    const int64_t saved = input.is_offloaded ? input.offloaded.savedVersion() : input.saved_version;
    const int64_t now = input.is_offloaded ? input.offloaded.currentVersion() : versionOf(input.on_device);
    TORCH_CHECK(saved == now, "sac: an input of a checkpointed region was mutated after its forward: ", input.name,
                input.is_offloaded ? " (offloaded for the recompute)" : " (held for the recompute)",
                " changed version from ", saved, " to ", now,
                ". The recompute would read the mutated value; clone "
                "it before mutating it in place");
  }
  std::vector<at::Tensor> tensors;
  tensors.reserve(inputs_.size());
  for (HeldInput& input : inputs_) {
    tensors.push_back(input.is_offloaded ? input.offloaded.take(keep) : input.on_device);
    // NOTE: [A copy the region makes is named as its original] (data_flow.cpp); an input held on
    // its device is named as the forward named it too (the region around this one may have named
    // it: NOTE: [A nested checkpoint names its inputs as the outer does]).
    if (input.original_name != 0) flow.nameCopyAs(tensors.back(), input.original_name, input.original_offset);
  }
  if (!keep) {
    inputs_.clear();
    offloaded_bytes_ = 0;
    offloaded_count_ = 0;
    consumed_ = true;
  }
  return tensors;
}

void HeldInputs::fetch() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (HeldInput& input : inputs_) {
    if (input.is_offloaded) input.offloaded.fetch();
  }
}

void HeldInputs::drop(bool consumed) {
  consumed_ = consumed_ || consumed;
  if (inputs_.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  inputs_.clear();  // each offloaded input returns its host buffer to the pool
  offloaded_bytes_ = 0;
  offloaded_count_ = 0;
}

int64_t HeldInputs::offloadedBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return offloaded_bytes_;
}

int64_t HeldInputs::offloadedCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return offloaded_count_;
}

}  // namespace sac
