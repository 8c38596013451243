#pragma once
// The inputs a region holds for its recompute (NOTE: [Offloading a layer's inputs] in
// offload.cpp): each offloaded to pinned host memory when it can be, else held on its device. One
// part of a Region, with one job.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dispatch/data_flow.h"
#include "dispatch/offload.h"
#include "dispatch/site.h"

namespace sac {

class HeldInputs {
 public:
  // Forward, at the end of the region's function: holds `inputs`, named by `names` for messages,
  // as `flow` (the forward's) names them. Returns, per input, whether it was offloaded; `notice`,
  // when given, receives the warning that the host limit is reached (said once per site).
  std::vector<bool> hold(const std::vector<at::Tensor>& inputs, const std::vector<std::string>& names,
                         const DataFlow& flow, Site& site, std::string* notice);
  // Recompute: the held inputs on their devices, in the order hold took them, each named in
  // `flow` as the forward named the original; raises, naming the input, when one was written in
  // place after the forward. `keep` (a backward that keeps its graph) leaves them for the next.
  std::vector<at::Tensor> take(DataFlow& flow, bool keep);
  // Starts copying the offloaded inputs back to their devices.
  void fetch();
  // Frees them (their host buffers back to the pool); `consumed`: no recompute may take them.
  void drop(bool consumed);

  bool any() const { return holds_ && !inputs_.empty(); }
  bool anyOffloaded() const { return offloaded_count_ > 0; }
  // Pinned host bytes the offloaded inputs hold, and how many inputs are offloaded.
  int64_t offloadedBytes() const;
  int64_t offloadedCount() const;

 private:
  struct HeldInput {
    std::string name;
    at::Tensor on_device;
    OffloadedTensor offloaded;
    int64_t saved_version = -1;  // for the held alias; the offloaded tensor keeps its own
    bool is_offloaded = false;
    // What the forward named the input's storage and where in it the input lived, for naming its
    // copy as the input (NOTE: [A copy the region makes is named as its original] in
    // data_flow.cpp).
    uint64_t original_name = 0;
    int64_t original_offset = 0;
  };
  // Guards the copies, which the recompute of another region may start (fetch) while this one's
  // region is idle.
  mutable std::mutex mutex_;
  std::vector<HeldInput> inputs_;
  int64_t offloaded_bytes_ = 0;
  int64_t offloaded_count_ = 0;
  bool holds_ = false;
  bool consumed_ = false;
};

}  // namespace sac
