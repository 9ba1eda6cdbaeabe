// Reading and writing strided views of a storage inside a program (DESIGN §4). A storage is one
// device buffer of any dims (runtime/storage.h), addressed as its flat row-major elements; a
// tensor is (sizes, strides, offset) over them. Reads become prologues
// (slice/reshape/transpose/broadcast when the strides allow, a gather otherwise) and writes
// become epilogues (reshape, dynamic-update-slice, or scatter) that XLA fuses with the op.
#pragma once
#include <cstdint>
#include <optional>
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
  // When the view is every element of the storage in another dim order (a dense permutation at
  // offset 0, such as an output with its input's transposed strides): the storage's dims in
  // memory order, which a write through the view gives the storage.
  std::optional<std::vector<int64_t>> permuted_whole(int64_t storage_numel) const;
};

// `storage` has any shape of storage_numel elements (the storage's dims) and any element type of
// the same bit width as v.elem. A view covering it in its own shape is the value itself.
shlo::Value read_view(shlo::Builder& b, shlo::Value storage, const ViewDesc& v);
// Returns the new storage value after writing `value` (logical shape v.sizes) through the view:
// `value` itself when v.covers(storage_numel) (the storage takes shape v.sizes), `value`
// transposed into memory order when v.permuted_whole(storage_numel) (the storage takes those
// dims), else the old storage updated, in the old storage's shape.
// `storage` may be a null Value (id < 0) only for the first two.
shlo::Value write_view(shlo::Builder& b, shlo::Value storage, shlo::Value value, const ViewDesc& v,
                       int64_t storage_numel, shlo::ElemType storage_elem);

}  // namespace tpu::runtime
