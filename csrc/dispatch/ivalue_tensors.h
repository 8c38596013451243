#pragma once
// Op arguments and results hold tensors as a Tensor or a Tensor[] (split, _foreach_*); every
// place that looks at "the tensors of a value" goes through this one visitor.

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
  }
}

}  // namespace sac
