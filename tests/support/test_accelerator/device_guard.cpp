// The device guard: the current device and the current stream per thread, streams, and events.
//
// Kernels run synchronously on the calling thread, so a stream is a name: work "on" it has always
// finished when the call returns, every recorded event has completed, and waiting on one returns at
// once. What stays observable, and what code under test relies on, is the bookkeeping: which stream
// is current on which thread and device, that streams from the pool are distinct from the default
// stream, and that events are recorded with a time (elapsed_time works).
#include "accelerator.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>

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

struct Event {
  c10::DeviceIndex device;
  std::chrono::steady_clock::time_point recorded_at;
};

// torch asks for streams of "the current device" with index -1.
c10::DeviceIndex resolve(c10::Device device) {
  c10::DeviceIndex index = device.has_index() ? device.index() : thread_device;
  check_device_index(index);
  return index;
}

c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, device), id);
}

class DeviceGuard final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override {
    return c10::DeviceType::PrivateUse1;
  }

  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device previous = getDevice();
    setDevice(device);
    return previous;
  }

  c10::Device getDevice() const override {
    return {c10::DeviceType::PrivateUse1, thread_device};
  }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.is_privateuseone(), "sac_test_accelerator: setDevice got ", device);
    set_current_device(device.index());
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    thread_device = device.index();
  }

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

  c10::DeviceIndex deviceCount() const noexcept override {
    return kDeviceCount;
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "sac_test_accelerator: event on device ",
                static_cast<int>(device_index), " recorded on a stream of device ", static_cast<int>(stream.device_index()));
    if (*event == nullptr) {
      *event = new Event{stream.device_index(), {}};
    }
    auto* recorded = static_cast<Event*>(*event);
    TORCH_CHECK(recorded->device == stream.device_index(), "sac_test_accelerator: an event created on device ",
                static_cast<int>(recorded->device), " cannot be recorded on device ", static_cast<int>(stream.device_index()));
    recorded->recorded_at = std::chrono::steady_clock::now();
  }

  // Everything recorded has completed, so waiting, querying and synchronizing return at once.
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override {
    return true;
  }
  void synchronizeEvent(void* /*event*/) const override {}
  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}

  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr,
                "sac_test_accelerator: both events must be recorded before asking for the elapsed time");
    auto elapsed = static_cast<Event*>(end)->recorded_at - static_cast<Event*>(start)->recorded_at;
    return std::chrono::duration<double, std::milli>(elapsed).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, DeviceGuard);

}  // namespace

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "sac_test_accelerator: device index ", static_cast<int>(index),
              " is out of range; devices are 0..", static_cast<int>(kDeviceCount - 1));
}

c10::DeviceIndex current_device() {
  return thread_device;
}

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  thread_device = index;
}

}  // namespace sac_test_accelerator
