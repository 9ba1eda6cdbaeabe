#include "allocator.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <malloc.h>

#include <fstream>
#include <memory>
#include <string>

#include "common.h"
#include "plan_call.h"
#include "runtime/context.h"

namespace tpu::aten {

namespace {
void delete_state(void* ctx) {
  std::unique_ptr<runtime::StorageState> owned(static_cast<runtime::StorageState*>(ctx));
  fused_forget(owned.get());  // a pending fused program must not write into freed state
  TpuAllocator::get().on_free(owned->device, owned->nbytes);
}

void fill(c10::CachingDeviceAllocator::StatArray& out, const c10::CachingDeviceAllocator::Stat& s) {
  for (auto& o : out) o = s;
}
// Host memory as the capacity of CPU-plugin devices (they allocate from it).
std::pair<size_t, size_t> host_meminfo() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  size_t value = 0, total = 0, avail = 0;
  std::string unit;
  while (f >> key >> value >> unit) {
    if (key == "MemTotal:") total = value * 1024;
    if (key == "MemAvailable:") avail = value * 1024;
  }
  return {avail, total};
}
}  // namespace

void TpuAllocator::Counter::add(int64_t delta) {
  current += delta;
  if (delta > 0) allocated += delta; else freed -= delta;
  peak = std::max(peak, current);
}

TpuAllocator& TpuAllocator::get() {
  static TpuAllocator* a = std::make_unique<TpuAllocator>().release();  // process lifetime
  return *a;
}

c10::DataPtr TpuAllocator::allocate(size_t nbytes) {
  int device = 0;
  if (auto idx = c10::impl::getDeviceGuardImpl(kTpu)->getDevice().index(); idx >= 0) device = idx;
  // Capacity is fixed per process; query it once (reading /proc/meminfo per op is costly).
  static const size_t total = getMemoryInfo(device).second;
  uint64_t addr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& st = stats_.at(device);
    int64_t in_use = st.bytes.current;
    if (nbytes > 0 && static_cast<size_t>(in_use) + nbytes > total) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "tpu out of memory: tried to allocate ", nbytes,
                       " bytes on tpu:", device, " with ", in_use, " bytes in use of ", total,
                       " total. Free tensors (del + torch.tpu.empty_cache()) or use smaller "
                       "batches.");
    }
    addr = next_addr_;
    next_addr_ += ((nbytes + 63) / 64) * 64 + 64;  // unique, 64-byte aligned, never reused
    st.bytes.add(static_cast<int64_t>(nbytes));
    st.blocks.add(1);
  }
  auto state = std::make_unique<runtime::StorageState>(device, nbytes);
  return {reinterpret_cast<void*>(addr), state.release(), &delete_state,
          c10::Device(kTpu, static_cast<c10::DeviceIndex>(device))};
}

void TpuAllocator::on_free(int device, size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& st = stats_.at(device);
  st.bytes.add(-static_cast<int64_t>(nbytes));
  st.blocks.add(-1);
}

void TpuAllocator::emptyCache(c10::MempoolId_t) {
  auto& ctx = runtime::Context::get();
  if (ctx.initialized() && ctx.client().platform_name() == "cpu") malloc_trim(0);
}

void TpuAllocator::copy_data(void*, const void*, std::size_t) const {
  TORCH_CHECK(false, "torch_tpu: device memory is not host-addressable; use Tensor.copy_ instead");
}

c10::CachingDeviceAllocator::DeviceStats TpuAllocator::getDeviceStats(c10::DeviceIndex device) {
  Counters c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    c = stats_.at(device < 0 ? 0 : device);
  }
  auto stat = [](const Counter& k) {
    c10::CachingDeviceAllocator::Stat s{};
    s.current = k.current;
    s.peak = k.peak;
    s.allocated = k.allocated;
    s.freed = k.freed;
    return s;
  };
  c10::CachingDeviceAllocator::DeviceStats out{};
  for (auto* arr : {&out.allocated_bytes, &out.reserved_bytes, &out.active_bytes, &out.requested_bytes})
    fill(*arr, stat(c.bytes));
  fill(out.allocation, stat(c.blocks));
  fill(out.active, stat(c.blocks));
  return out;
}

void TpuAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& st = stats_.at(device < 0 ? 0 : device);
  for (Counter* k : {&st.bytes, &st.blocks}) k->allocated = k->freed = 0;
}

void TpuAllocator::resetPeakStats(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& st = stats_.at(device < 0 ? 0 : device);
  for (Counter* k : {&st.bytes, &st.blocks}) k->peak = k->current;
}

std::pair<size_t, size_t> TpuAllocator::getMemoryInfo(c10::DeviceIndex device) {
  auto& ctx = runtime::Context::get();
  int64_t in_use = 0, limit = -1;
  if (ctx.initialized() && ctx.client().platform_name() != "cpu" &&
      ctx.client().memory_stats(ctx.device(device < 0 ? 0 : device), &in_use, &limit) && limit > 0) {
    return {static_cast<size_t>(limit - in_use), static_cast<size_t>(limit)};
  }
  return host_meminfo();
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &TpuAllocator::get());

}  // namespace tpu::aten
