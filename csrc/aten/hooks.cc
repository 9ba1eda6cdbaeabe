// PrivateUse1 hooks: what torch.accelerator, autograd and the generic device code ask of a
// backend. Registered when the extension loads (before Python renames PrivateUse1 to "tpu").
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <memory>

#include "allocator.h"
#include "common.h"
#include "generator.h"
#include "runtime/context.h"

namespace tpu::aten {

namespace {
struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override {
    try {
      return runtime::Context::get().device_count() > 0;
    } catch (...) {
      return false;
    }
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex idx) const override {
    return default_generator(idx);
  }
  at::Generator getNewGenerator(c10::DeviceIndex idx) const override {
    return at::make_generator<TpuGenerator>(idx < 0 ? 0 : idx);
  }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kTpu, 0); }
  bool isPinnedPtr(const void*) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  c10::DeviceIndex deviceCount() const override {
    return c10::impl::getDeviceGuardImpl(kTpu)->deviceCount();
  }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    c10::impl::getDeviceGuardImpl(kTpu)->setDevice(c10::Device(kTpu, d));
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return c10::impl::getDeviceGuardImpl(kTpu)->getDevice().index();
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    return c10::impl::getDeviceGuardImpl(kTpu)->exchangeDevice(c10::Device(kTpu, d)).index();
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override;
};
}  // namespace

void resize_storage_bytes(const c10::Storage& storage, size_t newsize);  // ops_runtime.cc

void TpuHooks::resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const {
  resize_storage_bytes(storage, newsize);
}

void register_lowered_kernels();  // dispatch.cc

void register_hooks() {
  static bool done = false;
  if (done) return;
  done = true;
  register_lowered_kernels();
  static TpuHooks* hooks = std::make_unique<TpuHooks>().release();  // process lifetime
  at::RegisterPrivateUse1HooksInterface(hooks);
}

}  // namespace tpu::aten
