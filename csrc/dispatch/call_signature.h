#pragma once
// The signature of one op call: a hash of everything about its arguments except tensor values
// (shapes, dtypes, devices, scalars, int lists). A region numbers a kept op's calls per
// signature, so a call that a framework makes in one pass only (FSDP2's all-gather buffers and
// views, profiler ops) cannot shift which kept output a model's own call of the same op is
// served, unless it also has the very same shapes (see NOTE: [Matching kept calls] in region.cpp).

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>

namespace sac {

uint64_t callSignature(const c10::IValue* arguments, size_t count);

}  // namespace sac
