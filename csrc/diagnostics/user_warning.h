#pragma once
// Warnings addressed to the user of a policy (an op the policy cannot keep as asked).

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace sac {

// NOTE: [Warnings without build paths]
// TORCH_WARN builds a c10::Warning with verbatim = false, and torch's Python warning handler
// then appends "(Triggered internally at <file>:<line>.)", where <file> is the absolute path of
// the source on the machine that built the plugin: noise to a user, and a leak of the build
// machine's layout. Our warnings are complete sentences about the user's policy, so they are
// issued verbatim (see torch's Note: [Verbatim Warnings]); the source location is still attached
// for C++ warning handlers that want it.
#define SAC_WARN_USER(...)                                                                       \
  ::c10::warn(::c10::Warning(::c10::UserWarning(),                                               \
                             {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},            \
                             ::c10::str(__VA_ARGS__), /*verbatim=*/true))

}  // namespace sac
