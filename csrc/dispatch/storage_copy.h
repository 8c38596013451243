#pragma once
// Copies of whole storages that the region makes below every mode, and tensors over them: how a
// region keeps a value from before a write (NOTE: [Kept outputs written in the forward] in
// preserved_writes.cpp, NOTE: [The recompute writes nothing outside its region] in outside_writes.cpp).

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace sac {

// Whether a write in the forward can be kept from a kept output by holding a copy of its
// storage: a plain tensor (no subclass) whose storage holds a whole number of its elements (NOTE:
// [Kept outputs written in the forward] in preserved_writes.cpp). The call profile asks it too, so a plan
// offers what is preserved.
bool preservableFromWrites(const at::Tensor& tensor);

// A 1-D copy of the whole storage `tensor` lives in, made below every mode.
at::Tensor copyOfStorage(const at::Tensor& tensor);

// A tensor with `like`'s geometry in its storage, over `storage_copy` instead, `offset_shift`
// elements further in. Not an autograd view of the copy: it is served where the model may write
// it in place under grad mode (an all-reduce of a kept output in an autograd.Function that marks
// it dirty), which autograd refuses for a view made below it.
at::Tensor aliasOver(const at::Tensor& storage_copy, const at::Tensor& like, int64_t offset_shift = 0);

}  // namespace sac
