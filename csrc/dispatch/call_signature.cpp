#include "dispatch/call_signature.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>

namespace sac {
namespace {

inline void mix(uint64_t& seed, uint64_t value) {
  // boost::hash_combine's mixing, widened to 64 bits.
  seed ^= value + 0x9e3779b97f4a7c15ULL + (seed << 12) + (seed >> 4);
}

void mixTensor(uint64_t& seed, const at::Tensor& tensor) {
  if (!tensor.defined()) {
    mix(seed, 0x7e57);
    return;
  }
  mix(seed, static_cast<uint64_t>(tensor.scalar_type()));
  mix(seed, static_cast<uint64_t>(tensor.device().type()));
  mix(seed, static_cast<uint64_t>(tensor.device().index() + 1));
  mix(seed, static_cast<uint64_t>(tensor.dim()));
  if (tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return;
  for (int64_t size : tensor.sizes()) mix(seed, static_cast<uint64_t>(size));
}

void mixValue(uint64_t& seed, const c10::IValue& value) {
  mix(seed, static_cast<uint64_t>(value.tagKind().size()));
  if (value.isTensor()) {
    mixTensor(seed, value.toTensor());
  } else if (value.isTensorList()) {
    for (const at::Tensor& tensor : value.toTensorList().vec()) mixTensor(seed, tensor);
  } else if (value.isInt()) {
    mix(seed, static_cast<uint64_t>(value.toInt()));
  } else if (value.isDouble()) {
    mix(seed, std::hash<double>{}(value.toDouble()));
  } else if (value.isBool()) {
    mix(seed, value.toBool() ? 2 : 1);
  } else if (value.isIntList()) {
    for (int64_t element : value.toIntVector()) mix(seed, static_cast<uint64_t>(element));
  } else if (value.isString()) {
    mix(seed, std::hash<std::string>{}(value.toStringRef()));
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) mixValue(seed, element);
  }
}

}  // namespace

uint64_t callSignature(const c10::IValue* arguments, size_t count) {
  uint64_t seed = count;
  for (size_t i = 0; i < count; ++i) mixValue(seed, arguments[i]);
  return seed;
}

}  // namespace sac
