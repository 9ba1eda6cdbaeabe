// Device guard: a thread-local current device and one (default) stream per device. PJRT orders
// work by buffer dependencies, so streams carry no extra semantics; synchronize waits for all
// launched work.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "common.h"
#include "plan_call.h"
#include "runtime/context.h"
#include "runtime/executor.h"

namespace tpu::aten {

namespace {
thread_local c10::DeviceIndex current_device = 0;

struct TpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kTpu, current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kTpu, "expected a tpu device, got ", d);
    if (d.index() < 0) return;
    int n = deviceCount();
    TORCH_CHECK(d.index() < n, "tpu device index ", static_cast<int>(d.index()),
                " is out of range: there are ", n,
                " tpu devices (set TORCH_TPU_NUM_DEVICES to emulate more on the CPU plugin)");
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return static_cast<c10::DeviceIndex>(runtime::Context::get().device_count());
    } catch (...) {
      return 0;
    }
  }
  bool queryStream(const c10::Stream&) const override { return runtime::Executor::get().idle(); }
  void synchronizeStream(const c10::Stream&) const override { runtime::Executor::get().synchronize(); }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    fused_flush();
    runtime::Executor::get().synchronize();
  }
  // Events: a recorded event is "everything launched so far"; record = no-op marker.
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return runtime::Executor::get().idle(); }
  void synchronizeEvent(void*) const override { runtime::Executor::get().synchronize(); }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuardImpl);

}  // namespace tpu::aten
