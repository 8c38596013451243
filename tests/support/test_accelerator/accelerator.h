// The test accelerator: a PrivateUse1 backend whose "device memory" is ordinary host memory.
//
// It exists so that code which moves activations between an accelerator and pinned host memory,
// records streams and events, and runs backward on autograd's per-device threads can be tested on
// machines without a GPU. Every piece torch asks an accelerator for is real (an allocator with
// statistics, a pinned host allocator, a device guard with streams and events, the hooks that make
// torch.accelerator see it); only the kernels are borrowed: every op runs the CPU kernel on the
// same memory (kernels.cpp). Ops run when called; non_blocking copies run later on the stream's
// worker thread (streams.cpp, NOTE: [What runs asynchronously]).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>

#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace sac_test_accelerator {

// Two devices, so that code which switches devices (guards, per-device streams, per-device
// autograd threads) is exercised too.
constexpr c10::DeviceIndex kDeviceCount = 2;

// The calling thread's current device (device_guard.cpp).
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
void check_device_index(c10::DeviceIndex index);

// The device allocator and the pinned host allocator (allocator.cpp).
c10::Allocator* device_allocator();
c10::Allocator* pinned_host_allocator();
bool is_pinned_host_pointer(const void* pointer);
// The device that owns a pointer from the device allocator (any pointer inside a live block).
c10::Device device_of_pointer(const void* pointer);
// The device's current stream on the calling thread (device_guard.cpp).
c10::Stream current_stream(c10::DeviceIndex device);

// Stream workers (streams.cpp, NOTE: [What runs asynchronously]).
void enqueue_on_stream(const c10::Stream& stream, std::function<void()> work);
void enqueue_copy_on_stream(const c10::Stream& stream, std::function<void()> copy);
void synchronize_stream(const c10::Stream& stream);
bool stream_idle(const c10::Stream& stream);
std::vector<c10::Stream> busy_streams();
void synchronize_device(c10::DeviceIndex device);
void set_copy_delay_us(int64_t microseconds);

// Grows or shrinks a device storage to new_bytes, keeping the common prefix of its contents.
void resize_device_storage(const c10::Storage& storage, size_t new_bytes);

}  // namespace sac_test_accelerator
