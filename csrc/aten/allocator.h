#pragma once
#include <c10/core/CachingDeviceAllocator.h>

#include <array>
#include <cstdint>
#include <mutex>

namespace tpu::aten {

// Storages get unique fake addresses (never dereferenced on the host; safetensors and the Hub
// detect tied weights by pointer) and a StorageState context that owns the PJRT buffer.
class TpuAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  bool initialized() override { return true; }
  // XLA:CPU: returns the freed host memory the process keeps for reuse (pjrt.cc) to the OS.
  void emptyCache(c10::MempoolId_t) override;
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;

  void on_free(int device, size_t nbytes);
  static TpuAllocator& get();

 private:
  // Every allocation is one block of exactly the requested size, so PyTorch's allocated /
  // reserved / active / requested bytes are one number and allocation / active counts another,
  // the same in all three pools: getDeviceStats() expands these.
  struct Counter {
    int64_t current = 0, peak = 0, allocated = 0, freed = 0;
    void add(int64_t delta);
  };
  struct Counters {
    Counter bytes, blocks;
  };
  static constexpr int kMaxDevices = 64;
  std::mutex mu_;
  std::array<Counters, kMaxDevices> stats_{};
  uint64_t next_addr_ = uint64_t{1} << 44;
};

}  // namespace tpu::aten
