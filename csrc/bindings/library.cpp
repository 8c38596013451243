// The plugin's TORCH_LIBRARY block: what must be a dispatcher op, torch.ops.sac.*: the calls that
// take or return tensors, and built_for_torch, which the loader asks before it imports anything
// else of a library that may be another build's. Everything else (policies, sites, regions and
// their scopes, the keep rule, call profiles, audits, traces and the stateless queries) is in the
// extension module sac_plugin._C (python_module.cpp), which no op hands out or takes. The
// dispatch-mode engine's ops are in mode_engine_ops.cpp.

#include <ATen/core/List.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "dispatch/handed_out.h"
#include "dispatch/region.h"
#include "dispatch/region_scopes.h"
#include "dispatch/thread_state.h"

#ifndef SAC_BUILT_FOR_TORCH
#error "SAC_BUILT_FOR_TORCH must name the torch version this plugin is compiled against"
#endif

namespace sac {

TORCH_LIBRARY(sac, m) {
  // The tensors a region holds for backward (a report's and memory.kept_tensors' view), by the
  // handle of _C.Region (NOTE: [A handle that comes back is checked] in dispatch/handed_out.h).
  m.def("region_kept_tensors(int region) -> Tensor[]", [](int64_t region) {
    return HandedOut<RegionHandle>::at(region, "region_kept_tensors", "a region (_C.Region.handle)")
        .region->keptTensors();
  });
  m.def("built_for_torch() -> str", []() { return std::string(SAC_BUILT_FOR_TORCH); });
  // NOTE: [Offloading a layer's inputs] (dispatch/offload.cpp): the function a checkpoint runs
  // hands its inputs to the innermost region on this thread at the end of its forward, and takes
  // them back in its recompute.
  // Answers (whether each input was offloaded, a warning for the user or "").
  m.def("region_hold_inputs(Tensor[] inputs, str[] names) -> (bool[], str)",
        [](const std::vector<at::Tensor>& inputs, const std::vector<std::string>& names) {
          ThreadState& state = ThreadState::current();
          TORCH_CHECK(state.region() != nullptr && !state.regionInRecompute(),
                      "sac: region_hold_inputs runs at the end of a checkpointed region's forward, and no region's "
                      "forward is open on this thread");
          std::string notice;
          std::vector<bool> offloaded = state.region()->inputsOwner()->holdInputs(inputs, names, &notice);
          c10::List<bool> answer;
          for (bool each : offloaded) answer.push_back(each);
          return std::make_tuple(answer, notice);
        });
  m.def("region_take_inputs() -> Tensor[]", []() {
    ThreadState& state = ThreadState::current();
    TORCH_CHECK(state.region() != nullptr && state.regionInRecompute(),
                "sac: region_take_inputs runs in a checkpointed region's recompute, and no region's recompute is "
                "open on this thread");
    return state.region()->inputsOwner()->takeInputs();
  });
}

}  // namespace sac
