// Host kernels for the CPU PJRT plugin as XLA FFI custom calls (lowering/host_kernels.h says when
// the lowerings emit them; runtime/ffi_kernels.cc registers them with the plugin).
//
// The ragged dot at MoE decode sizes is bound by the GEMM, and XLA:CPU's dot is 2.7-5x slower
// than oneDNN/MKL there (no XLA flag changes that; measured in benchmarks/bench_grouped_mm.py).
// These handlers run inside the program, on the plugin's buffers, which are host memory: each
// group's rows are multiplied into its rows of the output (no copy) by oneDNN's matmul (float32
// groups of >= 2^20 MACs) or the BLAS sgemm ATen's mm uses (smaller float32 groups, called
// directly), ATen's CPU GEMM (oneDNN, AMX for bf16) or MKL's mixed GEMMs
// (bf16/f16 on CPUs where ATen has no fast kernel for them), split over threads without an OpenMP
// barrier (run_tasks, ffi_common.h). They read the group sizes / offsets from a device buffer
// that is ready when the call runs, so nothing syncs with the host and the op stays one node of
// whatever program (strict, fused or compiled) contains it.
//
// Built only when the XLA FFI headers of the installed jaxlib are on the include path (setup.py);
// without them no handler is offered and the lowerings keep the XLA paths.
#if __has_include("xla/ffi/api/ffi.h")
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>

#include "ffi_common.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lowering/host_kernels.h"
#include "runtime/ffi_kernels.h"

namespace tpu::aten {
namespace {
namespace ffi = xla::ffi;

using ffi_buffers::find_symbol;
using ffi_buffers::OnednnMatmul;
using ffi_buffers::wrap;

// Each group's end row, from the int32/int64 `groups` operand as the op passed it (no conversion
// in the program): cumulative ends (`_grouped_mm`'s offs) or, when `sizes`, group sizes (ragged_dot;
// a negative size counts as 0, as in the CPU kernel). Ends are clamped to [previous end, m].
std::vector<int64_t> group_ends(const ffi::AnyBuffer& groups, bool sizes, int64_t m) {
  const ffi::DataType t = groups.element_type();
  TORCH_CHECK(t == ffi::DataType::S32 || t == ffi::DataType::S64, "group operand must be int32/int64");
  const auto* p32 = static_cast<const int32_t*>(groups.untyped_data());
  const auto* p64 = static_cast<const int64_t*>(groups.untyped_data());
  std::vector<int64_t> ends(groups.element_count());
  int64_t prev = 0;
  for (size_t i = 0; i < ends.size(); ++i) {
    const int64_t v = t == ffi::DataType::S32 ? p32[i] : p64[i];
    prev = std::min(std::max(sizes ? prev + std::max<int64_t>(v, 0) : v, prev), m);
    ends[i] = prev;
  }
  return ends;
}

// ---- bfloat16/float16 GEMMs on CPUs without native support for them.
//
// ATen's bf16/f16 mm runs oneDNN only where oneDNN supports the type natively (AVX-512 for bf16,
// AVX512-FP16 or AMX for f16; ideep's has_bf16/fp16_type_support); elsewhere it falls back to
// scalar loops: on the AVX2 EPYC this was measured on, one decode-size group
// ([16,512] x [512,1024]) took 17 ms in bf16 and 19 ms in f16 against 0.43 ms in float32, and the
// benchmark's ragged dot ~200 ms. MKL's mixed GEMMs (linked into libtorch_cpu: bf16/f16 operands,
// float32 accumulation and result) run the same product in 0.6 / 1.7 ms. There the handlers use
// them: each block is computed into a float32 scratch and rounded once to the output type, as
// ATen's own kernels round their float32 accumulator.
using MixedGemm = void (*)(int layout, int transa, int transb, int m, int n, int k, float alpha, const void* a,
                           int lda, const void* b, int ldb, float beta, float* c, int ldc);
// The Fortran BLAS sgemm ATen's own float32 mm calls (MKL's in libtorch_cpu; column-major, LP64 ints).
using Sgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

// TORCH_TPU_HOST_GEMM=aten: every group through ATen's mm (A/B of the direct BLAS calls, tests).
bool aten_gemm_forced() {
  static const bool forced = [] {
    const char* env = std::getenv("TORCH_TPU_HOST_GEMM");
    return env && std::string(env) == "aten";
  }();
  return forced;
}

// MKL's mixed GEMM for `t` when ATen's would be the scalar fallback on this CPU, else null.
MixedGemm mixed_gemm(c10::ScalarType t) {
  static const auto pick = [](const char* sym, bool native) {
    if (native || aten_gemm_forced()) return MixedGemm{nullptr};
    return reinterpret_cast<MixedGemm>(find_symbol(sym));
  };
  static const MixedGemm bf16 = pick("cblas_gemm_bf16bf16f32", __builtin_cpu_supports("avx512bw") &&
                                                                   __builtin_cpu_supports("avx512vl") &&
                                                                   __builtin_cpu_supports("avx512dq"));
  static const MixedGemm f16 = pick("cblas_gemm_f16f16f32", __builtin_cpu_supports("avx512fp16"));
  return t == c10::kBFloat16 ? bf16 : t == c10::kHalf ? f16 : nullptr;
}

// float32 groups call sgemm directly: the same kernel ATen's mm reaches, without its per-call
// dispatch, checks and output resizing, and with no tensor views made per group (null: ATen's mm).
Sgemm direct_sgemm() {
  static const Sgemm fn = aten_gemm_forced() ? nullptr : reinterpret_cast<Sgemm>(find_symbol("sgemm_"));
  return fn;
}

constexpr int kNoTrans = 111, kTrans = 112, kRowMajor = 101;

// A row-major operand: pointer, transposed (the storage holds op^T) or not, leading dimension.
struct Operand {
  const void* p;
  int trans, ld;
};

// A 2-D [r, c] view with strides (s0, s1) as a BLAS operand; false when neither dim is contiguous.
bool blas_operand(int64_t r, int64_t c, int64_t s0, int64_t s1, int& trans, int& ld) {
  if (s1 == 1 || c == 1) {
    const int64_t l = r == 1 ? c : s0;
    if (l >= std::max<int64_t>(c, 1)) return trans = kNoTrans, ld = static_cast<int>(l), true;
  }
  if (s0 == 1 || r == 1) {
    const int64_t l = c == 1 ? r : s1;
    if (l >= std::max<int64_t>(r, 1)) return trans = kTrans, ld = static_cast<int>(l), true;
  }
  return false;
}

bool blas_operand(const at::Tensor& t, int& trans, int& ld) {
  return blas_operand(t.size(0), t.size(1), t.stride(0), t.stride(1), trans, ld);
}

// y = a x b with MKL's mixed GEMM `fn`; y, a, b are 2-D views in one reduced type.
void mixed_mm_out(MixedGemm fn, at::Tensor y, at::Tensor a, at::Tensor b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    y.zero_();
    return;
  }
  int ta, tb, lda, ldb;
  if (!blas_operand(a, ta, lda)) a = a.contiguous(), blas_operand(a, ta, lda);
  if (!blas_operand(b, tb, ldb)) b = b.contiguous(), blas_operand(b, tb, ldb);
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(m * n));
  fn(kRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a.data_ptr(), lda,
     b.data_ptr(), ldb, 0.0f, scratch.data(), static_cast<int>(n));
  y.copy_(at::from_blob(scratch.data(), {m, n}, at::TensorOptions().dtype(c10::kFloat)));
}

// Row-major y[m, n] (row stride ldy, unit column stride) = op(a)[m, k] x op(b)[k, n] in float32,
// through the column-major sgemm as y^T = op(b)^T op(a)^T (same flags, operands swapped).
void sgemm_rows(Sgemm fn, int64_t m, int64_t n, int64_t k, Operand a, Operand b, float* y, int64_t ldy) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) std::fill_n(y + i * ldy, n, 0.0f);
    return;
  }
  const char ta = a.trans == kTrans ? 'T' : 'N', tb = b.trans == kTrans ? 'T' : 'N';
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int ld = static_cast<int>(std::max<int64_t>(ldy, 1));
  const float one = 1.0f, zero = 0.0f;
  fn(&tb, &ta, &ni, &mi, &ki, &one, static_cast<const float*>(b.p), &b.ld, static_cast<const float*>(a.p), &a.ld,
     &zero, y, &ld);
}

// One group's product into y: MKL's mixed GEMM (`mixed` non-null), or ATen's CPU GEMM.
void group_mm(MixedGemm mixed, at::Tensor y, const at::Tensor& a, const at::Tensor& b) {
  if (mixed) {
    mixed_mm_out(mixed, std::move(y), a, b);
  } else {
    at::cpu::mm_out(y, a, b);
  }
}

// A 2-D float32 block of a buffer at `p` + offset (elements), [r, c] with strides (s0, s1).
struct Block {
  const float* p;
  int64_t r, c, s0, s1;
};

// y = a x b for float32 blocks through the direct sgemm when all three are BLAS views (y with
// unit column stride); false when not (the caller then uses ATen's mm).
bool direct_mm(Sgemm fn, float* y, int64_t ldy, const Block& a, const Block& b) {
  Operand oa{a.p, 0, 0}, ob{b.p, 0, 0};
  if (!fn || !blas_operand(a.r, a.c, a.s0, a.s1, oa.trans, oa.ld) ||
      !blas_operand(b.r, b.c, b.s0, b.s1, ob.trans, ob.ld) || ldy < std::max<int64_t>(b.c, 1)) {
    return false;
  }
  sgemm_rows(fn, a.r, b.c, a.c, oa, ob, y, ldy);
  return true;
}

// float32 groups through oneDNN's matmul (ffi_common.h's onednn_matmul) instead of MKL's sgemm: on
// this machine's AMD EPYC (Zen 5, AVX-512) MKL runs generic kernels. One thread, group products of
// the benchmark's shape, CPU ms per call (load ~6): forward [m,512]x[512,1024] m=4 0.126 vs 0.076,
// m=16 0.265 vs 0.124, m=30 0.376 vs 0.186; weight gradient [512,m]x[m,1024] m=2..8 0.34-0.35 vs
// 0.10, m=16 0.209 vs 0.093. Its fixed cost (~13 us: an 8x8x8 product takes 0.013 ms vs MKL's
// 0.001) loses on small products and single rows (MKL's gemv / rank-1 update: m=1 forward 0.029
// vs 0.075, weight gradient 0.029 vs 0.104; forward m=2 0.056 vs 0.075, m=3 a tie), so those stay
// on sgemm. oneDNN takes whole groups as tasks (it would copy a column block of a [K,N] weight):
// the groups go largest first, so the two threads' shares stay even.
constexpr int64_t kOnednnMacs = int64_t{1} << 20, kOnednnRowsForward = 4, kOnednnRowsWgrad = 2;

// The float32 oneDNN matmul unless TORCH_TPU_HOST_GEMM=aten / _ONEDNN=0 or the type is not float32.
OnednnMatmul float_onednn(c10::ScalarType t) {
  return t == c10::kFloat && !aten_gemm_forced() ? ffi_buffers::onednn_matmul() : nullptr;
}

// Groups 0..g-1 by row count, largest first (task order when whole groups are the tasks).
std::vector<int64_t> largest_first(std::vector<int64_t> groups, const std::vector<int64_t>& ends) {
  const auto rows = [&](int64_t i) { return ends[i] - (i ? ends[i - 1] : 0); };
  std::stable_sort(groups.begin(), groups.end(), [&](int64_t x, int64_t y) { return rows(x) > rows(y); });
  return groups;
}

// Column parts per group: one per thread when the output is wide enough (>= 128 columns a part),
// in multiples of 64 columns. Cutting N keeps the tasks equal whatever the group sizes; each
// output element is still one dot product over K, so the result is the per-group mm's, bit for bit.
// bfloat16/float16 GEMMs that ATen runs through oneDNN (not mixed_gemm's) pay its setup, ~20 us a
// call (a [16,512]x[512,512] bf16 mm takes ~43 us on an AMX Xeon): with at least two non-empty
// groups per thread, whole groups are the tasks (A/B at load 4-5, decode batch 64 shape: median
// 1.5-3.5 ms vs 2.4-4.5 ms with column halves); so too for float32 groups on oneDNN (above).
int64_t column_parts(int64_t n, int64_t threads, int64_t groups, bool whole_groups) {
  if (whole_groups && groups >= 2 * threads) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(threads, n / 128));
}

std::pair<int64_t, int64_t> part_columns(int64_t n, int64_t parts, int64_t p) {
  const int64_t step = (n / parts + 63) / 64 * 64;
  return {std::min(n, p * step), p + 1 == parts ? n : std::min(n, (p + 1) * step)};
}

// Below kSoloMacs multiply-adds (~80 us of one thread's f32 GEMM) a call runs on the caller alone:
// waking the helper costs ~40 us (a two-thread host-kernel call of 2 rows x [8,8,8] took 57-67 us
// against the XLA path's 20-29 us at load 4-6, session 6), about what it would save.
constexpr int64_t kSoloMacs = int64_t{1} << 22;

int64_t gemm_threads(int64_t macs) {
  return at::in_parallel_region() || macs < kSoloMacs ? 1 : at::get_num_threads();
}

// [M,K] x [G,K,N] -> [M,N]: group g owns rows [ends[g-1], ends[g]); rows past the last group are
// zero. rhs arrives as [G,N,K] when `rhs_col_major` (nn.Linear-layout experts), multiplied through a
// transposed view (the GEMM's transpose flag, no copy).
ffi::Error ragged_dot(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer groups,
                      ffi::Result<ffi::AnyBuffer> out, int32_t group_sizes, int32_t rhs_col_major) {
  try {
    at::Tensor a = wrap(lhs), w = wrap(rhs), y = wrap(*out);
    TORCH_CHECK(a.dim() == 2 && w.dim() == 3 && y.dim() == 2, "bad operand ranks");
    const int64_t m = a.size(0), g = w.size(0), n = y.size(1);
    TORCH_CHECK(y.size(0) == m && w.size(rhs_col_major ? 2 : 1) == a.size(1) && w.size(rhs_col_major ? 1 : 2) == n &&
                    w.scalar_type() == a.scalar_type() && y.scalar_type() == a.scalar_type(),
                "operand shapes/types disagree");
    TORCH_CHECK(static_cast<int64_t>(groups.element_count()) == g, "group count mismatch");
    const std::vector<int64_t> e = group_ends(groups, group_sizes != 0, m);
    std::vector<int64_t> used;  // non-empty groups
    for (int64_t i = 0; i < g; ++i)
      if (e[i] > (i ? e[i - 1] : 0)) used.push_back(i);
    const int64_t threads = gemm_threads(m * a.size(1) * n);
    const MixedGemm mixed = mixed_gemm(a.scalar_type());
    const OnednnMatmul onednn = float_onednn(a.scalar_type());
    const int64_t parts = column_parts(n, threads, static_cast<int64_t>(used.size()),
                                       (a.element_size() < 4 && !mixed) || onednn);
    if (parts == 1) used = largest_first(std::move(used), e);
    const int64_t k = a.size(1);
    const Sgemm direct = a.scalar_type() == c10::kFloat ? direct_sgemm() : nullptr;
    run_tasks(static_cast<int64_t>(used.size()) * parts, threads, [&](int64_t t) {
      const int64_t i = used[t / parts], r0 = i ? e[i - 1] : 0, rows = e[i] - r0;
      const auto [c0, c1] = part_columns(n, parts, t % parts);
      if (onednn && rows >= kOnednnRowsForward && rows * k * (c1 - c0) >= kOnednnMacs) {
        at::Tensor wi = w.select(0, i);
        wi = rhs_col_major ? wi.narrow(0, c0, c1 - c0).t() : wi.narrow(1, c0, c1 - c0);
        return onednn(a.narrow(0, r0, rows), wi, y.narrow(0, r0, rows).narrow(1, c0, c1 - c0), 0.0f, 1.0f);
      }
      if (direct) {  // the operands are dense buffers: blocks by pointer arithmetic
        const float* wp = static_cast<const float*>(w.data_ptr()) + i * n * k;
        const Block bi = rhs_col_major ? Block{wp + c0 * k, k, c1 - c0, 1, k} : Block{wp + c0, k, c1 - c0, n, 1};
        const Block ai{static_cast<const float*>(a.data_ptr()) + r0 * k, e[i] - r0, k, k, 1};
        if (direct_mm(direct, static_cast<float*>(y.data_ptr()) + r0 * n + c0, n, ai, bi)) return;
      }
      at::Tensor wi = w.select(0, i);
      wi = rhs_col_major ? wi.narrow(0, c0, c1 - c0).t() : wi.narrow(1, c0, c1 - c0);
      at::Tensor yi = y.narrow(0, r0, e[i] - r0).narrow(1, c0, c1 - c0);
      group_mm(mixed, yi, a.narrow(0, r0, e[i] - r0), wi);
    });
    const int64_t tail = e.empty() ? 0 : e.back();
    if (tail < m) y.narrow(0, tail, m - tail).zero_();
  } catch (const std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("torch_tpu.ragged_dot: ") + ex.what());
  }
  return ffi::Error::Success();
}

// [M,K], [M,N] -> [G,K,N]: out[g] = lhs[rows_g]^T grad[rows_g], zero for empty groups.
ffi::Error ragged_dot_wgrad(ffi::AnyBuffer lhs, ffi::AnyBuffer grad, ffi::AnyBuffer groups,
                            ffi::Result<ffi::AnyBuffer> out, int32_t group_sizes) {
  try {
    at::Tensor a = wrap(lhs), d = wrap(grad), y = wrap(*out);
    TORCH_CHECK(a.dim() == 2 && d.dim() == 2 && y.dim() == 3, "bad operand ranks");
    const int64_t m = a.size(0), g = y.size(0), n = y.size(2);
    TORCH_CHECK(d.size(0) == m && y.size(1) == a.size(1) && d.size(1) == n && d.scalar_type() == a.scalar_type() &&
                    y.scalar_type() == a.scalar_type(),
                "operand shapes/types disagree");
    TORCH_CHECK(static_cast<int64_t>(groups.element_count()) == g, "group count mismatch");
    const std::vector<int64_t> e = group_ends(groups, group_sizes != 0, m);
    int64_t used = 0;
    std::vector<int64_t> order(g);  // every group: an empty one's gradient is zeroed
    for (int64_t i = 0; i < g; ++i) used += e[i] > (i ? e[i - 1] : 0), order[i] = i;
    const int64_t threads = gemm_threads(m * a.size(1) * n);
    const MixedGemm mixed = mixed_gemm(a.scalar_type());
    const OnednnMatmul onednn = float_onednn(a.scalar_type());
    const int64_t parts = column_parts(n, threads, used, (a.element_size() < 4 && !mixed) || onednn);
    if (parts == 1) order = largest_first(std::move(order), e);
    const int64_t k = a.size(1);
    const Sgemm direct = a.scalar_type() == c10::kFloat ? direct_sgemm() : nullptr;
    run_tasks(g * parts, threads, [&](int64_t t) {
      const int64_t i = order[t / parts], r0 = i ? e[i - 1] : 0, rows = e[i] - r0;
      const auto [c0, c1] = part_columns(n, parts, t % parts);
      if (onednn && rows >= kOnednnRowsWgrad && rows * k * (c1 - c0) >= kOnednnMacs) {
        // lhs^T [K, rows] is a transposed dense view (oneDNN takes it as is); grad's rows likewise
        return onednn(a.narrow(0, r0, rows).t(), d.narrow(0, r0, rows).narrow(1, c0, c1 - c0),
                      y.select(0, i).narrow(1, c0, c1 - c0), 0.0f, 1.0f);
      }
      if (direct && e[i] > r0) {  // lhs^T by the transpose flag: [K, rows] with strides (1, K)
        const Block ai{static_cast<const float*>(a.data_ptr()) + r0 * k, k, e[i] - r0, 1, k};
        const Block di{static_cast<const float*>(d.data_ptr()) + r0 * n + c0, e[i] - r0, c1 - c0, n, 1};
        if (direct_mm(direct, static_cast<float*>(y.data_ptr()) + i * k * n + c0, n, ai, di)) return;
      }
      at::Tensor yi = y.select(0, i).narrow(1, c0, c1 - c0);
      if (e[i] > r0) {
        group_mm(mixed, yi, a.narrow(0, r0, e[i] - r0).t(), d.narrow(0, r0, e[i] - r0).narrow(1, c0, c1 - c0));
      } else {
        yi.zero_();
      }
    });
  } catch (const std::exception& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("torch_tpu.ragged_dot_wgrad: ") + ex.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(torch_tpu_ragged_dot_handler, ragged_dot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("group_sizes")
                                  .Attr<int32_t>("rhs_col_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(torch_tpu_ragged_dot_wgrad_handler, ragged_dot_wgrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("group_sizes"));

namespace {
// Offered to the runtime at load time; it registers them when the client starts.
const bool offered = [] {
  runtime::offer_host_kernel(lowering::kRaggedDotTarget, reinterpret_cast<void*>(&torch_tpu_ragged_dot_handler));
  runtime::offer_host_kernel(lowering::kRaggedDotWgradTarget,
                             reinterpret_cast<void*>(&torch_tpu_ragged_dot_wgrad_handler));
  return true;
}();

}  // namespace

}  // namespace tpu::aten
#endif  // xla/ffi/api/ffi.h
