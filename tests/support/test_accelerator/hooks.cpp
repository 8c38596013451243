// The hooks torch asks an accelerator for: whether it is there, how many devices, the current
// device, pinned host memory, storage resizing. With them registered, torch.accelerator reports
// this backend (torch.accelerator.current_accelerator() is the renamed PrivateUse1 device).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "accelerator.h"

namespace sac_test_accelerator {
namespace {

class Hooks final : public at::PrivateUse1HooksInterface {
 public:
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  // There is no context to create: every device is ready as soon as the library is loaded.
  bool hasPrimaryContext(c10::DeviceIndex device_index) const override {
    return device_index >= 0 && device_index < kDeviceCount;
  }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return kDeviceCount; }
  void setCurrentDevice(c10::DeviceIndex device) const override { set_current_device(device); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    c10::DeviceIndex previous = current_device();
    set_current_device(device);
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override { return exchangeDevice(device); }
  bool isPinnedPtr(const void* data) const override { return is_pinned_host_pointer(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_host_allocator(); }
  at::Device getDeviceFromPtr(void* data) const override { return device_of_pointer(data); }
  // Reached by UntypedStorage.resize_ on a device storage.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const override {
    resize_device_storage(storage, new_bytes);
  }
  // No generator of its own: every kernel runs on CPU and draws from the CPU generator, which
  // torch.manual_seed seeds. Asking for a device generator says so instead of handing out one
  // that nothing reads.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    TORCH_CHECK(false,
                "sac_test_accelerator has no generator of its own: random ops on it draw from the CPU "
                "generator (torch.manual_seed seeds it)");
  }
};

struct RegisterHooks {
  RegisterHooks() {
    // Never destroyed: autograd's device threads may still ask the hooks while the process exits.
    at::RegisterPrivateUse1HooksInterface(new Hooks());
  }
} register_hooks;

int64_t device_count() { return kDeviceCount; }

}  // namespace

// The Python device module's device_count() (torch.accelerator.device_count() asks the module,
// so the module must ask the library), the delay before each queued copy (NOTE: [What runs
// asynchronously]), and the copy and compute model (NOTE: [The copy and compute model]).
TORCH_LIBRARY(sac_test_accelerator, m) {
  m.def("device_count() -> int", &device_count);
  m.def("set_copy_delay_us(int microseconds, bool from_wait=False) -> ()", &set_copy_delay_us);
  m.def("set_copy_bandwidth(float to_host, float to_device) -> ()", &set_copy_bandwidth);
  m.def("set_compute_scale(float scale) -> ()", &set_compute_scale);
  m.def("simulation_parameters() -> float[]", &simulation_parameters);
}

}  // namespace sac_test_accelerator
