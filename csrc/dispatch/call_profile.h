#pragma once
// A profile of a checkpointed layer's forward: every call the fallback sees in a profiling
// region, with its op, its index among the region's calls of that op (counted exactly as
// kept-call and every-nth rules count them), its innermost unit, the bytes of the storages it
// creates, whether a policy could keep it, and its kernel time, the median over the profile's
// runs. A memory-budget plan (python/sac_plugin/planner) chooses the calls to keep from it.
// NOTE: [Profiling a region] in call_profile.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "policy/policy.h"
#include "policy/unit_stack.h"

namespace sac {

struct OpEntry;
class Region;

struct ProfiledCall {
  const OpEntry* op = nullptr;
  uint64_t index = 0;        // among the run's calls of `op`
  UnitId unit = UINT32_MAX;  // innermost open unit, or UINT32_MAX (kNoUnit)
  // Bytes of the unique storages among the outputs that are new: an output whose storage is an
  // input's or an earlier output's of the same call counts 0; storages count whole. A storage the
  // layer returns counts 0 too (noteLayerOutputs): it stays alive after the region anyway, so
  // keeping it holds nothing more, unless the forward writes it later, when a kept call holds
  // a copy of its own.
  int64_t output_bytes = 0;
  bool written_later = false;  // an output the forward writes later: kept, the region holds a copy
  // Why a plan cannot keep the call (whyNotKeepable, "aliases an input", or
  // kWrittenInTheForward), or empty when it can.
  const char* not_keepable = "";
  std::vector<double> seconds;  // one per run
  // The first run's new output storages, by weak reference: a weak reference keeps the
  // StorageImpl's address from being reused by a later storage of the same run, so storages are
  // told apart by address for the whole run.
  std::vector<std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, int64_t>> storages;
};

// NOTE: [Kept outputs written in the forward] (dispatch/preserved_writes.cpp): the runtime recomputes a
// kept call whose output the forward later writes when it cannot hold a copy from before the
// write, so a profile does not offer it.
inline constexpr const char* kWrittenInTheForward = "written later in the forward";

// Why a plan may not keep a call of `op` with these facts, or "" when it may: the keep rule's
// label (reasonText) when a policy naming the call would recompute it, "view" or "out= op" for
// calls that create no storage of their own.
const char* whyNotKeepable(const OpEntry& op, const CallFacts& call);

class CallProfile {
 public:
  // A run is one forward of the layer in a profiling region; calls are matched across runs by
  // position, and every run must make the same calls as the first.
  void beginRun();
  void endRun();

  // From the fallback, for every call in a profiling region: runs the kernel (`run_kernel`),
  // timed, and records the call. `stack` holds the call's arguments on entry and its results on
  // return, as for any boxed kernel.
  void profileCall(Region& region, const OpEntry& op, const c10::FunctionSchema& schema, torch::jit::Stack* stack,
                   c10::function_ref<void()> run_kernel);

  // After the first run's forward: the tensors the layer returned. Their storages stay alive after
  // the region whatever a policy keeps, so the calls that made them hold no extra bytes when kept.
  // The outputs cross from Python as their storages' identities (the StorageImpl's address, which
  // is only compared, never read): a storage the profile did not see is no call's.
  void noteLayerOutputs(const std::vector<uintptr_t>& output_storages);

  // The calls of the first run, each with every run's time.
  std::vector<ProfiledCall> calls() const;
  int64_t runs() const;
  // Calls recorded so far in the open run: Python's saved-tensor hook reads it to find where the
  // recompute of a checkpoint stops (after the last tensor autograd saves).
  int64_t recordedInRun() const;

 private:
  mutable std::mutex mutex_;
  std::vector<ProfiledCall> calls_;
  int64_t runs_ = 0;
  size_t position_ = 0;  // in calls_, during a run after the first
  bool in_run_ = false;
  std::string mismatch_;
  // During the first run: the positions in calls_ of the calls that made each new storage.
  std::unordered_map<const c10::StorageImpl*, std::vector<size_t>> made_by_;
  // During the first run: the new storages a write in the forward can be kept from by a copy
  // (preservableFromWrites, one output in the storage).
  std::unordered_set<const c10::StorageImpl*> preservable_;
};

}  // namespace sac
