#pragma once

namespace sac {

// Registers the plugin's boxed fallback on its key (NOTE: [The dispatch key sac_plugin
// intercepts on]). Idempotent. Throws c10::Error, registering nothing, when another library
// already holds a fallback on that key.
void installFallback();

bool fallbackInstalled();

}  // namespace sac
