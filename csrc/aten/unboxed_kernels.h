// Typed (unboxed) PrivateUse1 kernels for the hottest ATen overloads (elementwise arithmetic,
// comparisons, where, their in-place and out= forms, a few reductions and matmuls).
//
// Why: for a boxed-only kernel the dispatcher copies every tensor argument into an IValue
// stack, and in PyTorch 2.13 copying a tensor that only Python holds takes the GIL
// (TensorImpl::incref_pyobject when the count goes 1 -> 2), and so does dropping the copy.
// Python bindings release the GIL around dispatch, so each such argument costs two GIL round
// trips that PyTorch's own CPU kernels do not pay.
//
// These kernels are no second implementation of any op: each views its arguments as IValues
// that borrow the caller's tensors (no reference count change) and asks the same dispatch
// cache the boxed kernel asks (aten/dispatch.h serve_from_cache: same signature, plan and
// launch). Everything else — a cache miss, an uncacheable call, a call reading a mark_dynamic
// storage — is boxed as before and runs tpu_boxed_kernel.
#pragma once
#include <cstdint>
#include <string>

namespace torch {
class Library;
}

namespace tpu::aten {

// Registers the typed kernel of ATen overload `overload` ("add.Tensor") into `lib` (an aten
// PrivateUse1 IMPL library); false when the overload has none (the caller registers the boxed one).
bool register_unboxed_kernel(torch::Library& lib, const std::string& overload);

// Off: the typed kernels box every call (tests compare both paths in one process).
void set_unboxed_fast_path(bool on);
bool unboxed_fast_path();

// Calls of the typed kernels the dispatch cache served without boxing, calls they boxed, and
// how many overloads were registered with a typed kernel.
struct UnboxedStats {
  int64_t served = 0, boxed = 0, registered = 0;
};
UnboxedStats unboxed_stats();

}  // namespace tpu::aten
