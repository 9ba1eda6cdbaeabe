// copy_ between any pair of (cpu, tpu:i) with any dtypes and strides. Device-side conversions
// and strided writes go through the "copy" lowering, so they share the view machinery.
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include "common.h"
#include "eager_dynamic.h"
#include "ops_runtime.h"
#include "plan_call.h"
#include "runtime/context.h"
#include "runtime/device_checks.h"
#include "runtime/profiler.h"

namespace tpu::aten {

using shlo::ElemType;

namespace {

int64_t elem_bytes(ElemType t) { return t == ElemType::Pred ? 1 : shlo::bit_width(t) / 8; }

at::Tensor empty_tpu_like(const at::Tensor& t, int device) {
  c10::DeviceGuard g(c10::Device(kTpu, static_cast<c10::DeviceIndex>(device)));
  return at::empty(t.sizes(), t.options().device(c10::Device(kTpu, static_cast<c10::DeviceIndex>(device))));
}

void device_copy(const at::Tensor& dst, const at::Tensor& src) {
  const lowering::OpEntry* e = lowering::find_op("copy");
  TORCH_INTERNAL_ASSERT(e, "torch_tpu: the copy lowering is missing");
  run_lowering("copy", "", *e, {{"src", src}}, {dst}, src.scalar_type());
}

// A host read raises the first failed device-side check, as the exception type of PyTorch's CPU
// kernel (IndexError or RuntimeError).
void raise_device_errors() {
  try {
    runtime::check_device_errors();
  } catch (const runtime::DeviceCheckError& e) {
    throw_device_check(e.kind, e.what());
  }
}

// Contiguous host copy of a tpu tensor (same dtype).
at::Tensor to_host(const at::Tensor& src) {
  raise_device_errors();
  runtime::StorageState& st = state_of(src);
  at::Tensor host = at::empty(src.sizes(), src.options().device(c10::kCPU));
  if (src.numel() == 0) return host;
  ElemType e = elem_of(src.scalar_type());
  int64_t n = static_cast<int64_t>(st.nbytes) / elem_bytes(e);
  bool same_width = st.buffer && shlo::bit_width(st.elem) == shlo::bit_width(e) &&
                    (st.elem == ElemType::Pred) == (e == ElemType::Pred) &&
                    shlo::is_complex(st.elem) == shlo::is_complex(e);
  if (!st.buffer) {  // never written: uninitialized memory reads as zeros
    host.zero_();
    return host;
  }
  if (!same_width) {
    // Reinterpret across widths on the host: pull the raw storage bytes, view them.
    at::Tensor raw = at::empty({static_cast<int64_t>(st.nbytes)}, at::TensorOptions().dtype(at::kByte));
    runtime::prof::Range prof_range("d2h");  // a host sync
    st.buffer->to_host(raw.data_ptr(), st.nbytes);
    dispatch_stats().host_syncs++;
    at::Tensor typed = raw.view(src.scalar_type());
    host.copy_(typed.as_strided(src.sizes(), src.strides(), src.storage_offset()));
    return host;
  }
  bool whole = src.is_contiguous() && src.storage_offset() == 0 && src.numel() == n && st.elem == e;
  if (!whole && st.elem == e && eager_dynamic::is_marked(src)) {
    // A view of a mark_dynamic bucket buffer (a prefix of it): read the whole buffer and slice on
    // the host, instead of compacting on the device (one program per real shape).
    at::Tensor raw = at::empty({n}, src.options().device(c10::kCPU));
    runtime::prof::Range prof_range("d2h");  // a host sync
    st.buffer->to_host(raw.data_ptr(), static_cast<size_t>(n) * raw.itemsize());
    dispatch_stats().host_syncs++;
    host.copy_(raw.as_strided(src.sizes(), src.strides(), src.storage_offset()));
    return host;
  }
  at::Tensor dev = src;
  if (!whole) {
    dev = empty_tpu_like(src, src.device().index());
    device_copy(dev, src);
    fused_flush(runtime::FlushReason::HostTransfer);  // the buffer is read below
  }
  runtime::StorageState& ds = state_of(dev);
  runtime::prof::Range prof_range("d2h");  // a host sync
  ds.buffer->to_host(host.data_ptr(), static_cast<size_t>(host.numel()) * host.itemsize());
  dispatch_stats().host_syncs++;
  return host;
}

// Fresh tpu tensor on `device` holding the (contiguous) host tensor's values.
at::Tensor from_host(const at::Tensor& host_in, int device) {
  at::Tensor host = host_in.contiguous();
  at::Tensor dev = empty_tpu_like(host, device);
  if (host.numel() == 0) return dev;
  ElemType e = elem_of(host.scalar_type());
  runtime::StorageState& st = state_of(dev);
  auto& ctx = runtime::Context::get();
  runtime::prof::Range prof_range("h2d");
  // The buffer takes the tensor's shape (runtime/storage.h): programs read it as it is.
  auto buf = ctx.client().from_host(host.data_ptr(), pjrt_of(e), host.sizes().vec(), ctx.device(device));
  std::lock_guard<std::mutex> lock(st.mu);
  st.hold(std::move(buf), e, host.sizes());
  return dev;
}

}  // namespace

void throw_device_check(int kind, const char* msg) {
  if (kind == 1) TORCH_CHECK_INDEX(false, msg);
  TORCH_CHECK(false, msg);
}

bool read_single_element(const at::Tensor& src, void* out) {
  runtime::StorageState& st = state_of(src);
  if (src.storage_offset() != 0 || st.nbytes != static_cast<size_t>(src.itemsize())) return false;
  runtime::Context::check_not_forked();  // as copy_into: a host read, a sync point
  fused_flush(runtime::FlushReason::HostTransfer);
  ElemType e = elem_of(src.scalar_type());
  raise_device_errors();
  if (!st.buffer || st.elem != e) return false;
  runtime::prof::Range prof_range("d2h");  // a host sync
  st.buffer->to_host(out, st.nbytes);
  dispatch_stats().host_syncs++;
  return true;
}

void copy_into(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.defined() && src.defined(), "copy_: undefined tensor");
  if (dst.numel() == 0) return;
  bool dst_tpu = dst.device().type() == kTpu, src_tpu = src.device().type() == kTpu;
  runtime::Context::check_not_forked();  // host reads touch buffers without the client
  // Host transfers and cross-chip copies touch buffers directly: a sync point for fused eager.
  if (!dst_tpu || !src_tpu || dst.device() != src.device()) fused_flush(runtime::FlushReason::HostTransfer);
  if (dst_tpu) elem_of(dst.scalar_type());  // clear error for unsupported dtypes
  if (src_tpu) elem_of(src.scalar_type());
  if (!dst_tpu && src_tpu) {
    at::Tensor host = to_host(src);
    dst.copy_(host);
    return;
  }
  if (dst_tpu && !src_tpu) {
    TORCH_CHECK(src.device().is_cpu(), "copy_: cannot copy from ", src.device(), " to ", dst.device());
    // Convert on the host (PyTorch's own cast semantics), then upload once.
    at::Tensor h = src.to(dst.scalar_type());
    runtime::StorageState& st = state_of(dst);
    ElemType e = elem_of(dst.scalar_type());
    bool whole = dst.is_contiguous() && dst.storage_offset() == 0 && h.sizes() == dst.sizes() &&
                 static_cast<size_t>(dst.numel()) * dst.itemsize() == st.nbytes;
    if (whole) {
      h = h.contiguous();
      auto& ctx = runtime::Context::get();
      runtime::prof::Range prof_range("h2d");
      auto buf = ctx.client().from_host(h.data_ptr(), pjrt_of(e), h.sizes().vec(), ctx.device(st.device));
      std::lock_guard<std::mutex> lock(st.mu);
      st.hold(std::move(buf), e, h.sizes());
      return;
    }
    device_copy(dst, from_host(h, dst.device().index()));
    return;
  }
  TORCH_CHECK(dst_tpu && src_tpu, "copy_: unsupported devices ", src.device(), " -> ", dst.device());
  if (dst.device().index() != src.device().index()) {
    // Cross-chip: contiguous on the source chip, PJRT device-to-device copy, then write.
    at::Tensor c = src;
    runtime::StorageState& ss = state_of(src);
    ElemType e = elem_of(src.scalar_type());
    if (!(src.is_contiguous() && src.storage_offset() == 0 && ss.buffer && ss.elem == e &&
          static_cast<size_t>(src.numel()) * src.itemsize() == ss.nbytes)) {
      c = empty_tpu_like(src, src.device().index());
      device_copy(c, src);
      fused_flush(runtime::FlushReason::HostTransfer);  // the buffer is read below
    }
    at::Tensor moved = empty_tpu_like(src, dst.device().index());
    auto& ctx = runtime::Context::get();
    const runtime::StorageState& cs = state_of(c);
    auto buf = cs.buffer->copy_to_device(ctx.device(dst.device().index()));  // keeps the dims
    runtime::StorageState& ms = state_of(moved);
    ms.hold(std::move(buf), e, cs.dims);
    device_copy(dst, moved);
    return;
  }
  device_copy(dst, src);
}

}  // namespace tpu::aten
