// The device guard: the current device and the current stream per thread, streams, and events.
//
// Streams are ids; the work queued on them runs on their worker threads (streams.cpp, NOTE: [What
// runs asynchronously]). An event is recorded by queueing a marker on the stream: it completes
// when the stream's worker reaches it, and it holds the time the stream reached it (elapsed_time,
// NOTE: [An event's time is when its stream reached it]).
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "accelerator.h"

namespace sac_test_accelerator {
namespace {

constexpr c10::StreamId kDefaultStream = 0;
// Streams handed out by getStreamFromGlobalPool cycle through 1..kPoolSize, as CUDA's pool does;
// getNewStream numbers past the pool and never repeats.
constexpr c10::StreamId kPoolSize = 32;

thread_local c10::DeviceIndex thread_device = 0;
thread_local std::array<c10::StreamId, kDeviceCount> thread_streams{};  // all default

std::atomic<c10::StreamId> next_pool_stream{0};
std::atomic<c10::StreamId> next_new_stream{kPoolSize + 1};

// recorded counts the times the event was recorded; completed is the latest recording a stream
// has reached. Waiting on an event waits for the recording made before the wait.
struct Event {
  explicit Event(c10::DeviceIndex on) : device(on) {}

  void wait_for(uint64_t version) {
    std::unique_lock<std::mutex> lock(mutex);
    reached.wait(lock, [&] { return completed >= version; });
  }

  const c10::DeviceIndex device;
  std::mutex mutex;
  std::condition_variable reached;
  uint64_t recorded = 0;
  uint64_t completed = 0;
  std::chrono::steady_clock::time_point completed_at;
  c10::StreamId recorded_on = 0;  // the stream of the latest recording
};

// torch asks for streams of "the current device" with index -1.
c10::DeviceIndex resolve(c10::Device device) {
  c10::DeviceIndex index = device.has_index() ? device.index() : thread_device;
  check_device_index(index);
  return index;
}

// torch holds an event as a void*: here a heap shared_ptr, so that markers and waits still queued
// on streams keep the event alive after torch destroys it.
using EventHandle = std::shared_ptr<Event>;

std::shared_ptr<Event> event_of(void* event) { return event == nullptr ? nullptr : *static_cast<EventHandle*>(event); }

c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, device), id);
}

// A stream or the host is about to wait for the event's latest recording: the stream it was
// recorded on learns of the wait (NOTE: [A copy delay that starts at the wait]). Returns the
// recording to wait for.
uint64_t about_to_wait(Event& event) {
  uint64_t version;
  c10::StreamId stream;
  {
    std::lock_guard<std::mutex> lock(event.mutex);
    version = event.recorded;
    stream = event.recorded_on;
  }
  if (version > 0) {
    note_waited(make_stream(event.device, stream));
  }
  return version;
}

class DeviceGuard final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }

  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device previous = getDevice();
    setDevice(device);
    return previous;
  }

  c10::Device getDevice() const override { return {c10::DeviceType::PrivateUse1, thread_device}; }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.is_privateuseone(), "sac_test_accelerator: setDevice got ", device);
    set_current_device(device.index());
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override { thread_device = device.index(); }

  c10::Stream getStream(c10::Device device) const override {
    c10::DeviceIndex index = resolve(device);
    return make_stream(index, thread_streams[index]);
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    return make_stream(resolve(device), kDefaultStream);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*isHighPriority*/) const override {
    return make_stream(resolve(device), 1 + next_pool_stream.fetch_add(1) % kPoolSize);
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return make_stream(resolve(device), next_new_stream.fetch_add(1));
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    c10::DeviceIndex device = stream.device_index();
    check_device_index(device);
    c10::Stream previous = make_stream(device, thread_streams[device]);
    thread_streams[device] = stream.id();
    return previous;
  }

  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "sac_test_accelerator: event on device ",
                static_cast<int>(device_index), " recorded on a stream of device ",
                static_cast<int>(stream.device_index()));
    if (*event == nullptr) {
      *event = new EventHandle(std::make_shared<Event>(stream.device_index()));
    }
    std::shared_ptr<Event> recorded = event_of(*event);
    TORCH_CHECK(recorded->device == stream.device_index(), "sac_test_accelerator: an event created on device ",
                static_cast<int>(recorded->device), " cannot be recorded on device ",
                static_cast<int>(stream.device_index()));
    uint64_t version;
    {
      std::lock_guard<std::mutex> lock(recorded->mutex);
      version = ++recorded->recorded;
      recorded->recorded_on = stream.id();
    }
    enqueue_marker_on_stream(stream, [recorded, version](std::chrono::steady_clock::time_point reached) {
      {
        std::lock_guard<std::mutex> lock(recorded->mutex);
        recorded->completed = std::max(recorded->completed, version);
        recorded->completed_at = reached;  // NOTE: [An event's time is when its stream reached it]
      }
      recorded->reached.notify_all();
    });
  }

  // The stream's later work waits for the event's latest recording: a wait queued on the stream's
  // worker, which the next op on that stream drains before it runs.
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return;  // never recorded: nothing to wait for
    }
    std::shared_ptr<Event> waited = event_of(event);
    const uint64_t version = about_to_wait(*waited);
    enqueue_on_stream(stream, [waited, version] { waited->wait_for(version); });
  }

  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;
    }
    std::shared_ptr<Event> queried = event_of(event);
    std::lock_guard<std::mutex> lock(queried->mutex);
    return queried->completed >= queried->recorded;
  }

  void synchronizeEvent(void* event) const override {
    if (event == nullptr) {
      return;
    }
    std::shared_ptr<Event> waited = event_of(event);
    waited->wait_for(about_to_wait(*waited));
  }

  bool queryStream(const c10::Stream& stream) const override { return stream_idle(stream); }
  void synchronizeStream(const c10::Stream& stream) const override { synchronize_stream(stream); }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    synchronize_device(device_index == -1 ? thread_device : device_index);
  }
  // The allocator keeps a block a recorded stream may still use (allocator.cpp).
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& stream) const override {
    static_cast<c10::DeviceAllocator*>(device_allocator())->recordStream(data_ptr, stream);
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<EventHandle*>(event);
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "sac_test_accelerator: both events must be recorded before asking for the elapsed time");
    synchronizeEvent(start);
    synchronizeEvent(end);
    auto elapsed = event_of(end)->completed_at - event_of(start)->completed_at;
    return std::chrono::duration<double, std::milli>(elapsed).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, DeviceGuard);

}  // namespace

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "sac_test_accelerator: device index ", static_cast<int>(index),
              " is out of range; devices are 0..", static_cast<int>(kDeviceCount - 1));
}

c10::Stream current_stream(c10::DeviceIndex device) {
  check_device_index(device);
  return make_stream(device, thread_streams[device]);
}

c10::DeviceIndex current_device() { return thread_device; }

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  thread_device = index;
}

}  // namespace sac_test_accelerator
