// Metadata-only and storage ops registered for tpu (empty, views, resize_, set_, ...).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstddef>

namespace tpu::aten {

// Grows a storage to `newsize` bytes keeping its contents (resize_, torch's storage resize hook).
void resize_storage_bytes(const c10::Storage& storage, size_t newsize);

// `.item()` of a tpu tensor that is its whole one-element storage (a reduction's result): its
// bytes (at most 16) read straight into `out`, without the host tensors of the general copy.
// False (nothing read): take the general path. Defined in copy.cc.
bool read_single_element(const at::Tensor& src, void* out);

}  // namespace tpu::aten
