#pragma once
// Which calls decide where a checkpointed region sends its tokens, or read a value back to the
// host: the calls a selective policy serves from the forward so that the recompute routes
// exactly as the forward did and never waits on the device (NOTE: [Routing is served from the
// forward] in policy/policy.cpp).

#include <string_view>

namespace c10 {
struct IValue;
}

namespace sac {

struct OpTraits;

// Whether this call routes tokens or copies a value to the host:
//   - aten::topk, sort, argsort, argmax (every overload): their integer outputs pick the
//     experts and the order of the tokens (topk and sort return their values beside them, which
//     are the forward's as well);
//   - aten::nonzero, nonzero_static, unique_consecutive, unique_dim, unique_dim_consecutive,
//     _unique, _unique2: the token lists and counts built from routing indices (whatever their
//     input: their output's size is read on the host);
//   - aten::_local_scalar_dense (`.item()`, `.tolist()` of a device tensor element by element)
//     and aten::_to_copy from a device onto the CPU (`.tolist()`, `.cpu()`): device->host copies,
//     which block the host until the device catches up.
// `arguments` points at the call's first argument on the dispatcher stack. Null asks about the
// op alone: true for every op above but _to_copy, whose direction is in its arguments.
bool routesTokens(const OpTraits& traits, const c10::IValue* arguments);

// Whether every call of the op with this base name ("aten::topk") routes: the list above but
// _to_copy. classifyOp reads it once into OpTraits::is_routing.
bool isRoutingOp(std::string_view base_name);

}  // namespace sac
