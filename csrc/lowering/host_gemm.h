// The host GEMM (aten/ffi_gemm.cc): PyTorch's CPU mm / addmm / bmm / baddbmm (MKL sgemm) as a typed
// XLA FFI custom call on the CPU plugin. lowering/matmul.cc emits it for float32 products from a
// measured size on (host_gemm_wanted); smaller ones stay XLA dots, which XLA fuses with their
// neighbours and which cost no custom-call overhead.
//
// Operands: a [M,K] (or [B,M,K]), b [K,N] (or [B,K,N]), c: the addend (broadcastable to the
// output) when has_c, else a placeholder. trans_a / trans_b: the operand is passed as the array it
// is a transpose of ([K,M] / [N,K], batched alike), which the handler multiplies through a
// transposed view: a Linear's weight.t() or attention's k.transpose(-2, -1) is never copied.
// Result: alpha * op(a) op(b) (+ beta * c), at::addmm semantics (beta == 0 ignores c).
#pragma once
#include <cstdint>

#include "../stablehlo/builder.h"

namespace tpu::lowering {

inline constexpr const char* kHostGemmTarget = "torch_tpu.gemm";

// Whether a product of `batch` x [m,k] x [k,n] in element type `t` takes the host GEMM now (the
// switches of host_kernels.h and the measured threshold, matmul.cc; never inside a HostGemmOff scope).
bool host_gemm_wanted(shlo::ElemType t, int64_t batch, int64_t m, int64_t k, int64_t n);

// While alive, lowerings on this thread keep XLA's dots. Compiled graphs (aten/graph.cc) build in
// one: there XLA's dot of a Linear in its swapped form (graph.cc) cost less than the host GEMM
// (bench_compile prefill, matmul.cc's threshold comment).
class HostGemmOff {
 public:
  HostGemmOff();
  ~HostGemmOff();
  HostGemmOff(const HostGemmOff&) = delete;
  HostGemmOff& operator=(const HostGemmOff&) = delete;

 private:
  bool prev_;
};

}  // namespace tpu::lowering
