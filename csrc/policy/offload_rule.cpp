#include "policy/offload_rule.h"

namespace sac {

// NOTE: [Where an offloaded call's outputs live]
// An offloaded call's outputs go to pinned host memory unless a copy would not pay or would not
// fit. Under the size floor (offload_min_bytes) the two copies cost more in launch and
// synchronisation than the device bytes they free, so the outputs stay on the device, kept. Past
// the host cap (host_memory_limit, counted over every region that holds the policy's offloads at
// once) the outputs also stay on the device: the cap bounds host memory, never correctness. The
// floor is checked first, so an output too small to offload never takes host room. The runtime
// decides each offloaded call this way as it holds it, and the planner prices a plan's offloads
// with the same function, so a plan offloads exactly what its policy will.
OffloadPlacement offloadPlacement(int64_t bytes, int64_t reserved_host_bytes, int64_t offload_min_bytes,
                                  int64_t host_memory_limit) {
  if (bytes < offload_min_bytes) return OffloadPlacement::kDeviceBelowFloor;
  // Written so that no sum can overflow: reserved + bytes <= limit.
  if (host_memory_limit >= 0 && (bytes > host_memory_limit || reserved_host_bytes > host_memory_limit - bytes)) {
    return OffloadPlacement::kDeviceHostLimit;
  }
  return OffloadPlacement::kHost;
}

const char* offloadPlacementText(OffloadPlacement placement) {
  switch (placement) {
    case OffloadPlacement::kHost:
      return "host";
    case OffloadPlacement::kDeviceBelowFloor:
      return "device: under offload_min_bytes";
    case OffloadPlacement::kDeviceHostLimit:
      return "device: host_memory_limit reached";
  }
  return "unknown";
}

}  // namespace sac
