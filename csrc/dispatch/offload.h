#pragma once
// Offloaded outputs: a kept output held in pinned host memory between the forward and the
// backward, copied out on a side stream after the call and back ahead of its use (NOTE:
// [Offloading kept outputs] in offload.cpp). Device-generic: streams, events and the pinned
// allocator come from the device's registered guard and hooks (CUDA, the test accelerator, any
// PrivateUse1 backend).

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <memory>

namespace sac {

// Whether `tensor` can be offloaded: defined, on an accelerator (not the CPU, not meta), with
// storage, non-overlapping and dense, and not an inference tensor (which has no version to check).
bool offloadable(const at::Tensor& tensor);
// The pinned host bytes an offloaded copy of `tensor` takes (its sizes and strides, from offset 0):
// what a policy's host_memory_limit counts and what the copies move.
int64_t offloadedBytes(const at::Tensor& tensor);

// A pinned host buffer of at least `nbytes` from the pool (NOTE: [A bounded pinned pool] in
// offload.cpp), or an undefined storage when the pool's pinned bytes, in use and cached, would
// pass `limit` (-1: none) even after its idle buffers are freed. returnPinnedBuffer gives back a
// buffer that was never used.
c10::Storage takePinnedBuffer(int64_t nbytes, int64_t limit);
void returnPinnedBuffer(c10::Storage buffer);

// One offloaded tensor. Movable, not copyable; its host buffer returns to the pinned pool when it
// is taken for good, released, or destroyed, after the copies that use it.
class OffloadedTensor {
 public:
  // Starts copying `tensor` into `buffer` (takePinnedBuffer, at least offloadedBytes(tensor)) on
  // the device's copy-out stream, after the work queued so far on the device's current stream;
  // the device memory is freed by its owner when the copy completes (recorded on the copy
  // stream), with no host sync. The buffer returns to the pool when this is released.
  static OffloadedTensor start(const at::Tensor& tensor, c10::Storage buffer);

  OffloadedTensor() = default;
  OffloadedTensor(OffloadedTensor&& other) noexcept = default;
  OffloadedTensor& operator=(OffloadedTensor&& other) noexcept;
  OffloadedTensor(const OffloadedTensor&) = delete;
  OffloadedTensor& operator=(const OffloadedTensor&) = delete;
  ~OffloadedTensor() { release(); }

  // Starts the copy back to the device on its copy-in stream, unless started (a prefetch).
  void fetch();
  // The tensor on its device, ready for the current stream (which waits only on this copy).
  // `keep_host`: the host copy stays for another backward (retain_graph=True); otherwise it
  // returns to the pool.
  at::Tensor take(bool keep_host);
  // Returns the host buffer to the pool and drops any device copy.
  void release();
  // The forward is about to write the tensor this copies: the current stream waits until the
  // copy out is done, so the host holds the value from before the write, and the version check
  // stops following the forward's tensor (NOTE: [Kept outputs written in the forward] in
  // preserved_writes.cpp).
  void detachBeforeWrite();

  bool holdsHost() const { return host_.defined(); }
  int64_t bytes() const { return bytes_; }
  // The version of the offloaded tensor's version counter now, as the forward's tensor sees it.
  int64_t currentVersion() const { return static_cast<int64_t>(version_counter_.current_version()); }
  int64_t savedVersion() const { return saved_version_; }
  void setSavedVersion(int64_t version) { saved_version_ = version; }

 private:
  at::Tensor host_;         // pinned, the tensor's sizes and strides
  at::Tensor device_copy_;  // after fetch()
  std::shared_ptr<c10::Event> copied_out_;
  std::shared_ptr<c10::Event> copied_in_;
  c10::Device device_{c10::kCPU};
  c10::VariableVersion version_counter_;
  int64_t saved_version_ = 0;
  int64_t bytes_ = 0;
};

// What offloading has done in this process: copies each way and their bytes, the pinned pool
// (bytes it holds, in use and cached, buffers it allocated and trimmed), and the exposed copy time.
// Counters only grow, except the pool's bytes.
struct OffloadStats {
  int64_t copies_to_host = 0;
  int64_t bytes_to_host = 0;
  int64_t copies_to_device = 0;
  int64_t bytes_to_device = 0;
  int64_t pool_bytes = 0;  // pinned bytes the pool holds: in use plus cached
  int64_t pool_bytes_in_use = 0;
  int64_t pool_bytes_cached = 0;  // idle, ready for reuse
  int64_t pool_allocations = 0;
  int64_t pool_trims = 0;  // idle buffers freed, to stay within a limit or by emptyOffloadPool
  int64_t pool_bytes_trimmed = 0;
  // Microseconds the compute streams waited for copies back, over the serves whose events have
  // completed (NOTE: [Offloading kept outputs]).
  int64_t exposed_copy_us = 0;
};
OffloadStats offloadStats();
// Frees the pool's buffers that no copy uses any more; returns the bytes freed.
int64_t emptyOffloadPool();

}  // namespace sac
