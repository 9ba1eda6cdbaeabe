// Device guard (c10::impl::DeviceGuardImplInterface) for PrivateUse1: a thread-local current
// device and one (default) stream per device. PJRT orders work by buffer dependencies, so streams
// carry no extra semantics; synchronize waits for all launched work.
#pragma once
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace tpu::aten {

struct TpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override;
  c10::Device exchangeDevice(c10::Device d) const override;
  c10::Device getDevice() const override;
  void setDevice(c10::Device d) const override;
  void uncheckedSetDevice(c10::Device d) const noexcept override;
  c10::Stream getStream(c10::Device d) const override;
  c10::Stream getDefaultStream(c10::Device d) const override;
  c10::Stream getNewStream(c10::Device d, int) const override;
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override;
  c10::Stream exchangeStream(c10::Stream s) const override;
  c10::DeviceIndex deviceCount() const noexcept override;
  bool queryStream(const c10::Stream&) const override;
  void synchronizeStream(const c10::Stream&) const override;
  void synchronizeDevice(const c10::DeviceIndex) const override;
  // Events: a recorded event is "everything launched so far". A timing event (torch.Event(
  // enable_timing=True), EventFlag::BACKEND_DEFAULT as CUDA's) waits for that work at record and
  // keeps the host time: one in-order stream, so the difference is the device time in between.
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override;
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override;
  void block(void*, const c10::Stream&) const override;
  bool queryEvent(void*) const override;
  void synchronizeEvent(void*) const override;
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override;
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override;
};

}  // namespace tpu::aten
