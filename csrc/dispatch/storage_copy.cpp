#include "dispatch/storage_copy.h"

#include <ATen/ops/empty_strided.h>

#include "dispatch/sac_key.h"

namespace sac {

bool preservableFromWrites(const at::Tensor& tensor) {
  return tensor.defined() && tensor.has_storage() && !tensor.key_set().has(c10::DispatchKey::Python) &&
         tensor.storage().nbytes() % tensor.itemsize() == 0;
}

at::Tensor copyOfStorage(const at::Tensor& tensor) {
  PluginCallGuard not_the_models;
  const auto elements = static_cast<int64_t>(tensor.storage().nbytes() / tensor.itemsize());
  at::Tensor copy = at::empty_strided({elements}, {1}, tensor.options());
  copy.copy_(tensor.as_strided({elements}, {1}, 0));
  return copy;
}

at::Tensor aliasOver(const at::Tensor& storage_copy, const at::Tensor& like, int64_t offset_shift) {
  // A new TensorImpl over the copy's storage, made without a dispatch: no op to intercept, and on
  // every backend alike.
  at::Tensor alias = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage_copy.storage()),
                                                              storage_copy.key_set(), storage_copy.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                     like.storage_offset() + offset_shift);
  return alias;
}

}  // namespace sac
