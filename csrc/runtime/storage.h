// The device side of one PyTorch storage: the current PJRT buffer holding its bytes (flat 1-D,
// typed), swapped for a new buffer by every write (the old one is donated to the writing
// program so XLA updates in place). Lives as the DataPtr context of the storage.
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "pjrt/pjrt.h"
#include "stablehlo/builder.h"

namespace tpu::runtime {

// PJRT's element type for a StableHLO element type.
pjrt::ElementType pjrt_of(shlo::ElemType t);

struct StorageState {
  StorageState(int dev, size_t bytes) : device(dev), nbytes(bytes) {}
  int device;
  size_t nbytes;
  std::mutex mu;              // guards buffer/elem swaps
  pjrt::BufferPtr buffer;     // null until the first write ("uninitialized memory")
  shlo::ElemType elem = shlo::ElemType::U8;  // element type of `buffer`
  // Fused eager (runtime/executor.cc, under its pending-program lock): this storage's id in the
  // pending program, valid while fused_epoch equals the program's epoch (0: never recorded).
  int fused_id = -1;
  uint64_t fused_epoch = 0;
};

}  // namespace tpu::runtime
