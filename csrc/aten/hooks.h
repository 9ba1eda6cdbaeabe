// PrivateUse1 hooks (at::PrivateUse1HooksInterface): what torch.accelerator, autograd and the
// generic device code ask of a backend. Registered when the extension loads (before Python
// renames PrivateUse1 to "tpu").
#pragma once
#include <ATen/detail/PrivateUse1HooksInterface.h>

namespace tpu::aten {

struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override;
  bool isAvailable() const override;
  bool hasPrimaryContext(c10::DeviceIndex) const override;
  const at::Generator& getDefaultGenerator(c10::DeviceIndex idx) const override;
  at::Generator getNewGenerator(c10::DeviceIndex idx) const override;
  at::Device getDeviceFromPtr(void*) const override;
  bool isPinnedPtr(const void*) const override;
  c10::Allocator* getPinnedMemoryAllocator() const override;
  c10::DeviceIndex deviceCount() const override;
  void setCurrentDevice(c10::DeviceIndex d) const override;
  c10::DeviceIndex getCurrentDevice() const override;
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override;
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override;
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override;
};

// Registers the hooks and the lowered kernels (once).
void register_hooks();

}  // namespace tpu::aten
