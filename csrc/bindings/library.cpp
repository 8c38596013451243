// The plugin's TORCH_LIBRARY block: torch.ops.sac.*, the stateless calls and those that take
// tensors. Policies, sites, regions and their scopes, the keep rule, call profiles, audits and
// traces are types of the extension module sac_plugin._C (python_module.cpp), which no op hands
// out or takes. The dispatch-mode engine's ops are in mode_engine_ops.cpp.

#include <ATen/core/List.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "dispatch/fallback.h"
#include "dispatch/handed_out.h"
#include "dispatch/offload.h"
#include "dispatch/region_scopes.h"
#include "dispatch/thread_state.h"
#include "ops/op_catalog.h"
#include "ops/op_resolution.h"
#include "ops/op_traits.h"
#include "policy/policy.h"
#include "policy/unit_stack.h"

#ifndef SAC_BUILT_FOR_TORCH
#error "SAC_BUILT_FOR_TORCH must name the torch version this plugin is compiled against"
#endif

namespace sac {
namespace {

std::vector<std::string> openUnits() {
  std::vector<std::string> names;
  for (UnitId unit : UnitStack::current().units()) names.push_back(unitName(unit));
  return names;
}

std::vector<std::string> overloadNames(const std::string& spelling) {
  std::vector<std::string> names;
  for (const c10::OperatorHandle& op : resolveOpSpelling(spelling)) {
    names.push_back(qualifiedOpName(op.schema().name(), op.schema().overload_name()));
  }
  TORCH_CHECK_VALUE(!names.empty(), "sac: ", describeUnknownOp(spelling));
  return names;
}

using OpTraitsTuple = std::tuple<bool, bool, bool, bool, bool, int64_t>;

// The traits the fallback decides with, for Python's policy function under torch.compile, so the
// compiled and the eager selection read one classification.
OpTraitsTuple opTraits(const std::string& spelling) {
  std::vector<c10::OperatorHandle> handles = resolveOpSpelling(spelling);
  TORCH_CHECK_VALUE(handles.size() == 1, "sac: op_traits needs one overload such as 'aten::mm.default', got '",
                    spelling, "' (", handles.size(), " overloads)");
  const OpTraits& traits = lookupOp(handles.front()).traits;
  return {traits.is_collective,  traits.never_counts, traits.is_random,
          traits.mutates_inputs, traits.is_view,      traits.dropout_p_argument};
}

}  // namespace

TORCH_LIBRARY(sac, m) {
  // The tensors a region holds for backward (a report's and memory.kept_tensors' view), by the
  // handle of _C.Region (NOTE: [A handle that comes back is checked] in dispatch/handed_out.h).
  m.def("region_kept_tensors(int region) -> Tensor[]", [](int64_t region) {
    return HandedOut<RegionHandle>::at(region, "region_kept_tensors", "a region (_C.Region.handle)")
        .region->keptTensors();
  });
  m.def("install_fallback() -> str", []() { return std::string(interceptionPathName(installInterception())); });
  m.def("interception_path() -> str", []() { return std::string(interceptionPathName(interceptionPath())); });
  m.def("built_for_torch() -> str", []() { return std::string(SAC_BUILT_FOR_TORCH); });
  m.def("open_units() -> str[]", &openUnits);
  m.def("resolvable_op_names(str[] names) -> str[]", &resolvableOpNames);
  m.def("overloads_of(str spelling) -> str[]", &overloadNames);
  m.def("op_traits(str spelling) -> (bool, bool, bool, bool, bool, int)", &opTraits);
  // NOTE: [Offloading kept outputs] (dispatch/offload.cpp): copies each way with their bytes,
  // the pinned pool's bytes (all, in use, cached), its allocations and trims, and the exposed
  // copy time (us), in the order of sac_plugin.memory.OFFLOAD_STATS.
  m.def("offload_stats() -> int[]", []() {
    OffloadStats stats = offloadStats();
    return std::vector<int64_t>{stats.copies_to_host,     stats.bytes_to_host,    stats.copies_to_device,
                                stats.bytes_to_device,    stats.pool_bytes,       stats.pool_bytes_in_use,
                                stats.pool_bytes_cached,  stats.pool_allocations, stats.pool_trims,
                                stats.pool_bytes_trimmed, stats.exposed_copy_us};
  });
  m.def("empty_offload_pool() -> int", []() { return emptyOffloadPool(); });
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
