// The test accelerator: a PrivateUse1 backend whose "device memory" is ordinary host memory.
//
// It exists so that code which moves activations between an accelerator and pinned host memory,
// records streams and events, and runs backward on autograd's per-device threads can be tested on
// machines without a GPU. Every piece torch asks an accelerator for is real (an allocator with
// statistics, a pinned host allocator, a device guard with streams and events, the hooks that make
// torch.accelerator see it); only the kernels are borrowed: every op runs the CPU kernel on the
// same memory (kernels.cpp). Work is synchronous, so every stream is always idle and every
// recorded event has completed.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>

#include <cstddef>

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
// Grows or shrinks a device storage to new_bytes, keeping the common prefix of its contents.
void resize_device_storage(const c10::Storage& storage, size_t new_bytes);

}  // namespace sac_test_accelerator
