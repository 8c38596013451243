#include "ops/routing.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <array>
#include <string_view>

#include "ops/op_traits.h"

namespace sac {
namespace {

// Every call of these routes: their outputs are indices, the token lists and counts built from
// them, or a value read back to the host. nonzero and unique are listed whatever their input: over
// routing indices they list an expert's tokens, and over anything their output's size is read on
// the host, which the recompute need not wait for again.
constexpr std::array<std::string_view, 12> kRoutingOps = {"aten::topk",
                                                          "aten::sort",
                                                          "aten::argsort",
                                                          "aten::argmax",
                                                          "aten::nonzero",
                                                          "aten::nonzero_static",
                                                          "aten::unique_consecutive",
                                                          "aten::unique_dim",
                                                          "aten::_unique",
                                                          "aten::_unique2",
                                                          "aten::unique_dim_consecutive",
                                                          "aten::_local_scalar_dense"};

template <size_t N>
bool contains(const std::array<std::string_view, N>& values, std::string_view value) {
  for (std::string_view v : values) {
    if (v == value) return true;
  }
  return false;
}

const at::Tensor* firstTensor(const c10::IValue* arguments) {
  if (!arguments[0].isTensor()) return nullptr;
  const at::Tensor& tensor = arguments[0].toTensor();
  return tensor.defined() ? &tensor : nullptr;
}

// aten::_to_copy(Tensor self, *, ScalarType? dtype, Layout? layout, Device? device, ...): a copy
// whose source is on a device and whose `device` argument is the CPU.
bool copiesToTheHost(const c10::IValue* arguments) {
  const at::Tensor* source = firstTensor(arguments);
  if (source == nullptr || source->device().is_cpu() || source->device().is_meta()) return false;
  const c10::IValue& device = arguments[3];
  return device.isDevice() && device.toDevice().is_cpu();
}

}  // namespace

bool isRoutingOp(std::string_view base_name) { return contains(kRoutingOps, base_name); }

bool routesTokens(const OpTraits& traits, const c10::IValue* arguments) {
  if (traits.is_routing) return true;
  return arguments != nullptr && traits.is_copy_cast && copiesToTheHost(arguments);
}

}  // namespace sac
