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

#include <chrono>
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
// A marker: `reached` is called on the stream's worker with the time the stream reached it
// (NOTE: [An event's time is when its stream reached it]).
void enqueue_marker_on_stream(const c10::Stream& stream,
                              std::function<void(std::chrono::steady_clock::time_point)> reached);
// Which way a copy goes, for the copy model (NOTE: [The copy and compute model]).
enum class CopyDirection { kToHost, kToDevice, kWithinDevice };
// A queued copy of `bytes` bytes: the copy delay, then the copy, taking at least the modelled time.
void enqueue_copy_on_stream(const c10::Stream& stream, std::function<void()> copy, size_t bytes,
                            CopyDirection direction);
// Runs a copy on the calling thread, taking at least the modelled time.
void run_modelled_copy(const std::function<void()>& copy, size_t bytes, CopyDirection direction);
// Something waits on the stream's work: releases copies held for a wait (NOTE: [A copy delay that
// starts at the wait]).
void note_waited(const c10::Stream& stream);
void synchronize_stream(const c10::Stream& stream);
bool stream_idle(const c10::Stream& stream);
std::vector<c10::Stream> busy_streams();
void synchronize_device(c10::DeviceIndex device);
void set_copy_delay_us(int64_t microseconds, bool from_wait);
// The copy and compute model (NOTE: [The copy and compute model]): bytes/s each way (0: not
// modelled) and the factor every kernel's CPU time is multiplied by (>= 1).
void set_copy_bandwidth(double to_host, double to_device);
void set_compute_scale(double scale);
double compute_scale();
// {bandwidth to the host, bandwidth to the device, compute scale}.
std::vector<double> simulation_parameters();
// Called after a kernel that began at `started`: returns when it has taken `scale` times as long.
void wait_out_compute_scale(std::chrono::steady_clock::time_point started, double scale);

// Grows or shrinks a device storage to new_bytes, keeping the common prefix of its contents.
void resize_device_storage(const c10::Storage& storage, size_t new_bytes);

}  // namespace sac_test_accelerator
