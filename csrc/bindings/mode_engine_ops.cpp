// The dispatch-mode engine's ops (dispatch/mode_engine.h), as python/sac_plugin/_mode_calls.py
// hands them calls: torch.ops.sac.mode_*. Registrations only.

#include <torch/library.h>

#include "dispatch/handed_out.h"
#include "dispatch/mode_engine.h"
#include "dispatch/region_scopes.h"

namespace sac {
namespace {

// NOTE: [An address that comes back is checked] (dispatch/handed_out.h)
RegionHandle& regionHandleAt(int64_t address, const char* what) {
  return HandedOut<RegionHandle>::at(address, what, "a region (sac_region_new)");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sac, m) {
  m.def("mode_op(str name, str overload) -> int", &modeOpAddress);
  // A mode region (NOTE: [The dispatch-mode engine's region]) of the checkpoint site at
  // `site_address` (the C ABI's sac_site_new), bound to the marker region at `marker_address`
  // (the RegionHandle the scope C ABI created). Owned by the caller: mode_region_release frees it.
  m.def("mode_region_new(int site_address, int marker_address) -> int",
        [](int64_t site_address, int64_t marker_address) {
          const auto& site =
              HandedOut<std::shared_ptr<Site>>::at(site_address, "mode_region_new", "a checkpoint site (sac_site_new)");
          return newModeRegion(site, regionHandleAt(marker_address, "mode_region_new").region);
        });
  // A mode region over the native region at `region_address` (a RegionHandle from the scope C
  // ABI) in its recompute, bound to the marker region at `marker_address` (NOTE: [Modes above
  // the key see only what ran]); 0 for a region that intercepts nothing.
  m.def("mode_region_over(int region_address, int marker_address) -> int",
        [](int64_t region_address, int64_t marker_address) {
          return modeRegionOver(regionHandleAt(region_address, "mode_region_over").region,
                                regionHandleAt(marker_address, "mode_region_over").region);
        });
  m.def("mode_region_release(int address) -> ()", &releaseModeRegion);
  m.def("mode_region_pass(int address, int which) -> str", &modeRegionPass);
  // NOTE: [Kept outputs the recompute never reaches] (dispatch/region.cpp), as the C ABI's
  // sac_region_forward_position and sac_region_release_unreached for a native region.
  m.def("mode_region_forward_position(int address) -> int",
        [](int64_t address) { return modeRegionRegion(address).forwardPosition(); });
  m.def("mode_region_release_unreached(int address, int last_saved_position) -> int",
        [](int64_t address, int64_t last_saved_position) {
          return modeRegionRegion(address).releaseUnreached(last_saved_position);
        });
  m.def("mode_region_kept_calls(int address) -> int",
        [](int64_t address) { return modeRegionRegion(address).keptCalls(); });
  m.def("mode_region_kept_bytes(int address) -> int",
        [](int64_t address) { return modeRegionRegion(address).keptBytes(); });
  m.def(
      "mode_call_begin(int region, int op, int key, Tensor?[] tensors, int[] positions, bool draws_random) -> "
      "(int, int, Tensor?[], int[])",
      &modeCallBegin);
  m.def(
      "mode_call_begin_all(int region, int op, Tensor?[] tensors, int[] positions, Any[] others, "
      "int[] other_positions, bool draws_random) -> (int, int, Tensor?[], int[], Any[])",
      torch::CppFunction::makeFromBoxedFunction<&modeCallBeginAll>());
  m.def("mode_call_end(int region, Tensor?[] tensors, int[] positions) -> ()", &modeCallEnd);
}

}  // namespace sac
