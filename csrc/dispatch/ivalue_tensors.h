#pragma once
// Op arguments and results hold tensors as a Tensor, a Tensor[] (split, _foreach_*) or a
// Tensor[][] (c10d's allgather_); every place that looks at "the tensors of a value" goes through
// this one visitor. And the one way the plugin holds a tensor without its autograd history.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace sac {

template <typename Visit>
void forEachTensor(const c10::IValue& value, Visit visit) {
  if (value.isTensor()) {
    visit(value.toTensor());
  } else if (value.isTensorList()) {
    // Through the list's IValues, by reference: toTensorList().vec() would copy every tensor,
    // and a copy of a tensor Python holds retains its PyObject, which takes the GIL.
    for (const c10::IValue& element : value.toListRef()) visit(element.toTensor());
  } else if (C10_UNLIKELY(value.isList())) {
    // Tensor[][] (c10d's allgather_ outputs): each element a Tensor[]. Other lists hold no tensor.
    for (const c10::IValue& element : value.toListRef()) {
      if (!element.isTensorList()) return;
      for (const c10::IValue& tensor : element.toListRef()) visit(tensor.toTensor());
    }
  }
}

// NOTE: [Storing kept outputs detached]
// The tensor a kernel returns is the very TensorImpl that the autograd kernel above us will
// attach a grad_fn to once we return. Storing it as is would (a) create a cycle through the
// graph and (b) hand the same TensorImpl back in the recompute, where autograd would overwrite
// the forward tensor's history. tensor_data() makes a shallow copy that shares storage and, on
// purpose, the version counter, so a later in-place write to the forward tensor is visible to
// the version check in serve(). It does not dispatch, so it does not re-enter the fallback.
inline at::Tensor detachedAlias(const at::Tensor& tensor) {
  return tensor.defined() ? at::Tensor(tensor.tensor_data()) : tensor;
}

// A tensor's version counter, or -1 for one that has none (undefined, or made in inference mode).
inline int64_t versionOf(const at::Tensor& tensor) {
  return (tensor.defined() && !tensor.is_inference()) ? static_cast<int64_t>(tensor._version()) : -1;
}

}  // namespace sac
