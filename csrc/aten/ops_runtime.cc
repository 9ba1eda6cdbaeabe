// Kernels that are about storage and metadata rather than math: factories of uninitialized
// memory, views (metadata only, no device work), resize/set_, copies between devices, reading
// a scalar back to the host.
#include <ATen/Dispatch_v2.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/SDPBackend.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cstring>

#include <ATen/ops/_copy_from_and_resize_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>

#include "ops_runtime.h"
#include "allocator.h"
#include "common.h"
#include "plan_call.h"
#include "runtime/compile_cache.h"
#include "runtime/context.h"
#include "runtime/executor.h"

namespace tpu::aten {

using shlo::ElemType;


namespace {

c10::DeviceIndex device_index(std::optional<c10::Device> d) {
  if (d && d->has_index()) return d->index();
  return c10::impl::getDeviceGuardImpl(kTpu)->getDevice().index();
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> mf) {
  c10::DeviceGuard g(c10::Device(kTpu, device_index(device)));
  return at::detail::empty_generic(size, &TpuAllocator::get(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), mf);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout>,
                         std::optional<c10::Device> device, std::optional<bool>) {
  c10::DeviceGuard g(c10::Device(kTpu, device_index(device)));
  return at::detail::empty_strided_generic(size, stride, &TpuAllocator::get(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size_sym,
                          std::optional<c10::MemoryFormat> mf) {
  auto size = C10_AS_INTARRAYREF_SLOW(size_sym);
  int64_t numel = 1;
  for (int64_t s : size) {
    TORCH_CHECK(s >= 0, "Trying to create tensor with negative dimension ", s, ": ", size);
    numel *= s;
  }
  size_t need = static_cast<size_t>(self.storage_offset() + numel) * self.itemsize();
  if (numel > 0 && need > self.storage().nbytes()) resize_storage_bytes(self.storage(), need);
  self.unsafeGetTensorImpl()->set_sizes_contiguous(size);
  if (mf && *mf != c10::MemoryFormat::Preserve)
    self.unsafeGetTensorImpl()->empty_tensor_restride(*mf);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage src, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  TORCH_CHECK(src.device_type() == kTpu, "set_: expected a tpu storage, got ", src.device());
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(src));
  self.unsafeGetTensorImpl()->set_storage_offset(offset);
  if (stride.empty()) {
    self.unsafeGetTensorImpl()->set_sizes_contiguous(size);
  } else {
    self.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride);
  }
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage src) {
  int64_t n = static_cast<int64_t>(src.nbytes()) / static_cast<int64_t>(self.itemsize());
  return set_storage(self, std::move(src), 0, {n}, {});
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage src, c10::SymInt offset,
                                      c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return set_storage(self, std::move(src), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                     C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  if (self.unsafeGetTensorImpl() == src.unsafeGetTensorImpl()) return self;
  return set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage s(c10::Storage::use_byte_size_t(), 0, &TpuAllocator::get(), true);
  return set_storage(self, std::move(s), 0, {0}, {});
}

// PyTorch's copy_ semantics for the lazy conjugate / negative bits (the Conjugate and Negative
// fallbacks pass copy_ through to the backend): the stored values are copied, then the bit
// difference is applied to the destination.
void apply_bit_difference(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_conj() != src.is_conj()) dst.conj_physical_();
  if (dst.is_neg() != src.is_neg()) dst.neg_();
}

at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool) {
  // CPU's copy_: nothing to do for the same data, else TensorIterator's overlap checks.
  if (self.is_same(src) || (self.is_alias_of(src) && self.storage_offset() == src.storage_offset() &&
                            self.strides() == src.strides() && self.sizes() == src.sizes() &&
                            self.scalar_type() == src.scalar_type()))
    return self;
  check_write_overlap(self, &src, 1);
  copy_into(self, src);
  apply_bit_difference(self, src);
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  copy_into(dst, self);
  apply_bit_difference(dst, self);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.numel() == 0 || dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  copy_into(dst, self);
  apply_bit_difference(dst, self);
  return dst;
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  TORCH_CHECK(self.numel() == 1, "a Tensor with ", self.numel(),
              " elements cannot be converted to Scalar");
  alignas(16) unsigned char bytes[16] = {};
  if (read_single_element(self, bytes)) {  // the same Scalar as CPU's _local_scalar_dense
    using namespace at;  // the dispatch macro names ScalarTypes unqualified
    c10::Scalar r;
    AT_DISPATCH_V2(self.scalar_type(), "_local_scalar_dense_tpu", AT_WRAP([&] {
                     scalar_t value;
                     std::memcpy(&value, bytes, sizeof(scalar_t));
                     r = c10::Scalar(value);
                   }), AT_EXPAND(AT_ALL_TYPES_AND_COMPLEX), kComplexHalf, kHalf, kBool, kBFloat16,
                   AT_EXPAND(AT_FLOAT8_TYPES), AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
    return r;
  }
  at::Tensor host = at::empty({}, self.options().device(c10::kCPU));
  copy_into(host, self.reshape({}));
  return host.item();
}

// SDPA backend for tpu tensors: the fused lowering (csrc/lowering/attention.cc) when it covers
// the call, else math (attention decomposes into lowered matmul/softmax ops). PyTorch asks the
// _fused_sdp_choice_stub (registered below); the op itself answers the same.
int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         std::optional<double>, bool enable_gqa) {
  constexpr auto math = static_cast<int64_t>(at::SDPBackend::math);
  if (!at::globalContext().userEnabledOverrideableSDP()) return math;
  // Traced calls (torch.compile's fake/functional tensors) answer the same: compiled graphs
  // lower the fused op through the same table (dropout reads the generator state there too).
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (!t->defined() || t->device().type() != kTpu || t->is_nested()) return math;
  }
  auto dt = q.scalar_type();
  bool float_type = dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble;
  if (!float_type || k.scalar_type() != dt || v.scalar_type() != dt) return math;
  // Symbolic sizes (dynamic shapes) stay symbolic: the checks guard on relations between sizes
  // (k and v agree, S != 0), never on their values, so Dynamo keeps one graph for every size.
  auto size = [](const at::Tensor& t, int64_t d) { return t.sym_size(d); };
  int64_t r = q.dim();
  if ((r != 3 && r != 4) || k.dim() != r || v.dim() != r) return math;
  if (r == 4 && (size(k, 0) != size(q, 0) || size(v, 0) != size(q, 0))) return math;
  c10::SymInt hq = size(q, -3), hk = size(k, -3), L = size(q, -2), S = size(k, -2);
  if (size(v, -3) != hk || size(v, -2) != S || size(k, -1) != size(q, -1)) return math;
  if (L == 0 || S == 0 || size(q, -1) == 0 || size(v, -1) == 0 || hk == 0) return math;
  // PyTorch's meta of the fused op lays out a 3-d output of another last dim as 4-d (IndexError
  // in alloc_with_matching_layout): those calls decompose instead.
  if (r == 3 && size(v, -1) != size(q, -1)) return math;
  if (hq != hk && !(enable_gqa && hq % hk == 0)) return math;
  if (!(dropout_p >= 0 && dropout_p < 1)) return math;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    if (is_causal || m.is_nested() || m.device() != q.device()) return math;
    if (m.scalar_type() != at::kBool && m.scalar_type() != dt) return math;
    if (m.dim() > r) return math;
    for (int64_t i = 1; i <= m.dim(); ++i) {  // broadcastable to [.., Hq, L, S]
      c10::SymInt want = i == 1 ? S : i == 2 ? L : i == 3 ? hq : size(q, 0);
      if (size(m, -i) != 1 && size(m, -i) != want) return math;
    }
  }
  return static_cast<int64_t>(at::SDPBackend::overrideable);
}

}  // namespace
}  // namespace tpu::aten

// The stub's registration names its type in at::native.
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &tpu::aten::fused_sdp_choice)
}  // namespace at::native

namespace tpu::aten {

void resize_storage_bytes(const c10::Storage& storage, size_t newsize) {
  fused_flush();
  runtime::StorageState& old = state_of(storage);
  c10::DeviceGuard g(c10::Device(kTpu, static_cast<c10::DeviceIndex>(old.device)));
  c10::DataPtr fresh = TpuAllocator::get().allocate(newsize);
  auto* st = static_cast<runtime::StorageState*>(fresh.get_context());
  if (old.buffer) {
    // Keep the old bytes: pad (or cut) the flat elements to the new length, on the device.
    int64_t w = old.elem == ElemType::Pred ? 1 : shlo::bit_width(old.elem) / 8;
    int64_t on = static_cast<int64_t>(old.nbytes) / w, nn = static_cast<int64_t>(newsize) / w;
    if (static_cast<int64_t>(newsize) % w == 0) {
      shlo::Builder b;
      shlo::Value x = b.reshape(b.arg(shlo::Type{old.elem, shlo::Shape(old.dims.begin(), old.dims.end())}), {on});
      shlo::Value y = nn >= on ? b.pad(x, b.zeros(shlo::Type{old.elem, {}}), {0}, {nn - on})
                               : b.slice(x, {0}, {nn});
      auto exe = runtime::CompileCache::get().get_or_compile(b.module({y}), "resize_", "resize");
      auto outs = runtime::Executor::get().launch(*exe, old.device, {old.buffer->raw()}, {}, "resize_");
      st->hold(outs[0], old.elem, {nn});
    } else {
      TORCH_CHECK(false, "torch_tpu: cannot resize a storage to a size that is not a multiple of "
                  "its element size");
    }
  }
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
  storage.unsafeGetStorageImpl()->set_nbytes(newsize);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  // Dtype views between complex and its real pairs: metadata only; a storage read as the other
  // type is retyped on the device (aten/plan_call.cc retype_storage).
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("copy_", copy_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("_fused_sdp_choice", fused_sdp_choice);
}

}  // namespace tpu::aten
