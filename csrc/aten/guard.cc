#include "guard.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <memory>

#include "common.h"
#include "plan_call.h"
#include "runtime/context.h"
#include "runtime/executor.h"

namespace tpu::aten {

namespace {
thread_local c10::DeviceIndex current_device = 0;

// The state behind an event's void* handle (owned by the c10::Event: freed in destroyEvent).
struct TpuEvent {
  bool timing = false;
  bool recorded = false;
  std::chrono::steady_clock::time_point at;
};
}  // namespace

c10::DeviceType TpuGuardImpl::type() const { return kTpu; }

c10::Device TpuGuardImpl::exchangeDevice(c10::Device d) const {
  c10::Device old = getDevice();
  if (d.index() != old.index()) setDevice(d);
  return old;
}

c10::Device TpuGuardImpl::getDevice() const { return c10::Device(kTpu, current_device); }

void TpuGuardImpl::setDevice(c10::Device d) const {
  TORCH_CHECK(d.type() == kTpu, "expected a tpu device, got ", d);
  if (d.index() < 0) return;
  int n = deviceCount();
  TORCH_CHECK(d.index() < n, "tpu device index ", static_cast<int>(d.index()),
              " is out of range: there are ", n,
              " tpu devices (set TORCH_TPU_NUM_DEVICES to emulate more on the CPU plugin)");
  current_device = d.index();
}

void TpuGuardImpl::uncheckedSetDevice(c10::Device d) const noexcept {
  if (d.index() >= 0) current_device = d.index();
}

c10::Stream TpuGuardImpl::getStream(c10::Device d) const {
  return c10::Stream(c10::Stream::DEFAULT, d);
}

c10::Stream TpuGuardImpl::getDefaultStream(c10::Device d) const {
  return c10::Stream(c10::Stream::DEFAULT, d);
}

c10::Stream TpuGuardImpl::getNewStream(c10::Device d, int) const {
  return c10::Stream(c10::Stream::DEFAULT, d);
}

c10::Stream TpuGuardImpl::getStreamFromGlobalPool(c10::Device d, bool) const {
  return c10::Stream(c10::Stream::DEFAULT, d);
}

c10::Stream TpuGuardImpl::exchangeStream(c10::Stream s) const {
  return c10::Stream(c10::Stream::DEFAULT, s.device());
}

c10::DeviceIndex TpuGuardImpl::deviceCount() const noexcept {
  try {
    return static_cast<c10::DeviceIndex>(runtime::Context::get().device_count());
  } catch (...) {
    return 0;
  }
}

// Done = nothing pending and nothing in flight: fused eager's pending ops are launched (not
// waited for) first, so a query never reports unlaunched work as finished.
bool TpuGuardImpl::queryStream(const c10::Stream&) const {
  fused_flush(runtime::FlushReason::Synchronize);
  return runtime::Executor::get().idle();
}

void TpuGuardImpl::synchronizeStream(const c10::Stream&) const { runtime::Executor::get().synchronize(); }

void TpuGuardImpl::synchronizeDevice(const c10::DeviceIndex) const {
  fused_flush(runtime::FlushReason::Synchronize);
  runtime::Executor::get().synchronize();
}

void TpuGuardImpl::record(void** event, const c10::Stream&, const c10::DeviceIndex,
                          const c10::EventFlag flag) const {
  if (!*event) {
    auto e = std::make_unique<TpuEvent>();
    e->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
    *event = e.release();  // destroyEvent takes it back
  }
  auto* e = static_cast<TpuEvent*>(*event);
  if (e->timing) {
    fused_flush(runtime::FlushReason::Synchronize);
    runtime::Executor::get().synchronize();
  }
  e->at = std::chrono::steady_clock::now();
  e->recorded = true;
}

double TpuGuardImpl::elapsedTime(void* start, void* end, const c10::DeviceIndex) const {
  auto* a = static_cast<TpuEvent*>(start);
  auto* b = static_cast<TpuEvent*>(end);
  TORCH_CHECK(a && b && a->recorded && b->recorded,
              "Both events must be recorded before calculating elapsed time.");
  TORCH_CHECK(a->timing && b->timing, "Both events must be created with argument 'enable_timing=True'.");
  // CUDA's elapsed_time waits for the end event; a timing record already waited.
  return std::chrono::duration<double, std::milli>(b->at - a->at).count();
}

void TpuGuardImpl::block(void*, const c10::Stream&) const {}

bool TpuGuardImpl::queryEvent(void*) const {
  fused_flush(runtime::FlushReason::Synchronize);
  return runtime::Executor::get().idle();
}

void TpuGuardImpl::synchronizeEvent(void*) const { runtime::Executor::get().synchronize(); }

void TpuGuardImpl::destroyEvent(void* event, const c10::DeviceIndex) const noexcept {
  std::unique_ptr<TpuEvent> owned(static_cast<TpuEvent*>(event));
}

void TpuGuardImpl::recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const {}

C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuardImpl);

}  // namespace tpu::aten
