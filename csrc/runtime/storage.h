// The device side of one PyTorch storage: the current PJRT buffer holding its bytes, swapped for
// a new buffer by every write (the old one is donated to the writing program so XLA updates in
// place). Lives as the DataPtr context of the storage.
//
// The buffer keeps the logical shape of the last program output that wrote the whole storage
// (`dims`, row-major; product(dims) * element bytes == nbytes): a program returns a full write in
// the shape it computed it (a [64, 4096] result stays tensor<64x4096>, no reshape to 1-D, so XLA
// emits the fusion over its real dims), and a later program whose view is exactly that shape
// takes the buffer as its parameter unchanged. Any other view reshapes the parameter to [n] (a
// bitcast in XLA) and addresses it flat (runtime/view_io.h). A partial write keeps the dims.
// Device -> host copies are byte copies either way (row-major default layout).
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include <c10/util/SmallVector.h>

#include "pjrt/pjrt.h"
#include "stablehlo/builder.h"

namespace tpu::runtime {

// A buffer's dims: inline up to 6 (copying them per op allocates nothing).
using Dims = c10::SmallVector<int64_t, 6>;

// PJRT's element type for a StableHLO element type.
pjrt::ElementType pjrt_of(shlo::ElemType t);

struct StorageState {
  StorageState(int dev, size_t bytes) : device(dev), nbytes(bytes) {}
  int device;
  size_t nbytes;
  std::mutex mu;              // guards buffer/elem/dims swaps
  pjrt::BufferPtr buffer;     // null until the first write ("uninitialized memory")
  shlo::ElemType elem = shlo::ElemType::U8;  // element type of `buffer`
  Dims dims;                                 // dims of `buffer` (see above)
  // Fused eager (runtime/executor.cc, under its pending-program lock): this storage's id in the
  // pending program, valid while fused_epoch equals the program's epoch (0: never recorded).
  int fused_id = -1;
  uint64_t fused_epoch = 0;

  // Takes a new buffer (the caller holds `mu`, or owns the storage alone). With
  // TORCH_TPU_CHECK_STORAGE_DIMS=1 the buffer's own dims and byte size are checked against
  // `d` and nbytes (a test switch: it asks PJRT for the dims on every write).
  template <class Dims>
  void hold(pjrt::BufferPtr b, shlo::ElemType e, const Dims& d) {
    buffer = std::move(b);
    elem = e;
    dims.assign(d.begin(), d.end());
    if (check_dims_enabled()) check_dims();
  }
  void hold(pjrt::BufferPtr b, shlo::ElemType e, std::initializer_list<int64_t> d) {
    hold(std::move(b), e, std::vector<int64_t>(d));
  }
  static bool check_dims_enabled();
  void check_dims() const;  // throws std::logic_error on a mismatch
};

}  // namespace tpu::runtime
