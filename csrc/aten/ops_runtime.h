// Metadata-only and storage ops registered for tpu (empty, views, resize_, set_, ...).
#pragma once
#include <c10/core/Storage.h>

#include <cstddef>

namespace tpu::aten {

// Grows a storage to `newsize` bytes keeping its contents (resize_, torch's storage resize hook).
void resize_storage_bytes(const c10::Storage& storage, size_t newsize);

}  // namespace tpu::aten
