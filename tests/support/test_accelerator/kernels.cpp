// The kernels: every op runs the CPU kernel over the same memory.
//
// NOTE: [Running every op on the CPU kernels]
// Device memory is host memory, so a device tensor can be looked at as a CPU tensor without a
// copy: host_view() wraps its data with the same sizes and strides. The boxed fallback replaces
// every device tensor (and device argument) in the stack with that CPU view, calls the op again
// (it now dispatches to CPU), and turns what comes back into device tensors:
// - a returned CPU view of an argument (in-place ops) is that argument itself;
// - an out= argument is the exception to sharing memory: it gets a CPU tensor of its own, which
//   the CPU kernel may resize, and the device tensor takes its shape and values afterwards;
// - a CPU tensor inside an argument's memory (a view op the CPU backend implements, e.g. unfold)
//   becomes the same view of the device argument (as_strided over its storage);
// - anything else is new memory: it is copied into a device tensor from the device allocator, so
//   the allocator's statistics count every tensor a device op returns.
// What the fallback cannot do generically is registered below as kernels of its own: making
// tensors (empty, empty_strided), copying between devices (_copy_from, _copy_from_and_resize),
// views torch expects every backend to implement (as_strided, view, _reshape_alias), and changing
// a tensor's storage (resize_, set_), since the CPU views do not own their memory, and
// record_stream, which only a device's allocator can honour.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <chrono>
#include <optional>
#include <vector>

#include "accelerator.h"

namespace sac_test_accelerator {
namespace {

bool on_device(const at::Tensor& tensor) { return tensor.defined() && tensor.device().is_privateuseone(); }

// A CPU tensor over a device tensor's memory: same data, sizes and strides. It does not own the
// memory, so it must not outlive the device tensor: the fallback holds every device argument
// until the op's results are converted.
at::Tensor host_view(const at::Tensor& tensor) {
  if (!on_device(tensor)) {
    return tensor;
  }
  return at::from_blob(tensor.data_ptr(), tensor.sizes(), tensor.strides(),
                       tensor.options().device(at::kCPU).requires_grad(false));
}

c10::Device device_or_current(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) {
    return *device;
  }
  return {c10::DeviceType::PrivateUse1, current_device()};
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), "sac_test_accelerator: only host tensors can be pinned");
  c10::DeviceGuard guard(device_or_current(device));
  constexpr c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, device_allocator(), keys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "sac_test_accelerator: only host tensors can be pinned");
  c10::DeviceGuard guard(device_or_current(device));
  constexpr c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, device_allocator(), keys, c10::dtype_or_default(dtype));
}

// A CPU tensor over any tensor's memory, owning nothing and carrying no autograd state, for a
// copy that runs on a stream's worker thread.
at::Tensor bare_alias(const at::Tensor& tensor) {
  return at::from_blob(tensor.data_ptr(), tensor.sizes(), tensor.strides(),
                       tensor.options().device(at::kCPU).requires_grad(false));
}

// Host to device, device to host, device to device: all the same CPU copy. A non_blocking copy
// between the device and pinned host memory (or within the device) is queued on the device's
// current stream (NOTE: [What runs asynchronously]); from or to unpinned host memory it runs now,
// as on CUDA. The queued copy does not keep the device memory alive (record_stream does: NOTE:
// [Freeing a block streams may still use]); it keeps the host tensor alive, as a pinned-memory
// allocator that tracks its blocks' streams would.
// Either way, a copy between the device and host memory takes at least the time the copy model
// gives its bytes (NOTE: [The copy and compute model]).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const at::Tensor& device_side = on_device(dst) ? dst : self;
  c10::Stream stream = current_stream(device_side.device().index());
  auto pinned_or_device = [](const at::Tensor& tensor) {
    return on_device(tensor) || tensor.numel() == 0 || is_pinned_host_pointer(tensor.data_ptr());
  };
  const CopyDirection direction = on_device(self) && on_device(dst) ? CopyDirection::kWithinDevice
                                  : on_device(dst)                  ? CopyDirection::kToDevice
                                                                    : CopyDirection::kToHost;
  const size_t bytes = dst.numel() * dst.element_size();
  if (!non_blocking || !pinned_or_device(self) || !pinned_or_device(dst)) {
    synchronize_stream(stream);
    if (on_device(self) && on_device(dst) && self.device() != dst.device()) {
      synchronize_stream(current_stream(self.device().index()));
    }
    run_modelled_copy([&] { host_view(dst).copy_(host_view(self)); }, bytes, direction);
    return dst;
  }
  at::Tensor host_side = on_device(dst) ? self : dst;
  enqueue_copy_on_stream(
      stream,
      [source = bare_alias(self), destination = bare_alias(dst),
       keep_alive = on_device(host_side) ? at::Tensor() : host_side]() mutable { destination.copy_(source); },
      bytes, direction);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// Gives a device tensor new sizes and strides (same storage offset), growing its storage if they
// reach past its end.
void restride(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  self.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride, self.storage_offset());
  if (self.numel() > 0) {
    size_t needed =
        at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
    if (needed > self.storage().nbytes()) {
      resize_device_storage(self.storage(), needed);
    }
  }
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(memory_format.value_or(at::MemoryFormat::Contiguous) != at::MemoryFormat::Preserve,
              "sac_test_accelerator: resize_ does not accept memory_format=torch.preserve_format");
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value()) {
    impl->empty_tensor_restride(*memory_format);
  }
  restride(self, self.sizes(), self.strides());
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t storage_offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().is_privateuseone(),
              "sac_test_accelerator: set_ takes a storage on the device, got one on ", source.device());
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(storage_offset);
  restride(self, size, stride);
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {1});
}

// The tensor's block stays allocated until the work queued on `stream` now has run (NOTE:
// [Freeing a block streams may still use]).
void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == c10::DeviceType::PrivateUse1,
              "sac_test_accelerator: record_stream takes a stream of this device, got one of ", stream.device());
  static_cast<c10::DeviceAllocator*>(device_allocator())->recordStream(self.storage().data_ptr(), stream);
}

// What the fallback turns a CPU result back into (NOTE: [Running every op on the CPU kernels]).
struct DeviceArgument {
  at::Tensor device_tensor;
  at::Tensor host_tensor;
  bool is_out;  // host_tensor is a CPU tensor of its own, copied back after the op
};

// An out= argument gets a CPU tensor of its own rather than a view of the device memory: the CPU
// kernel may resize it, which a view of memory it does not own refuses. After the op the device
// tensor takes the CPU tensor's sizes and strides (growing its storage through the device
// allocator) and its values.
at::Tensor host_copy_for_out(const at::Tensor& tensor) {
  at::Tensor host = at::empty_strided(tensor.sizes(), tensor.strides(), tensor.options().device(at::kCPU));
  host.copy_(host_view(tensor));
  return host;
}

void copy_back_out(const DeviceArgument& argument) {
  const at::Tensor& host = argument.host_tensor;
  const at::Tensor& device = argument.device_tensor;
  if (host.sizes() != device.sizes() || host.strides() != device.strides()) {
    restride(device, host.sizes(), host.strides());
  }
  host_view(device).copy_(host);
}

at::Tensor to_device(const at::Tensor& result, const std::vector<DeviceArgument>& arguments, c10::Device device) {
  if (!result.defined() || on_device(result)) {
    return result;
  }
  for (const DeviceArgument& argument : arguments) {
    if (result.unsafeGetTensorImpl() == argument.host_tensor.unsafeGetTensorImpl()) {
      return argument.device_tensor;
    }
  }
  for (const DeviceArgument& argument : arguments) {
    if (result.has_storage() && argument.host_tensor.has_storage() &&
        result.storage().unsafeGetStorageImpl() == argument.host_tensor.storage().unsafeGetStorageImpl()) {
      TORCH_CHECK(result.dtype() == argument.device_tensor.dtype(),
                  "sac_test_accelerator: a view that changes the dtype is not supported (",
                  argument.device_tensor.dtype(), " to ", result.dtype(), ")");
      auto bytes =
          static_cast<const char*>(result.data_ptr()) - static_cast<const char*>(argument.host_tensor.data_ptr());
      int64_t offset =
          argument.device_tensor.storage_offset() + bytes / static_cast<int64_t>(result.dtype().itemsize());
      return at::native::as_strided_tensorimpl(argument.device_tensor, result.sizes(), result.strides(), offset);
    }
  }
  at::Tensor fresh = empty_strided(result.sizes(), result.strides(), result.scalar_type(), std::nullopt, device, false);
  if (result.numel() > 0) {
    host_view(fresh).copy_(result);
  }
  return fresh;
}

void run_on_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t argument_count = schema.arguments().size();
  auto arguments_begin = stack->end() - static_cast<std::ptrdiff_t>(argument_count);

  std::vector<DeviceArgument> device_arguments;
  std::optional<c10::Device> device;
  auto swap_tensor = [&](const at::Tensor& tensor, bool is_out) -> at::Tensor {
    if (!on_device(tensor)) {
      return tensor;
    }
    if (!device.has_value()) {
      device = tensor.device();
    }
    at::Tensor host = is_out ? host_copy_for_out(tensor) : host_view(tensor);
    device_arguments.push_back({tensor, host, is_out});
    return host;
  };
  for (auto it = arguments_begin; it != stack->end(); ++it) {
    c10::IValue& value = *it;
    const bool is_out = schema.arguments()[it - arguments_begin].is_out();
    if (value.isTensor()) {
      value = swap_tensor(value.toTensor(), is_out);
    } else if (value.isList()) {
      // Tensor[] and Tensor?[]: a copy, since the caller's list must keep its device tensors.
      c10::List<c10::IValue> swapped = value.toList().copy();
      for (size_t i = 0; i < swapped.size(); ++i) {
        c10::IValue element = swapped.get(i);
        if (element.isTensor()) {
          swapped.set(i, swap_tensor(element.toTensor(), is_out));
        }
      }
      value = swapped;
    } else if (value.isDevice() && value.toDevice().is_privateuseone()) {
      // A factory op: it makes its result on the CPU, and the result is copied to this device.
      if (!device.has_value()) {
        device = device_or_current(value.toDevice());
      }
      value = c10::IValue(c10::Device(c10::DeviceType::CPU));
    }
  }
  if (!device.has_value()) {
    device = c10::Device(c10::DeviceType::PrivateUse1, current_device());
  }
  // The op runs now, after the work queued on its stream (NOTE: [What runs asynchronously]), and
  // takes its CPU time times the compute scale (NOTE: [The copy and compute model]).
  synchronize_stream(current_stream(device->index()));
  const double scale = compute_scale();
  const auto started = std::chrono::steady_clock::now();
  // device_arguments holds the device tensors until the results are converted: their host views
  // on the stack do not own their memory.
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  for (const DeviceArgument& argument : device_arguments) {
    if (argument.is_out) {
      copy_back_out(argument);
    }
  }

  const size_t return_count = schema.returns().size();
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(return_count); it != stack->end(); ++it) {
    c10::IValue& value = *it;
    if (value.isTensor()) {
      value = to_device(value.toTensor(), device_arguments, *device);
    } else if (value.isList()) {
      c10::List<c10::IValue> converted = value.toList().copy();
      for (size_t i = 0; i < converted.size(); ++i) {
        c10::IValue element = converted.get(i);
        if (element.isTensor()) {
          converted.set(i, to_device(element.toTensor(), device_arguments, *device));
        }
      }
      value = converted;
    }
  }
  if (scale != 1.0) {
    wait_out_compute_scale(started, scale);
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_cpu>()); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("resize_", TORCH_FN(resize));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("record_stream", TORCH_FN(record_stream));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
}

}  // namespace
}  // namespace sac_test_accelerator
