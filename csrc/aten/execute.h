// The one path every lowered op takes: named ATen arguments + output tensors -> a cached
// program (prologue reads of the input views, the lowering, epilogue writes into the output
// storages with donation) -> a PJRT launch. Eager dispatch, copies and factories all use it.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

#include "lowering/lowering.h"
#include "runtime/storage.h"

namespace tpu::aten {

struct NamedArg {
  // How to read `value` (an int IValue can be a Scalar, an int, a dtype or a layout).
  enum class Hint { Auto, Scalar, DType, Generator, Ignore };
  std::string name;
  c10::IValue value;
  Hint hint = Hint::Auto;
};

// Runs lowering `name` writing its results into `outs` (tpu tensors, any views). `common` is
// PyTorch's result type for the call. Throws lowering::Unsupported when the lowering refuses.
void run_lowering(const std::string& name, const std::string& overload,
                  const lowering::OpEntry& entry, const std::vector<NamedArg>& args,
                  const std::vector<at::Tensor>& outs, c10::ScalarType common);

// Makes sure the storage has a device buffer (zeros when never written) and returns it.
void materialize(const at::Tensor& t);

// Fused eager: launches the pending program (a sync point); forgets a dying storage.
void fused_flush();
void fused_forget(runtime::StorageState* st);

// Copies between any pair of devices/dtypes/strides (the `copy_` semantics).
void copy_into(const at::Tensor& dst, const at::Tensor& src);

// Host-side counters.
struct DispatchStats {
  int64_t ops = 0;          // lowered op launches
  int64_t host_syncs = 0;   // device -> host reads
};
DispatchStats& dispatch_stats();

}  // namespace tpu::aten
