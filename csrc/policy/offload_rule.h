#pragma once
// Where an offloaded call's outputs live between forward and backward, by their bytes alone: the
// one rule the runtime (dispatch/offloaded_outputs.cpp) applies when it holds an offloaded call and the
// memory-budget planner (python/sac_plugin/planner) asks, through sac_plugin._C, when it prices one.
// NOTE: [Where an offloaded call's outputs live] in offload_rule.cpp.

#include <cstdint>

namespace sac {

enum class OffloadPlacement : uint8_t { kHost = 0, kDeviceBelowFloor = 1, kDeviceHostLimit = 2 };

// `bytes`: the call's output bytes as the offload copies count them; `reserved_host_bytes`: what
// offloaded outputs already hold in host memory under the same limit; `offload_min_bytes`: the
// size floor; `host_memory_limit`: the host cap, -1 for none. kHost when bytes >= the floor and
// reserved + bytes <= the limit.
OffloadPlacement offloadPlacement(int64_t bytes, int64_t reserved_host_bytes, int64_t offload_min_bytes,
                                  int64_t host_memory_limit);

// "host", "device: under offload_min_bytes", "device: host_memory_limit reached".
const char* offloadPlacementText(OffloadPlacement placement);

}  // namespace sac
