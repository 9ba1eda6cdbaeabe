// tpu_dist::host_view: a CPU tensor aliasing a tpu tensor's PJRT buffer, when device memory IS
// host memory (the CPU plugin). Collectives then run gloo on the buffer itself: no device<->host
// copies. Returns an undefined tensor (None in Python) whenever aliasing is not safe, and the
// caller stages through copies instead.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include "aten/common.h"
#include "runtime/executor.h"
#include "runtime/context.h"

namespace {

using tpu::pjrt::BufferPtr;

void external_ref(const tpu::pjrt::Api& api, PJRT_Buffer* b, bool increase) {
  if (increase) {
    PJRT_Buffer_IncreaseExternalReferenceCount_Args a{};
    a.struct_size = PJRT_Buffer_IncreaseExternalReferenceCount_Args_STRUCT_SIZE;
    a.buffer = b;
    api.check(api.raw()->PJRT_Buffer_IncreaseExternalReferenceCount(&a), "IncreaseExternalReferenceCount");
  } else {
    PJRT_Buffer_DecreaseExternalReferenceCount_Args a{};
    a.struct_size = PJRT_Buffer_DecreaseExternalReferenceCount_Args_STRUCT_SIZE;
    a.buffer = b;
    api.check(api.raw()->PJRT_Buffer_DecreaseExternalReferenceCount(&a), "DecreaseExternalReferenceCount");
  }
}

// writable: the caller will write the buffer in place (in-place collectives), so the buffer must
// not be shared with another storage or an in-flight program.
at::Tensor host_view(const at::Tensor& t, bool writable) {
  auto& ctx = tpu::runtime::Context::get();
  auto& client = ctx.client();
  if (client.platform_name() != "cpu") return {};
  if (t.numel() == 0 || !t.is_contiguous() || t.storage_offset() != 0) return {};
  if (!tpu::aten::supported_dtype(t.scalar_type())) return {};
  tpu::runtime::StorageState& st = tpu::aten::state_of(t);
  if (static_cast<size_t>(t.numel()) * t.itemsize() != st.nbytes) return {};
  tpu::runtime::fused_flush();  // the storage's pending value becomes its buffer
  BufferPtr buf;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    buf = st.buffer;
    if (!buf || st.elem != tpu::aten::elem_of(t.scalar_type())) return {};
    if (writable && buf.use_count() != 2) return {};  // the storage's reference and ours only
  }
  buf->wait_ready();
  const tpu::pjrt::Api& api = client.api();
  external_ref(api, buf->raw(), true);  // PJRT will not donate or free it while we hold this
  PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args p{};
  p.struct_size = PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args_STRUCT_SIZE;
  p.buffer = buf->raw();
  PJRT_Error* err = api.raw()->PJRT_Buffer_OpaqueDeviceMemoryDataPointer(&p);
  if (err) {
    external_ref(api, buf->raw(), false);
    api.check(err, "OpaqueDeviceMemoryDataPointer");
  }
  auto keep = std::make_shared<BufferPtr>(buf);
  const tpu::pjrt::Api* api_ptr = &api;
  return at::from_blob(
      p.device_memory_ptr, t.sizes(),
      [keep, api_ptr](void*) {
        try {
          external_ref(*api_ptr, (*keep)->raw(), false);
        } catch (...) {  // a deleter must not throw; the buffer is freed with `keep` anyway
        }
      },
      at::TensorOptions().dtype(t.dtype()).device(at::kCPU));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpu_dist, m) {
  m.def("host_view(Tensor t, bool writable) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpu_dist, PrivateUse1, m) { m.impl("host_view", &host_view); }
