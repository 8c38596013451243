#pragma once
// Warnings addressed to the user of a policy (an op the policy cannot keep as asked).

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace sac {

// NOTE: [Warnings without build paths]
// TORCH_WARN builds a c10::Warning with verbatim = false, and torch's Python warning handler
// then appends "(Triggered internally at <file>:<line>.)", where <file> is the path of the
// source on the machine that built the plugin; a verbatim warning with a file is shown by
// Python at that C++ file and line instead. Our warnings are complete sentences about the
// user's policy, so they are issued verbatim and with no file: torch's handler then calls
// PyErr_WarnEx, which attributes the warning to the user's Python line that ran the op and
// honours the user's warning filters.
#define SAC_WARN_USER(...) \
  ::c10::warn(::c10::Warning(::c10::UserWarning(), {__func__, nullptr, 0}, ::c10::str(__VA_ARGS__), /*verbatim=*/true))

}  // namespace sac
