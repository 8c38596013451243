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

#include "dispatch/ivalue_tensors.h"
#include "dispatch/sac_key.h"
#include "policy/offload_rule.h"

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
//   Host memory: pinned buffers come from a bounded pool reused across steps (pinned allocation
//   costs milliseconds per buffer on CUDA; NOTE: [A bounded pinned pool]).
//   Where an output cannot be offloaded it is kept on its device (Region::keep): the call runs on
//   the CPU (its outputs are in host memory already; said once per checkpoint site), its outputs
//   are smaller than the policy's offload_min_bytes (a copy would cost more than it frees), the
//   pool cannot hold them within the policy's host_memory_limit (said once per site), or an output
//   is not a dense tensor of its own (a list, overlapping or aliased outputs).
//   Ownership: the region that kept the call owns its offloaded tensors, each its host buffer and
//   its copies (NOTE: [A region owns what it holds] in region.h): whichever way the region dies,
//   the buffers go back to the pool and the copies fetched back are freed.
//   Writes: before a write in the forward, the compute stream waits until the copy out is done,
//   so the host copy is the value the call made and is served as a kept output written in the
//   forward is (NOTE: [Kept outputs written in the forward] in preserved_writes.cpp); a write after the
//   forward is found by the version counter the offloaded tensor shares with the forward's
//   tensor, and serving raises naming the op, before the host copy, which the write may have
//   raced, is used.
//
// NOTE: [Offloading a layer's inputs]
// Under full recompute a checkpointed layer holds nothing of its own between the forward and the
// backward but its inputs: torch's non-reentrant checkpoint saves the function's positional
// arguments so that the recompute can run the function again, and in a stack of layers the input
// of each is the activation the layer below returned, which nothing else holds once the forward
// has moved on. That is the memory floor of recompute, one activation per layer, and a policy
// with offload_inputs lowers it: the function torch's checkpoint runs is handed an empty
// placeholder (same device, so torch still saves and restores that device's RNG state) in place of
// each such input, and holds the real tensor itself for the forward only. At the end of the
// forward the region whose scopes run the function takes the inputs (Region::holdInputs) and
// offloads them as it offloads outputs: one pinned buffer each from the same bounded pool, within
// the same host_memory_limit (past it the input is held on its device, as before), copied out on
// the copy-out stream after the forward's work. The recompute asks the region for them back
// (takeInputs), fetched with the region's offloaded outputs when its recompute begins, and with
// them ahead of time by the recompute of the region after it. Gradients do not change: the
// forward's graph was built on the real inputs, and the recompute only re-creates saved values,
// from copies with the same sizes, strides, dtype and device. The version counter the offloaded
// tensor shares with the input finds a write after the forward, which the recompute would read,
// and taking it raises naming the input; retain_graph keeps the host copy for another backward,
// and the region releases everything with its outputs however it dies (NOTE: [A region owns what
// it holds] in region.h). Which inputs: tensors that require grad and are not leaves (the
// activation flowing through the stack); parameters, tensors that do not require grad (masks,
// rotary tables that every layer shares) and CPU tensors stay where torch's checkpoint holds them.
//
// The copies are the plugin's, not calls of the checkpointed function: they run under a
// PluginCallGuard (NOTE: [The plugin's own calls] in sac_key.h), so they are neither counted nor
// decided, and no dispatch mode sees them.

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

// NOTE: [A bounded pinned pool]
// Pinned host memory is the one resource offloading holds outside the device, and the pool is its
// one owner. A request is rounded up to a size class, the next power of two (at least 4 KiB), as
// torch's host allocator rounds, so that steps whose shapes change (a growing sequence length)
// reuse buffers of the classes they share instead of allocating a new one per output. A returned
// buffer is handed out again only once the last copy that used it has completed (its event). The
// policy's host_memory_limit bounds the pool's total pinned bytes, in use and cached: a request
// that would pass it first frees idle cached buffers, and when even that cannot make room it is
// refused, changing nothing, and the call's outputs stay on the device.
class PinnedPool {
 public:
  static PinnedPool& instance() {
    static auto* pool = new PinnedPool();  // leaked: copies may still finish during exit
    return *pool;
  }

  static size_t sizeClass(size_t nbytes) {
    size_t size = 4096;
    while (size < nbytes) size <<= 1;
    return size;
  }

  // A buffer of at least `nbytes`, or an undefined storage when the pool would pass `limit`.
  c10::Storage take(size_t nbytes, int64_t limit) {
    const size_t size = sizeClass(nbytes);
    std::vector<c10::Storage> trimmed;  // freed after the lock is released
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto [first, last] = free_.equal_range(size);
      for (auto it = first; it != last; ++it) {
        if (it->second.last_use != nullptr && !it->second.last_use->query()) continue;
        c10::Storage storage = std::move(it->second.storage);
        free_.erase(it);
        in_use_bytes_ += static_cast<int64_t>(size);
        return storage;
      }
      // NOTE: [Where an offloaded call's outputs live] (policy/offload_rule.cpp), with what the
      // pool holds as the reserved bytes.
      auto past_limit = [&] {
        return offloadPlacement(static_cast<int64_t>(size), bytes_, 0, limit) == OffloadPlacement::kDeviceHostLimit;
      };
      if (past_limit()) {
        trimIdle(bytes_ + static_cast<int64_t>(size) - limit, &trimmed);
        if (past_limit()) return c10::Storage();
      }
      // Counted before the allocation, so that concurrent requests cannot pass the limit together.
      bytes_ += static_cast<int64_t>(size);
      in_use_bytes_ += static_cast<int64_t>(size);
      ++allocations_;
    }
    try {
      at::Tensor buffer =
          at::empty({static_cast<int64_t>(size)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      return buffer.storage();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      bytes_ -= static_cast<int64_t>(size);
      in_use_bytes_ -= static_cast<int64_t>(size);
      throw;
    }
  }

  void give(c10::Storage storage, std::shared_ptr<c10::Event> last_use) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t size = storage.nbytes();
    in_use_bytes_ -= static_cast<int64_t>(size);
    free_.emplace(size, Buffer{std::move(storage), std::move(last_use)});
  }

  // Frees every idle buffer; returns the bytes freed.
  int64_t empty() {
    std::vector<c10::Storage> freed;
    std::lock_guard<std::mutex> lock(mutex_);
    return trimIdle(INT64_MAX, &freed);  // `freed`, declared first, is destroyed after the lock is released
  }

  void stats(OffloadStats* stats) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats->pool_bytes = bytes_;
    stats->pool_bytes_in_use = in_use_bytes_;
    stats->pool_bytes_cached = bytes_ - in_use_bytes_;
    stats->pool_allocations = allocations_;
    stats->pool_trims = trims_;
    stats->pool_bytes_trimmed = bytes_trimmed_;
  }

 private:
  struct Buffer {
    c10::Storage storage;
    std::shared_ptr<c10::Event> last_use;
  };

  // With the lock held: frees idle buffers, largest first, until `needed` bytes are freed or none
  // is left; the storages move to `freed`, which the caller destroys without the lock.
  int64_t trimIdle(int64_t needed, std::vector<c10::Storage>* freed) {
    int64_t bytes = 0;
    for (auto it = free_.end(); it != free_.begin() && bytes < needed;) {
      --it;
      if (it->second.last_use != nullptr && !it->second.last_use->query()) continue;
      bytes += static_cast<int64_t>(it->first);
      freed->push_back(std::move(it->second.storage));
      it = free_.erase(it);
    }
    bytes_ -= bytes;
    trims_ += static_cast<int64_t>(freed->size());
    bytes_trimmed_ += bytes;
    return bytes;
  }

  std::mutex mutex_;
  std::multimap<size_t, Buffer> free_;  // idle buffers by size class
  int64_t bytes_ = 0;                   // pinned bytes the pool holds, in use and cached
  int64_t in_use_bytes_ = 0;
  int64_t allocations_ = 0;
  int64_t trims_ = 0;  // idle buffers freed to make room or by empty()
  int64_t bytes_trimmed_ = 0;
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
  auto event = std::make_shared<c10::Event>(stream.device_type(),
                                            timed ? c10::EventFlag::BACKEND_DEFAULT : c10::EventFlag::PYTORCH_DEFAULT);
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

c10::Storage takePinnedBuffer(int64_t nbytes, int64_t limit) {
  return PinnedPool::instance().take(static_cast<size_t>(nbytes), limit);
}

void returnPinnedBuffer(c10::Storage buffer) { PinnedPool::instance().give(std::move(buffer), nullptr); }

OffloadedTensor OffloadedTensor::start(const at::Tensor& tensor, c10::Storage buffer) {
  PluginCallGuard not_the_models;
  OffloadedTensor offloaded;
  offloaded.device_ = tensor.device();
  offloaded.version_counter_ = tensor.unsafeGetTensorImpl()->version_counter();
  offloaded.bytes_ = offloadedBytes(tensor);
  c10::impl::VirtualGuardImpl impl(offloaded.device_.type());
  const c10::Stream compute = impl.getStream(offloaded.device_);
  const CopyStreams& streams = copyStreams(offloaded.device_);
  recordedOn(compute)->block(streams.to_host);
  TORCH_CHECK(static_cast<int64_t>(buffer.nbytes()) >= offloaded.bytes_, "sac: a pinned buffer of ", buffer.nbytes(),
              " bytes cannot hold an offloaded output of ", offloaded.bytes_, " bytes");
  offloaded.host_ = tensorOver(std::move(buffer), tensor);
  {
    c10::StreamGuard on_copy_stream(streams.to_host);
    // The copy reads an alias without autograd history (NOTE: [Storing kept outputs detached] in
    // ivalue_tensors.h): a backend may hold its source until the copy runs, and a layer's input
    // carries the graph of the layers before it, whose regions would otherwise outlive a forward
    // dropped while the copy is still queued.
    offloaded.host_.copy_(detachedAlias(tensor), /*non_blocking=*/true);
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
  PluginCallGuard not_the_models;
  c10::impl::VirtualGuardImpl impl(device_.type());
  const c10::Stream compute = impl.getStream(device_);
  const CopyStreams& streams = copyStreams(device_);
  // Allocated for the compute stream, which uses it; the copy-in stream waits until the compute
  // stream has reached the allocation, and until the copy out has finished.
  device_copy_ =
      at::empty_strided(host_.sizes(), host_.strides(), host_.options().device(device_).pinned_memory(false));
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

void OffloadedTensor::detachBeforeWrite() {
  if (!host_.defined()) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  copied_out_->block(impl.getStream(device_));
  version_counter_ = c10::VariableVersion(/*version=*/0);
  saved_version_ = 0;
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
