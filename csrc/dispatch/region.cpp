#include "dispatch/region.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <optional>

#include "dispatch/thread_state.h"

// Declared here rather than through torch/csrc/autograd/graph_task.h, whose include tree
// would triple this file's build time; both are exported from libtorch_cpu.
namespace torch::autograd {
TORCH_API bool get_current_graph_task_keep_graph();
TORCH_API int get_current_graph_task_id();
}  // namespace torch::autograd

namespace sac {

bool inAutogradGraphTask() { return torch::autograd::get_current_graph_task_id() >= 0; }

bool currentBackwardKeepsGraph() {
  // Outside a graph task (a recompute forced by hand) there is no later backward to serve.
  return inAutogradGraphTask() && torch::autograd::get_current_graph_task_keep_graph();
}

namespace {

// The region on this thread whose forward offloaded something and ended last: the next region
// to offload links to it (Region::offloaded_before_). Weak: it keeps no resource alive.
thread_local std::optional<c10::weak_intrusive_ptr<Region>> last_offloading_region;

std::atomic<int64_t> live_regions{0};

}  // namespace

struct Region::WeakLink {
  c10::weak_intrusive_ptr<Region> region;
};

Region::Region(std::shared_ptr<Site> site) : site_(std::move(site)) {
  TORCH_CHECK(site_ != nullptr, "sac: a region needs a checkpoint site");
  // NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp): a policy that
  // keeps nothing still intercepts a layer that writes outside state, or may.
  intercepts_ = !site_->policy().keepsNothing() || site_->mayWriteOutside();
  live_regions.fetch_add(1, std::memory_order_relaxed);
}

Region::Region(std::shared_ptr<const Policy> policy) : Region(std::make_shared<Site>(std::move(policy))) {}

Region::Region(std::shared_ptr<const Policy> policy, std::shared_ptr<CallProfile> profile)
    : Region(std::make_shared<Site>(std::move(policy))) {
  profile_ = std::move(profile);
  intercepts_ = intercepts_ || profile_ != nullptr;
}

Region::~Region() { releaseHeld(); }

void Region::release_resources() { releaseHeld(); }

// NOTE: [A region owns what it holds]: everything goes at once, whichever way the region dies.
void Region::releaseHeld() {
  if (released_) return;
  released_ = true;
  kept_.releaseAll();
  inputs_.drop(/*consumed=*/false);
  routing_.clear();
  outside_writes_.clear();
  offloaded_before_.reset();
  inputs_owner_.reset();
  enclosing_.reset();
  enclosing_in_recompute_.reset();
  names_for_nested_.clear();
  live_regions.fetch_sub(1, std::memory_order_relaxed);
}

int64_t Region::liveCount() { return live_regions.load(std::memory_order_relaxed); }

// NOTE: [Offloading a layer's inputs] (offload.cpp)
std::vector<bool> Region::holdInputs(const std::vector<at::Tensor>& inputs, const std::vector<std::string>& names,
                                     std::string* notice) {
  // NOTE: [A checkpoint replayed by the recompute around it holds nothing]: nothing recomputes it.
  // Its inputs are answered as offloaded, so that none is named as staying on its device.
  if (replays_only_) {
    TORCH_CHECK_VALUE(inputs.size() == names.size(), "sac: holding a region's inputs needs one name per input, got ",
                      inputs.size(), " inputs and ", names.size(), " names");
    return std::vector<bool>(inputs.size(), true);
  }
  std::vector<bool> offloaded = inputs_.hold(inputs, names, flow_, *site_, notice);
  any_offloaded_ = any_offloaded_ || inputs_.anyOffloaded();
  return offloaded;
}

std::vector<at::Tensor> Region::takeInputs() { return inputs_.take(flow_, !consume_served_); }

c10::intrusive_ptr<Region> Region::inputsOwner() {
  if (inputs_owner_ != nullptr) {
    c10::intrusive_ptr<Region> owner = inputs_owner_->region.lock();
    TORCH_CHECK(owner, "sac: the region that holds this region's inputs is gone");
    return owner;
  }
  return c10::intrusive_ptr<Region>::reclaim_copy(this);
}

Region* Region::decidingRegion() {
  if (inputs_owner_ == nullptr) return this;
  return inputs_owner_->region.lock().get();  // the dispatch-mode engine's region owns it meanwhile
}

void Region::delegateInputsTo(const c10::intrusive_ptr<Region>& owner) {
  if (owner.get() == this) return;
  inputs_owner_ = std::make_unique<WeakLink>(WeakLink{c10::weak_intrusive_ptr<Region>(owner)});
}

int64_t Region::offloadedInputBytes() const { return inputs_.offloadedBytes(); }

int64_t Region::offloadedInputs() const { return inputs_.offloadedCount(); }

// Each pass gets its own salt, so tensors whose origin cannot be named never match across passes.
void Region::beginForward() {
  flow_.reset(++passes_, site_->callsPerPassHint());
  // NOTE: [A nested checkpoint names its inputs as the outer does] (data_flow.cpp)
  enclosing_.reset();
  const ThreadState::EnclosingPass enclosing = ThreadState::current().decidingRegionAround(this);
  // NOTE: [A checkpoint replayed by the recompute around it holds nothing]
  // torch runs a checkpoint nested in another again when the outer one recomputes, as a new
  // checkpoint whose forward only rebuilds what the outer needs; autograd never goes through it,
  // so nothing recomputes it, and what it kept would be held, unserved, until the outer's
  // recomputed tensors die. It decides as a forward does (the data flow names its calls alike)
  // but holds nothing.
  replays_only_ = enclosing.region != nullptr && enclosing.in_recompute;
  if (Region* around = enclosing.region) {
    around->has_nested_regions_ = true;
    enclosing_ = std::make_unique<WeakLink>(
        WeakLink{c10::weak_intrusive_ptr<Region>(c10::intrusive_ptr<Region>::reclaim_copy(around))});
    flow_.nameExternalsAs(&around->flow_, nullptr);
  }
  forward_position_ = 0;
  routing_.clear();
  // NOTE: [The recompute writes nothing outside its region] (outside_writes.cpp)
  outside_writes_.clear();
  flow_.noteExternalReads();
  dead_calls_.beginForward();
}

void Region::watchSaves() {
  if (!policy().keepsNothing() && !replays_only_ && site_->deadCallsPossible()) dead_calls_.track();
}

void Region::endForward() {
  calls_per_pass_ = flow_.callsRecorded();
  site_->noteCallsPerPass(calls_per_pass_);
  site_->noteOutsideWrites(outside_writes_.any());
  if (dead_calls_.tracking()) {
    // NOTE: [The recompute runs only what backward needs] (dead_calls.cpp): a checkpoint nested in
    // this one reads what this one's calls make in calls this region does not see.
    if (has_nested_regions_) dead_calls_.noteWhatItCannotFollow();
    const size_t dead = dead_calls_.endForward([this](uint64_t call) { return kept_.holds(call); });
    site_->noteDeadCalls(dead > 0);
  }
  flow_.reset(++passes_, 0);
  if (any_offloaded_) {
    if (last_offloading_region.has_value()) {
      offloaded_before_ = std::make_unique<WeakLink>(WeakLink{std::move(*last_offloading_region)});
    }
    last_offloading_region.emplace(c10::intrusive_ptr<Region>::reclaim_copy(this));
  }
}

void Region::beginRecompute() {
  flow_.reset(++passes_, calls_per_pass_);
  // NOTE: [A nested checkpoint names its inputs as the outer does] (data_flow.cpp)
  if (has_nested_regions_) flow_.retainNamesForNested();
  enclosing_in_recompute_ = enclosing_ != nullptr ? enclosing_->region.lock() : c10::intrusive_ptr<Region>();
  if (enclosing_in_recompute_) flow_.nameExternalsAs(nullptr, &enclosing_in_recompute_->names_for_nested_);
  consume_served_ = !currentBackwardKeepsGraph();
  kept_.beginRecompute();
  routing_.beginRecompute();
  dead_calls_.beginRecompute();
  if (!any_offloaded_) return;
  // NOTE: [Offloading kept outputs] (offload.cpp): fetch this region's outputs, then the next's.
  fetchOffloaded();
  if (offloaded_before_ != nullptr) {
    c10::intrusive_ptr<Region> next = offloaded_before_->region.lock();
    offloaded_before_.reset();
    if (next) next->fetchOffloaded();
  }
}

void Region::endRecompute(bool keep_entries) {
  if (has_nested_regions_) names_for_nested_ = flow_.takeNamesForNested();
  flow_.reset(++passes_, 0);
  enclosing_in_recompute_.reset();
  dead_calls_.endRecompute();
  if (keep_entries) return;
  // NOTE: [Served, or named] (kept_outputs.cpp)
  std::string notice = kept_.countNeverServed(*site_);
  if (!notice.empty()) never_served_notice_ = std::move(notice);
  if (inputs_.any()) inputs_.drop(/*consumed=*/true);
  kept_.consumeAll();
}

}  // namespace sac
