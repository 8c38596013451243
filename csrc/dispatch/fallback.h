#pragma once

#include <cstdint>

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

}  // namespace sac
