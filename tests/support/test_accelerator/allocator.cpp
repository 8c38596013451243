// The device allocator (a c10::DeviceAllocator, so that torch.accelerator.memory_allocated and the
// other statistics read it) and the pinned host allocator.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "accelerator.h"

namespace sac_test_accelerator {
namespace {

using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kAlignment = 64;

void* aligned_block(size_t bytes) {
  // aligned_alloc wants a multiple of the alignment.
  void* block = std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  TORCH_CHECK(block != nullptr, "sac_test_accelerator: out of host memory allocating ", bytes, " bytes");
  return block;
}

// Live blocks by start address, so that any pointer inside one can be traced to its block.
struct Block {
  size_t bytes;
  c10::DeviceIndex device;
  std::vector<c10::Stream> streams;  // recorded with Tensor.record_stream: they may still use it
};

const Block* block_containing(const std::map<const void*, Block>& blocks, const void* pointer) {
  auto after = blocks.upper_bound(pointer);
  if (after == blocks.begin()) {
    return nullptr;
  }
  const auto& [start, block] = *std::prev(after);
  const auto* begin = static_cast<const char*>(start);
  const auto* at = static_cast<const char*>(pointer);
  return at < begin + std::max<size_t>(block.bytes, 1) ? &block : nullptr;
}

// Every allocation is a fresh block (no cache), so allocated, reserved, active and requested bytes
// are all the same number: the bytes of the live tensors' storages.
class DeviceMemory final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    c10::DeviceIndex device = current_device();
    c10::Device where(c10::DeviceType::PrivateUse1, device);
    if (bytes == 0) {
      return {nullptr, nullptr, &release, where};
    }
    void* block = aligned_block(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_.emplace(block, Block{bytes, device, {}});
    DeviceStats& stats = stats_[device];
    for (c10::CachingAllocator::StatArray* array :
         {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes}) {
      (*array)[static_cast<size_t>(StatType::AGGREGATE)].increase(bytes);
    }
    for (c10::CachingAllocator::StatArray* array : {&stats.allocation, &stats.segment, &stats.active}) {
      (*array)[static_cast<size_t>(StatType::AGGREGATE)].increase(1);
    }
    stats.num_device_alloc += 1;
    return {block, block, &release, where};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  bool initialized() override { return true; }
  // Nothing is cached: freed blocks go straight back to the host.
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {}
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = blocks_.find(ptr.get());
    if (found == blocks_.end()) {
      return;  // no bytes (a tensor without elements)
    }
    std::vector<c10::Stream>& streams = found->second.streams;
    if (std::find(streams.begin(), streams.end(), stream) == streams.end()) {
      streams.push_back(stream);
    }
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device];
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat(stats_[device], [](c10::CachingAllocator::Stat& stat) { stat.reset_accumulated(); });
    stats_[device].num_device_alloc = 0;
    stats_[device].num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat(stats_[device], [](c10::CachingAllocator::Stat& stat) { stat.reset_peak(); });
  }

  c10::Device device_of(const void* pointer) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Block* block = block_containing(blocks_, pointer);
    TORCH_CHECK(block != nullptr, "sac_test_accelerator: ", pointer, " is not in device memory");
    return {c10::DeviceType::PrivateUse1, block->device};
  }

 private:
  template <typename Fn>
  static void for_each_stat(DeviceStats& stats, Fn fn) {
    for (c10::CachingAllocator::StatArray* array :
         {&stats.allocation, &stats.segment, &stats.active, &stats.allocated_bytes, &stats.reserved_bytes,
          &stats.active_bytes, &stats.requested_bytes}) {
      for (c10::CachingAllocator::Stat& stat : *array) {
        fn(stat);
      }
    }
  }

  static void release(void* block) {
    if (block == nullptr) {
      return;
    }
    instance().free_block(block);
  }

  // NOTE: [Freeing a block streams may still use]
  // The statistics drop when the tensor is freed, as CUDA's do. The memory itself goes back to the
  // host only once every stream that may still use it has finished the work queued on it now: the
  // streams recorded on the block, and every stream with queued work (NOTE: [What runs
  // asynchronously]). A block no stream was recorded on is poisoned first (every byte 0xFF: NaN
  // in a floating-point tensor), so a queued copy that reads it after the free, the bug
  // record_stream exists to prevent, copies NaNs rather than the old values.
  void free_block(void* block) {
    Block freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = blocks_.find(block);
      TORCH_INTERNAL_ASSERT(found != blocks_.end(), "sac_test_accelerator: freeing an unknown block");
      freed = std::move(found->second);
      DeviceStats& stats = stats_[freed.device];
      for (c10::CachingAllocator::StatArray* array :
           {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes}) {
        (*array)[static_cast<size_t>(StatType::AGGREGATE)].decrease(freed.bytes);
      }
      for (c10::CachingAllocator::StatArray* array : {&stats.allocation, &stats.segment, &stats.active}) {
        (*array)[static_cast<size_t>(StatType::AGGREGATE)].decrease(1);
      }
      stats.num_device_free += 1;
      blocks_.erase(found);
    }
    if (freed.streams.empty()) {
      std::memset(block, 0xFF, freed.bytes);
    }
    std::vector<c10::Stream> users = std::move(freed.streams);
    for (const c10::Stream& busy : busy_streams()) {
      if (std::find(users.begin(), users.end(), busy) == users.end()) {
        users.push_back(busy);
      }
    }
    if (users.empty()) {
      std::free(block);
      return;
    }
    auto remaining = std::make_shared<std::atomic<size_t>>(users.size());
    for (const c10::Stream& user : users) {
      enqueue_on_stream(user, [remaining, block] {
        if (remaining->fetch_sub(1) == 1) {
          std::free(block);
        }
      });
    }
  }

 public:
  static DeviceMemory& instance();

 private:
  std::mutex mutex_;
  std::map<const void*, Block> blocks_;
  std::array<DeviceStats, kDeviceCount> stats_;
};

// Never destroyed: tensors may be freed during interpreter shutdown, after static destructors.
DeviceMemory& DeviceMemory::instance() {
  static auto* memory = new DeviceMemory();
  return *memory;
}

// Page-locking is meaningless here; what matters is that torch can tell a pinned host tensor from
// an ordinary one (Tensor.is_pinned), so pinned blocks are recorded.
class PinnedHostMemory final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) {
      return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    }
    void* block = aligned_block(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_.emplace(block, Block{bytes, -1, {}});
    return {block, block, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  bool contains(const void* pointer) {
    std::lock_guard<std::mutex> lock(mutex_);
    return block_containing(blocks_, pointer) != nullptr;
  }

  static PinnedHostMemory& instance() {
    static auto* memory = new PinnedHostMemory();
    return *memory;
  }

 private:
  static void release(void* block) {
    if (block == nullptr) {
      return;
    }
    {
      PinnedHostMemory& memory = instance();
      std::lock_guard<std::mutex> lock(memory.mutex_);
      memory.blocks_.erase(block);
    }
    std::free(block);
  }

  std::mutex mutex_;
  std::map<const void*, Block> blocks_;
};

struct RegisterDeviceAllocator {
  RegisterDeviceAllocator() { c10::SetAllocator(c10::DeviceType::PrivateUse1, &DeviceMemory::instance()); }
} register_device_allocator;

}  // namespace

c10::Allocator* device_allocator() { return &DeviceMemory::instance(); }

c10::Allocator* pinned_host_allocator() { return &PinnedHostMemory::instance(); }

bool is_pinned_host_pointer(const void* pointer) {
  return pointer != nullptr && PinnedHostMemory::instance().contains(pointer);
}

c10::Device device_of_pointer(const void* pointer) { return DeviceMemory::instance().device_of(pointer); }

void resize_device_storage(const c10::Storage& storage, size_t new_bytes) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "sac_test_accelerator: trying to resize storage that is not resizable");
  size_t old_bytes = impl->nbytes();
  if (new_bytes == old_bytes) {
    return;
  }
  // The new block lives on the storage's device, whatever the caller's current device is.
  c10::DataPtr fresh;
  {
    c10::DeviceIndex previous = current_device();
    set_current_device(impl->device().index());
    fresh = impl->allocator()->allocate(new_bytes);
    set_current_device(previous);
  }
  size_t kept = std::min(old_bytes, new_bytes);
  if (kept > 0) {
    std::memcpy(fresh.get(), impl->data(), kept);
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(new_bytes);
}

}  // namespace sac_test_accelerator
