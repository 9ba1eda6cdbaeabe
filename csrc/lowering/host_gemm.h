// The host GEMM (aten/ffi_gemm.cc): PyTorch's CPU mm / addmm / bmm / baddbmm (oneDNN / MKL) as a typed
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
// switches of host_kernels.h and the measured thresholds, matmul.cc: eager, or in a GraphGemmScope).
bool host_gemm_wanted(shlo::ElemType t, int64_t batch, int64_t m, int64_t k, int64_t n);

// While alive, lowerings on this thread build a compiled graph (aten/graph.cc): host_gemm_wanted
// applies the compiled-graph rule (matmul.cc: rank 2, 2..512 rows, from 2^20 multiply-adds) instead
// of the eager one.
class GraphGemmScope {
 public:
  GraphGemmScope();
  ~GraphGemmScope();
  GraphGemmScope(const GraphGemmScope&) = delete;
  GraphGemmScope& operator=(const GraphGemmScope&) = delete;

 private:
  bool prev_;
};

}  // namespace tpu::lowering
