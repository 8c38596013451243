#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/site.h"
#include "policy/policy.h"

namespace c10 {
struct FunctionSchema;
}

namespace sac {

// How the plugin receives the ops of its activations (NOTE: [The dispatch key sac_plugin
// intercepts on] and NOTE: [Sharing the key with another owner]).
enum class InterceptionPath : uint8_t {
  kNotInstalled,
  // A backend fallback on the key: the key was free.
  kNative,
  // Per-op kernels on the key, beside another owner's fallback, to which every call that is not
  // ours is handed.
  kCoexisting,
};

// Installs the interception once and returns the path taken: the native fallback when the key
// is free, the coexisting per-op kernels when another library already holds a fallback on it.
InterceptionPath installInterception();

InterceptionPath interceptionPath();
const char* interceptionPathName(InterceptionPath path);

// The storages of the arguments a call writes (in place, as out= arguments, or as NOTE: [Writes
// no schema declares] in ops/op_traits.h names them), noted before the kernel consumes them;
// `arguments` are the call's arguments in schema order.
std::vector<WrittenStorage> writtenStorages(const OpTraits& traits, const c10::IValue* arguments);

// The once-per-site warning for a call the rule recomputes although the policy selected it: a
// mutating op inside a kept unit, or a kept op's call that draws random numbers.
void warnAboutRecomputedSelection(Site& site, const OpEntry& op, const Decision& decision);

// NOTE: [Python below our key (torch 2.11)] in fallback.cpp: whether this torch dispatches the
// plugin's key before `Python`.
bool pythonBelowSacKey();

}  // namespace sac
