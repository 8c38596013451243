// The dispatch-mode engine's ops (dispatch/mode_engine.h), as python/sac_plugin/_mode_calls.py
// hands them calls: torch.ops.sac.mode_*. They take tensors, so they are dispatcher ops; the mode
// region and the op they act on cross as handles (NOTE: [A handle that comes back is checked] in
// dispatch/handed_out.h), made by sac_plugin._C (Site.new_mode_region, Region.mode_region_over)
// and mode_op. Registrations only.

#include <torch/library.h>

#include "dispatch/mode_engine.h"

TORCH_LIBRARY_FRAGMENT(sac, m) {
  m.def("mode_op(str name, str overload) -> int", &sac::modeOpHandle);
  m.def("mode_region_release(int region) -> ()", &sac::releaseModeRegion);
  m.def("mode_region_pass(int region, int which) -> str", &sac::modeRegionPass);
  // NOTE: [Kept outputs the recompute never reaches] (dispatch/kept_outputs.cpp), as _C's Region has
  // them for a native region.
  m.def("mode_region_forward_position(int region) -> int",
        [](int64_t region) { return sac::modeRegionRegion(region).forwardPosition(); });
  m.def("mode_region_release_unreached(int region, int last_saved_position) -> int",
        [](int64_t region, int64_t last_saved_position) {
          return sac::modeRegionRegion(region).releaseUnreached(last_saved_position);
        });
  m.def("mode_region_kept_calls(int region) -> int",
        [](int64_t region) { return sac::modeRegionRegion(region).keptCalls(); });
  m.def("mode_region_kept_bytes(int region) -> int",
        [](int64_t region) { return sac::modeRegionRegion(region).keptBytes(); });
  m.def(
      "mode_call_begin(int region, int op, int key, Tensor?[] tensors, int[] positions, bool draws_random) -> "
      "(int, int, Tensor?[], int[])",
      &sac::modeCallBegin);
  m.def(
      "mode_call_begin_all(int region, int op, Tensor?[] tensors, int[] positions, Any[] others, "
      "int[] other_positions, bool draws_random) -> (int, int, Tensor?[], int[], Any[])",
      torch::CppFunction::makeFromBoxedFunction<&sac::modeCallBeginAll>());
  m.def("mode_call_end(int region, Tensor?[] tensors, int[] positions) -> ()", &sac::modeCallEnd);
}
