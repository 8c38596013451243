#include "dispatch/routing_check.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <functional>
#include <sstream>
#include <string_view>

#include "dispatch/sac_key.h"
#include "ops/op_traits.h"

namespace sac {

// NOTE: [Unpinned routing must repeat itself]
// Under pin_routing = false a selective policy recomputes the calls that route tokens (NOTE:
// [Routing is served from the forward] in policy.cpp), and the recompute must route exactly as
// the forward did. Where it does not, torch's checkpoint fails later, on the metadata of tensors
// it knows only by their position, or not at all. So the forward notes what each routing call
// returned, in a form that costs no device sync: the sizes of its outputs (a data-dependent
// size, nonzero's or unique's, is what changes when the token counts change), and the contents
// of what is already on the host (`.tolist()`, `.item()`: the split sizes the experts read; on
// the CPU, every output). The
// recompute compares its own call of the same data-flow identity and stops at the first that
// differs, with the layer, the op and the fix. A reassignment of tokens that leaves every size
// and host value as it was is not seen here: pinning the routing (the default) is what rules
// that out.

namespace {

uint64_t mix(uint64_t seed, uint64_t value) {
  return seed ^ (value + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2));
}

uint64_t hostHash(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (!tensor.defined() || !tensor.device().is_cpu() || !tensor.has_storage()) return 0;
    // NOTE: [The plugin's own calls] in sac_key.h: no region and no user mode sees this copy.
    PluginCallGuard own_call;
    const at::Tensor dense = tensor.contiguous();
    const auto* bytes = static_cast<const char*>(dense.const_data_ptr());
    return std::hash<std::string_view>{}(std::string_view(bytes, dense.numel() * dense.element_size()));
  }
  if (value.isInt()) return std::hash<int64_t>{}(value.toInt());
  if (value.isDouble()) return std::hash<double>{}(value.toDouble());
  if (value.isBool()) return value.toBool() ? 2 : 1;
  return 0;
}

std::string sizesText(const std::vector<std::vector<int64_t>>& sizes) {
  std::ostringstream text;
  for (size_t i = 0; i < sizes.size(); ++i) {
    text << (i == 0 ? "" : " and ") << '[';
    for (size_t j = 0; j < sizes[i].size(); ++j) text << (j == 0 ? "" : ", ") << sizes[i][j];
    text << ']';
  }
  return text.str();
}

const char* ordinalSuffix(uint32_t n) {
  if (n % 100 >= 11 && n % 100 <= 13) return "th";
  return n % 10 == 1 ? "st" : n % 10 == 2 ? "nd" : n % 10 == 3 ? "rd" : "th";
}

}  // namespace

RoutingCheck::Routed RoutingCheck::describe(const torch::jit::Stack& stack, size_t num_returns) {
  Routed routed;
  uint64_t host = 0;
  for (size_t i = stack.size() - num_returns; i < stack.size(); ++i) {
    const c10::IValue& value = stack[i];
    if (value.isTensor() && value.toTensor().defined()) {
      const auto sizes = value.toTensor().sizes();
      routed.sizes.emplace_back(sizes.begin(), sizes.end());
    }
    host = mix(host, hostHash(value));
  }
  routed.host_values = host;
  return routed;
}

void RoutingCheck::note(const OpEntry& op, uint64_t call, const torch::jit::Stack& stack, size_t num_returns) {
  Routed routed = describe(stack, num_returns);
  routed.op = &op;
  routed.ordinal = ++per_op_[&op];
  // Identities are unique within a pass; a repeat (a hash collision) keeps the first.
  if (calls_.try_emplace(call, std::move(routed)).second) ++pending_;
}

bool RoutingCheck::expects(uint64_t call) const {
  auto it = calls_.find(call);
  return it != calls_.end() && !it->second.checked;
}

void RoutingCheck::check(uint64_t call, const torch::jit::Stack& stack, size_t num_returns, const std::string& where) {
  auto it = calls_.find(call);
  if (it == calls_.end() || it->second.checked) return;
  Routed& forward = it->second;
  forward.checked = true;
  --pending_;
  const Routed recomputed = describe(stack, num_returns);
  if (recomputed.sizes == forward.sizes && recomputed.host_values == forward.host_values) return;
  const std::string what = recomputed.sizes != forward.sizes
                               ? "returned " + sizesText(forward.sizes) + " in the forward and " +
                                     sizesText(recomputed.sizes) + " in the recompute"
                               : "returned other values than in the forward";
  TORCH_CHECK(false, "sac_plugin: the recompute of ", where, " routes tokens differently from its forward: the ",
              forward.ordinal, ordinalSuffix(forward.ordinal), " routing call of ", forward.op->traits.qualified_name,
              " ", what,
              ". The policy recomputes the routing (pin_routing=False); leave pin_routing at True so that the "
              "routing is served from the forward, or make the router repeat itself in the recompute");
}

void RoutingCheck::beginRecompute() {
  pending_ = 0;
  for (auto& [call, routed] : calls_) {
    routed.checked = false;
    ++pending_;
  }
}

void RoutingCheck::clear() {
  calls_.clear();
  per_op_.clear();
  pending_ = 0;
}

}  // namespace sac
