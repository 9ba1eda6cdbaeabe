#include "hooks.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <memory>

#include "allocator.h"
#include "common.h"
#include "dispatch.h"
#include "generator.h"
#include "ops_runtime.h"
#include "runtime/context.h"

namespace tpu::aten {

bool TpuHooks::isBuilt() const { return true; }

bool TpuHooks::isAvailable() const {
  try {
    return runtime::Context::get().device_count() > 0;
  } catch (...) {
    return false;
  }
}

bool TpuHooks::hasPrimaryContext(c10::DeviceIndex) const { return true; }

const at::Generator& TpuHooks::getDefaultGenerator(c10::DeviceIndex idx) const {
  return default_generator(idx);
}

at::Generator TpuHooks::getNewGenerator(c10::DeviceIndex idx) const {
  return at::make_generator<TpuGenerator>(idx < 0 ? 0 : idx);
}

at::Device TpuHooks::getDeviceFromPtr(void*) const { return c10::Device(kTpu, 0); }

bool TpuHooks::isPinnedPtr(const void*) const { return false; }

c10::Allocator* TpuHooks::getPinnedMemoryAllocator() const { return c10::GetCPUAllocator(); }

c10::DeviceIndex TpuHooks::deviceCount() const {
  return c10::impl::getDeviceGuardImpl(kTpu)->deviceCount();
}

void TpuHooks::setCurrentDevice(c10::DeviceIndex d) const {
  c10::impl::getDeviceGuardImpl(kTpu)->setDevice(c10::Device(kTpu, d));
}

c10::DeviceIndex TpuHooks::getCurrentDevice() const {
  return c10::impl::getDeviceGuardImpl(kTpu)->getDevice().index();
}

c10::DeviceIndex TpuHooks::exchangeDevice(c10::DeviceIndex d) const {
  return c10::impl::getDeviceGuardImpl(kTpu)->exchangeDevice(c10::Device(kTpu, d)).index();
}

c10::DeviceIndex TpuHooks::maybeExchangeDevice(c10::DeviceIndex d) const { return exchangeDevice(d); }

void TpuHooks::resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const {
  resize_storage_bytes(storage, newsize);
}

void register_hooks() {
  static bool done = false;
  if (done) return;
  done = true;
  register_lowered_kernels();
  static TpuHooks* hooks = std::make_unique<TpuHooks>().release();  // process lifetime
  at::RegisterPrivateUse1HooksInterface(hooks);
}

}  // namespace tpu::aten
