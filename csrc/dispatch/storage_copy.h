#pragma once
// Copies of whole storages that the region makes below every mode, and views over them: how a
// region keeps a value from before a write (NOTE: [Kept outputs written in the forward] in
// region.cpp, NOTE: [The recompute writes nothing outside its region] in outside_writes.cpp).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>

#include <cstdint>

#include "dispatch/sac_key.h"

namespace sac {

// Whether a write in the forward can be kept from a kept output by holding a copy of its
// storage: a plain tensor (no subclass) whose storage holds a whole number of its elements (NOTE:
// [Kept outputs written in the forward] in region.cpp). The call profile asks it too, so a plan
// offers what is preserved.
inline bool preservableFromWrites(const at::Tensor& tensor) {
  return tensor.defined() && tensor.has_storage() && !tensor.key_set().has(c10::DispatchKey::Python) &&
         tensor.storage().nbytes() % tensor.itemsize() == 0;
}

// A 1-D copy of the whole storage `tensor` lives in, made below every mode.
inline at::Tensor copyOfStorage(const at::Tensor& tensor) {
  PluginCallGuard not_the_models;
  const auto elements = static_cast<int64_t>(tensor.storage().nbytes() / tensor.itemsize());
  at::Tensor copy = at::empty_strided({elements}, {1}, tensor.options());
  copy.copy_(tensor.as_strided({elements}, {1}, 0));
  return copy;
}

// `like`'s view of its storage, over `storage_copy` instead, `offset_shift` elements further in.
inline at::Tensor viewOver(const at::Tensor& storage_copy, const at::Tensor& like, int64_t offset_shift = 0) {
  PluginCallGuard not_the_models;
  return storage_copy.as_strided(like.sizes(), like.strides(), like.storage_offset() + offset_shift);
}

}  // namespace sac
