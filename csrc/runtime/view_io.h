// Reading and writing strided views of a storage inside a program (DESIGN §4). A storage is one
// flat 1-D device buffer; a tensor is (sizes, strides, offset) over it. Reads become prologues
// (slice/reshape/transpose/broadcast when the strides allow, a gather otherwise) and writes
// become epilogues (reshape, dynamic-update-slice, or scatter) that XLA fuses with the op.
#pragma once
#include <cstdint>
#include <vector>

#include "stablehlo/builder.h"

namespace tpu::runtime {

struct ViewDesc {
  shlo::ElemType elem;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  int64_t numel() const;
  // True when the view is exactly the whole storage of `storage_numel` elements, row-major.
  bool covers(int64_t storage_numel) const;
};

// `storage` has shape [storage_numel] and any element type of the same bit width as v.elem.
shlo::Value read_view(shlo::Builder& b, shlo::Value storage, const ViewDesc& v);
// Returns the new storage value after writing `value` (logical shape v.sizes) through the view.
// `storage` may be a null Value (id < 0) only when v.covers(storage_numel).
shlo::Value write_view(shlo::Builder& b, shlo::Value storage, shlo::Value value, const ViewDesc& v,
                       int64_t storage_numel, shlo::ElemType storage_elem);

}  // namespace tpu::runtime
