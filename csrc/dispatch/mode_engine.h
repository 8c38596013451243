#pragma once
// The dispatch-mode engine's C++ half: the calls python/sac_plugin/_dispatch_mode.py (and
// _mode_recompute.py, through _mode_calls.py) makes per region and per op (NOTE: [The
// dispatch-mode engine's region] in mode_engine.cpp). The ops that expose them to Python are
// registered in bindings/mode_engine_ops.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dispatch/region.h"
#include "dispatch/site.h"

namespace c10 {
class OperatorHandle;
}

namespace sac {

// What the mode does with a call, as modeCallBegin answers it (Python mirrors the values).
enum ModeAction : int64_t {
  kRunOnly = 0,       // run it; nothing to record (not this region's, a view, nothing left to serve)
  kRunAndRecord = 1,  // run it, then modeCallEnd records its outputs
  kRunAndKeep = 2,    // run it, then modeCallEnd keeps and records its outputs
  kServed = 3,        // served: the outputs come back with the answer, already recorded
  // Added to a run action: the call must run on other tensors than it was given (NOTE: [The
  // recompute writes nothing outside its region] in outside_writes.cpp), which come back with the
  // answer in the order the call's tensors were given.
  kRedirected = 4,
};

// Passes, as ThreadState::enter and exit drive them for an activated region.
enum ModePass : int64_t { kBeginForward = 0, kEndForward = 1, kBeginRecompute = 2, kEndRecompute = 3 };

// Mode regions and ops cross to Python as handles (NOTE: [A handle that comes back is checked] in
// handed_out.h), which every function below that takes one checks first.

// The handle of an op overload's resolved form (Python caches it per overload).
int64_t modeOpHandle(const std::string& name, const std::string& overload);

// A mode region of `site`, bound to `marker`; owned by the caller until releaseModeRegion.
int64_t newModeRegion(std::shared_ptr<Site> site, c10::intrusive_ptr<Region> marker);
// A mode region over `native` in its recompute (NOTE: [Modes above the key see only what ran]);
// 0 for a region that intercepts nothing.
int64_t modeRegionOver(c10::intrusive_ptr<Region> native, c10::intrusive_ptr<Region> marker);
void releaseModeRegion(int64_t handle);
Region& modeRegionRegion(int64_t handle);
// Returns, at the end of a recompute, the warning NOTE: [Served, or named] (kept_outputs.cpp) left for
// the user (empty if none): the caller issues it.
std::string modeRegionPass(int64_t handle, int64_t pass);

// (action, the call's identity, the served tensors, each return's tensor count). The identity
// lets Python store the non-tensor values a kept call returned, and find them when it is served.
using BeginResult = std::tuple<int64_t, int64_t, std::vector<std::optional<at::Tensor>>, std::vector<int64_t>>;

BeginResult modeCallBegin(int64_t region, int64_t op, int64_t key,
                          const std::vector<std::optional<at::Tensor>>& tensors, const std::vector<int64_t>& positions,
                          bool draws_random);
// mode_call_begin_all(int region, int op, Tensor?[] tensors, int[] positions, Any[] others,
// int[] other_positions, bool draws_random) -> (int, int, Tensor?[], int[], Any[]): modeCallBegin
// with every argument, for a region the native fallback named; the last return holds the
// non-tensor values of a served call (None in a tensor's place). Boxed: `others` are of any type.
void modeCallBeginAll(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// After the kernel ran: keeps (when decided) and records the call's outputs, which Python passes
// flattened by return slot, as modeCallBegin takes arguments.
void modeCallEnd(int64_t region, const std::vector<std::optional<at::Tensor>>& tensors,
                 const std::vector<int64_t>& positions);

}  // namespace sac
