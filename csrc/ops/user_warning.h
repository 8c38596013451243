#pragma once
// Warnings addressed to the user of a policy (an op the policy cannot keep as asked).

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>
#include <string>

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

// NOTE: [What the rule recomputes by design is logged, not warned]
// A selected call the rule still recomputes (a random draw, an in-place write inside a kept unit:
// step 5 of NOTE: [The keep rule] in policy/policy.cpp) is how checkpointing works, and nothing the
// user can change: dropout inside an attention unit is ordinary. Warnings are kept for what the
// user can act on, so this is said once per checkpoint site at INFO on the package's logger
// ("sac_plugin"), through the sink the Python bindings install; with no sink (C++ alone) it goes
// nowhere.
using InfoSink = void (*)(const std::string& message);
inline std::atomic<InfoSink> info_sink{nullptr};
inline void setInfoSink(InfoSink sink) { info_sink.store(sink, std::memory_order_release); }
template <typename... Parts>
void logInfo(const Parts&... parts) {
  if (InfoSink sink = info_sink.load(std::memory_order_acquire)) sink(::c10::str(parts...));
}

}  // namespace sac
