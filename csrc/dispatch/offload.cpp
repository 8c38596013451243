#include "dispatch/offload.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "dispatch/sac_key.h"

namespace sac {

// NOTE: [Offloading kept outputs]
// An offloaded call is decided like a kept one (NOTE: [The keep rule] in policy/policy.cpp) and
// served like one; only where its outputs live between the forward and the backward differs.
//   Forward: right after the kernel, an event is recorded on the device's current (compute)
//   stream; the copy-out stream waits on it and copies each output into a pinned host buffer.
//   The region holds no reference to the device tensor: its storage is recorded on the copy-out
//   stream (recordDataPtrOnStream, what Tensor.record_stream does), so the device allocator hands
//   the memory out again only after the copy, and the compute stream never waits on the host.
//   Backward: when a region's recompute begins, it starts copying its offloaded outputs back on
//   the copy-in stream (and those of the region the backward reaches next), into device memory
//   allocated on the compute stream; serving an output makes the compute stream wait on its own
//   copy only. How long it waited (the copy's completion minus the moment the compute stream
//   reached the serve, when positive) is the exposed copy time offloadStats reports, read from
//   timed events once both have completed.
//   Host memory: pinned buffers come from a pool that is reused across steps (pinned allocation
//   costs milliseconds per buffer on CUDA); a buffer returns to it with the event of the last
//   copy that uses it, and is handed out again only once that event has completed.
//   Where an output cannot be offloaded it is kept on its device (Region::keep): the call runs on
//   the CPU (its outputs are in host memory already; said once per policy), its outputs are
//   smaller than the policy's offload_min_bytes (a copy would cost more than it frees), the
//   policy's host_memory_limit is reached (said once), or an output is not a dense tensor of its
//   own (a list, overlapping or aliased outputs).
//   Writes: a write in the forward demotes the call as for kept outputs, its host buffer going
//   back to the pool after the copy in flight; a write after the forward is found by the version
//   counter the offloaded tensor shares with the forward's tensor, and serving raises naming the
//   op, before the host copy, which the write may have raced, is used.
// The copies run with sac's key excluded: they are the plugin's, not calls of the checkpointed
// function, and are neither counted nor decided.

namespace {

std::atomic<int64_t> copies_to_host{0};
std::atomic<int64_t> bytes_to_host{0};
std::atomic<int64_t> copies_to_device{0};
std::atomic<int64_t> bytes_to_device{0};

// The two copy streams of a device, taken once from its stream pool.
struct CopyStreams {
  c10::Stream to_host;
  c10::Stream to_device;
};

const CopyStreams& copyStreams(c10::Device device) {
  static std::mutex mutex;
  static auto* streams = new std::map<std::pair<int, int>, CopyStreams>();
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto found = streams->find(key);
  if (found == streams->end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    c10::Stream to_host = impl.getStreamFromGlobalPool(device, false);
    c10::Stream to_device = impl.getStreamFromGlobalPool(device, false);
    found = streams->emplace(key, CopyStreams{to_host, to_device}).first;
  }
  return found->second;
}

// Pinned host buffers, by capacity; a returned buffer is handed out again once its last copy
// has completed.
class PinnedPool {
 public:
  static PinnedPool& instance() {
    static auto* pool = new PinnedPool();  // leaked: copies may still finish during exit
    return *pool;
  }

  c10::Storage take(size_t nbytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // A buffer up to twice the size will do: steps repeat their shapes, so exact fits are the rule.
      for (auto it = free_.lower_bound(nbytes); it != free_.end() && it->first <= 2 * nbytes + 4096; ++it) {
        if (it->second.last_use != nullptr && !it->second.last_use->query()) continue;
        c10::Storage storage = std::move(it->second.storage);
        free_.erase(it);
        in_use_bytes_ += static_cast<int64_t>(storage.nbytes());
        return storage;
      }
    }
    at::Tensor buffer = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::lock_guard<std::mutex> lock(mutex_);
    ++allocations_;
    bytes_ += static_cast<int64_t>(nbytes);
    in_use_bytes_ += static_cast<int64_t>(nbytes);
    return buffer.storage();
  }

  void give(c10::Storage storage, std::shared_ptr<c10::Event> last_use) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t nbytes = storage.nbytes();
    in_use_bytes_ -= static_cast<int64_t>(nbytes);
    free_.emplace(nbytes, Buffer{std::move(storage), std::move(last_use)});
  }

  int64_t empty() {
    std::vector<c10::Storage> freed;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = free_.begin(); it != free_.end();) {
        if (it->second.last_use != nullptr && !it->second.last_use->query()) {
          ++it;
          continue;
        }
        bytes += static_cast<int64_t>(it->first);
        freed.push_back(std::move(it->second.storage));
        it = free_.erase(it);
      }
      bytes_ -= bytes;
    }
    return bytes;  // `freed` goes out of scope without the lock held
  }

  void stats(OffloadStats* stats) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats->pool_bytes = bytes_;
    stats->pool_bytes_in_use = in_use_bytes_;
    stats->pool_allocations = allocations_;
  }

 private:
  struct Buffer {
    c10::Storage storage;
    std::shared_ptr<c10::Event> last_use;
  };
  std::mutex mutex_;
  std::multimap<size_t, Buffer> free_;
  int64_t bytes_ = 0;
  int64_t in_use_bytes_ = 0;
  int64_t allocations_ = 0;
};

// A tensor with the given geometry over the start of `storage`, without dispatching.
at::Tensor tensorOver(c10::Storage storage, const at::Tensor& like) {
  at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), like.dtype());
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), 0);
  return tensor;
}

// `timed`: an event elapsed times can be read from (CUDA's default events disable timing).
std::shared_ptr<c10::Event> recordedOn(const c10::Stream& stream, bool timed = false) {
  auto event = std::make_shared<c10::Event>(
      stream.device_type(), timed ? c10::EventFlag::BACKEND_DEFAULT : c10::EventFlag::PYTORCH_DEFAULT);
  event->record(stream);
  return event;
}

// Exposed copy time: for each served offloaded output, the time from the compute stream reaching
// the serve to its copy back completing, when positive (the compute stream waited that long).
// Read from the two events once both have completed, never by waiting on them; the pairs not yet
// settled are bounded, the oldest dropped uncounted past the bound.
class ExposedCopyTime {
 public:
  static ExposedCopyTime& instance() {
    static auto* time = new ExposedCopyTime();
    return *time;
  }

  void note(std::shared_ptr<c10::Event> compute_reached, std::shared_ptr<c10::Event> copied_in) {
    std::lock_guard<std::mutex> lock(mutex_);
    settle();
    if (pending_.size() >= kMaxPending) pending_.erase(pending_.begin());
    pending_.push_back({std::move(compute_reached), std::move(copied_in)});
  }

  int64_t microseconds() {
    std::lock_guard<std::mutex> lock(mutex_);
    settle();
    return static_cast<int64_t>(exposed_ms_ * 1000.0);
  }

 private:
  static constexpr size_t kMaxPending = 1 << 16;
  struct Wait {
    std::shared_ptr<c10::Event> compute_reached;
    std::shared_ptr<c10::Event> copied_in;
  };

  void settle() {
    size_t kept = 0;
    for (Wait& wait : pending_) {
      if (wait.compute_reached->query() && wait.copied_in->query()) {
        exposed_ms_ += std::max(0.0, wait.compute_reached->elapsedTime(*wait.copied_in));
      } else {
        pending_[kept++] = std::move(wait);
      }
    }
    pending_.resize(kept);
  }

  std::mutex mutex_;
  std::vector<Wait> pending_;
  double exposed_ms_ = 0;
};

}  // namespace

bool offloadable(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage() || tensor.is_inference()) return false;
  const c10::DeviceType type = tensor.device().type();
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta || !c10::impl::hasDeviceGuardImpl(type)) {
    return false;
  }
  return tensor.is_non_overlapping_and_dense();
}

int64_t offloadedBytes(const at::Tensor& tensor) {
  return static_cast<int64_t>(
      at::detail::computeStorageNbytes(tensor.sizes(), tensor.strides(), tensor.dtype().itemsize()));
}

OffloadedTensor OffloadedTensor::start(const at::Tensor& tensor) {
  c10::impl::ExcludeDispatchKeyGuard not_ours(kSacKey);
  OffloadedTensor offloaded;
  offloaded.device_ = tensor.device();
  offloaded.version_counter_ = tensor.unsafeGetTensorImpl()->version_counter();
  offloaded.bytes_ = offloadedBytes(tensor);
  c10::impl::VirtualGuardImpl impl(offloaded.device_.type());
  const c10::Stream compute = impl.getStream(offloaded.device_);
  const CopyStreams& streams = copyStreams(offloaded.device_);
  recordedOn(compute)->block(streams.to_host);
  offloaded.host_ = tensorOver(PinnedPool::instance().take(static_cast<size_t>(offloaded.bytes_)), tensor);
  {
    c10::StreamGuard on_copy_stream(streams.to_host);
    offloaded.host_.copy_(tensor, /*non_blocking=*/true);
  }
  offloaded.copied_out_ = recordedOn(streams.to_host);
  impl.recordDataPtrOnStream(tensor.storage().data_ptr(), streams.to_host);
  copies_to_host.fetch_add(1, std::memory_order_relaxed);
  bytes_to_host.fetch_add(offloaded.bytes_, std::memory_order_relaxed);
  return offloaded;
}

OffloadedTensor& OffloadedTensor::operator=(OffloadedTensor&& other) noexcept {
  if (this != &other) {
    release();
    host_ = std::move(other.host_);
    device_copy_ = std::move(other.device_copy_);
    copied_out_ = std::move(other.copied_out_);
    copied_in_ = std::move(other.copied_in_);
    device_ = other.device_;
    version_counter_ = std::move(other.version_counter_);
    saved_version_ = other.saved_version_;
    bytes_ = other.bytes_;
  }
  return *this;
}

void OffloadedTensor::fetch() {
  if (device_copy_.defined() || !host_.defined()) return;
  c10::impl::ExcludeDispatchKeyGuard not_ours(kSacKey);
  c10::impl::VirtualGuardImpl impl(device_.type());
  const c10::Stream compute = impl.getStream(device_);
  const CopyStreams& streams = copyStreams(device_);
  // Allocated for the compute stream, which uses it; the copy-in stream waits until the compute
  // stream has reached the allocation, and until the copy out has finished.
  device_copy_ = at::empty_strided(host_.sizes(), host_.strides(), host_.options().device(device_).pinned_memory(false));
  recordedOn(compute)->block(streams.to_device);
  copied_out_->block(streams.to_device);
  {
    c10::StreamGuard on_copy_stream(streams.to_device);
    device_copy_.copy_(host_, /*non_blocking=*/true);
  }
  copied_in_ = recordedOn(streams.to_device, /*timed=*/true);
  impl.recordDataPtrOnStream(device_copy_.storage().data_ptr(), streams.to_device);
  copies_to_device.fetch_add(1, std::memory_order_relaxed);
  bytes_to_device.fetch_add(bytes_, std::memory_order_relaxed);
}

at::Tensor OffloadedTensor::take(bool keep_host) {
  TORCH_CHECK(host_.defined(), "sac: an offloaded output was taken after its host copy was released");
  fetch();
  {
    c10::impl::VirtualGuardImpl impl(device_.type());
    const c10::Stream compute = impl.getStream(device_);
    std::shared_ptr<c10::Event> compute_reached = recordedOn(compute, /*timed=*/true);
    copied_in_->block(compute);
    ExposedCopyTime::instance().note(std::move(compute_reached), copied_in_);
  }
  at::Tensor on_device = std::move(device_copy_);
  device_copy_ = at::Tensor();
  if (!keep_host) release();
  return on_device;
}

void OffloadedTensor::release() {
  device_copy_ = at::Tensor();
  if (!host_.defined()) return;
  c10::Storage storage = host_.storage();
  host_ = at::Tensor();
  PinnedPool::instance().give(std::move(storage), copied_in_ != nullptr ? copied_in_ : copied_out_);
  copied_in_.reset();
  copied_out_.reset();
}

OffloadStats offloadStats() {
  OffloadStats stats;
  stats.copies_to_host = copies_to_host.load(std::memory_order_relaxed);
  stats.bytes_to_host = bytes_to_host.load(std::memory_order_relaxed);
  stats.copies_to_device = copies_to_device.load(std::memory_order_relaxed);
  stats.bytes_to_device = bytes_to_device.load(std::memory_order_relaxed);
  stats.exposed_copy_us = ExposedCopyTime::instance().microseconds();
  PinnedPool::instance().stats(&stats);
  return stats;
}

int64_t emptyOffloadPool() { return PinnedPool::instance().empty(); }

}  // namespace sac
