// Shared by the host kernels (aten/ffi_kernels.cc: ragged dot; aten/ffi_conv.cc: convolution;
// aten/ffi_gemm.cc: matrix products): the XLA FFI headers of the installed jaxlib, pinned to the API
// version the plugin runs, an FFI buffer (host memory on the CPU plugin) seen as a CPU tensor
// without a copy, ATen's oneDNN matmul (onednn_matmul: float32 GEMMs, faster than MKL on this AMD
// EPYC), the OpenMP team size of the kernels a handler runs, and run_tasks (a handler's GEMMs on two
// threads without an OpenMP team). Include only under
// `#if __has_include("xla/ffi/api/ffi.h")`.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

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

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/c_api.h"
// xla-cpu-pjrt 0.0.1 runs XLA FFI API 0.2 and refuses handlers that report a newer version; the
// headers of jaxlib 0.10.2 are 0.3. Minor versions only add struct fields and entry points behind
// struct_size checks, and the handlers use nothing newer than 0.2 (buffers, scalar and i64-array
// attributes, errors), so they report 0.2; the probe in register_host_kernels checks the result.
#if XLA_FFI_API_MAJOR == 0 && XLA_FFI_API_MINOR > 2
#undef XLA_FFI_API_MINOR
#define XLA_FFI_API_MINOR 2
#endif
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

namespace tpu::aten::ffi_buffers {

inline c10::ScalarType scalar_type(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return c10::kFloat;
    case xla::ffi::DataType::BF16: return c10::kBFloat16;
    case xla::ffi::DataType::F16: return c10::kHalf;
    default: TORCH_CHECK(false, "unsupported element type ", static_cast<int>(t));
  }
}

inline at::Tensor wrap(const xla::ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return at::from_blob(b.untyped_data(), c10::IntArrayRef(d.begin(), d.size()),
                       at::TensorOptions().dtype(scalar_type(b.element_type())));
}

// A symbol of the libraries torch loaded, looked up at run time (a torch without MKL or GNU OpenMP
// still loads the host kernels). Extensions load RTLD_LOCAL, so look in the libraries that define
// them: libtorch_cpu (MKL is linked into it) and the OpenMP runtime torch loaded.
inline void* find_symbol(const char* name) {
  if (void* p = dlsym(RTLD_DEFAULT, name)) return p;
  Dl_info info;
  for (const char* lib : {static_cast<const char*>(nullptr), "libgomp.so.1", "libiomp5.so", "libomp.so"}) {
    if (!lib && !dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info)) continue;
    void* h = dlopen(lib ? lib : info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) continue;
    void* p = dlsym(h, name);
    dlclose(h);
    if (p) return p;
  }
  return nullptr;
}

// TORCH_TPU_HOST_GEMM_ONEDNN=0 keeps the host kernels' float32 GEMMs off oneDNN (MKL for every
// block / group: A/B measurements, tests); read once per process.
inline bool onednn_gemm_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("TORCH_TPU_HOST_GEMM_ONEDNN");
    return !(env && env[0] == '0');
  }();
  return on;
}

// ATen's oneDNN matmul into a given output (at::native::mkldnn_matmul(a, b, y, beta, alpha):
// y = beta y + alpha a b, what addmm runs for bf16/f16; TORCH_API, its header not installed). It
// writes into strided output views (no result copy, unlike mkldnn::_linear_pointwise) and takes a /
// b dense or transposed (other strides it copies first). Found by its mangled name at run time,
// after a probe on 2x2 (float32 needs the AVX-512 oneDNN check; a torch without oneDNN throws);
// null where it fails or onednn_gemm_enabled() is false.
using OnednnMatmul = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, float, float);
inline OnednnMatmul onednn_matmul() {
  static const OnednnMatmul fn = []() -> OnednnMatmul {
    if (!onednn_gemm_enabled()) return nullptr;
    auto f = reinterpret_cast<OnednnMatmul>(find_symbol("_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff"));
    if (!f) return nullptr;
    try {
      const at::Tensor a = at::ones({2, 2}), y = at::zeros({2, 2});
      f(a, a, y, 0.0f, 1.0f);
      const float* p = y.const_data_ptr<float>();
      return p[0] == 2.0f && p[3] == 2.0f ? f : nullptr;
    } catch (const std::exception&) {
      return nullptr;
    }
  }();
  return fn;
}

// `n` threads for this thread's ATen GEMMs and convolutions during a scope: MKL's per-thread
// setting and OpenMP's per-thread team size (oneDNN follows it); at::set_num_threads would change
// MKL's process-wide setting and the intra-op pool. Looked up at run time (extensions load
// RTLD_LOCAL): in the process, libtorch_cpu (MKL is linked into it) or the OpenMP runtime torch
// loaded; a torch without them keeps its own threading.
class OmpThreads {
 public:
  explicit OmpThreads(int n) {
    static const Fns f = lookup();
    fns_ = &f;
    if (f.mkl_local) mkl_prev_ = f.mkl_local(n);
    if (f.omp_set && f.omp_get) {
      omp_prev_ = f.omp_get();
      f.omp_set(n);
    }
  }
  ~OmpThreads() {
    if (fns_->mkl_local) fns_->mkl_local(mkl_prev_);
    if (omp_prev_ > 0) fns_->omp_set(omp_prev_);
  }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  struct Fns {
    int (*mkl_local)(int) = nullptr;
    void (*omp_set)(int) = nullptr;
    int (*omp_get)() = nullptr;
  };
  static Fns lookup() {
    Fns f;
    f.mkl_local = reinterpret_cast<int (*)(int)>(find_symbol("MKL_Set_Num_Threads_Local"));
    f.omp_set = reinterpret_cast<void (*)(int)>(find_symbol("omp_set_num_threads"));
    f.omp_get = reinterpret_cast<int (*)()>(find_symbol("omp_get_max_threads"));
    return f;
  }
  const Fns* fns_;
  int mkl_prev_ = 0, omp_prev_ = 0;
};

}  // namespace tpu::aten::ffi_buffers

namespace tpu::aten {

// ---- Running a handler's GEMMs on two (or more) threads without an OpenMP barrier (run_tasks;
// used by the ragged dot, aten/ffi_kernels.cc, and the host GEMM, aten/ffi_gemm.cc).
//
// perf on a loop of decode-size calls: the GEMM kernels are ~6 % of the samples and libgomp's
// spin-waits ~80 %, both in the ragged dot with one threaded ATen mm per group (as PyTorch's CPU _grouped_mm runs
// it) and in PyTorch's own _grouped_mm: every group's GEMM forks and joins the OpenMP team, and on a
// shared machine each join waits until the OS runs the other thread. Here the work is cut into
// tasks (single-threaded GEMMs on blocks of the output), the calling thread works through them and an
// inter-op pool thread, woken once per call, takes tasks from the same atomic counter. The caller
// never waits for that thread to start: if it is not running, the caller does every task itself,
// and only a task already taken is waited for.
//
// That last wait is the one cost of the helper: when the OS takes the core from it in the middle
// of a task, the caller waits a scheduler slice (milliseconds on a loaded machine). In one process
// at load ~9 (decode batch 64 shape) the two-thread call took 2-3x the wall time and 1.6x the CPU
// time of the same tasks on the caller alone. So the caller times that wait: a wait longer than
// two of its own tasks means the helper was descheduled, and the next calls run on the caller
// alone (8, doubling to 256 while it recurs, halving back after calls without such a wait).

// Tasks 0..total-1, taken from one counter by the caller and by helper tasks on ATen's inter-op
// pool. The state outlives the call (shared_ptr): a helper that starts after the caller returned
// finds no task left and never touches the call's buffers.
namespace ffi_tasks {
struct TaskState {
  std::atomic<int64_t> next{0}, done{0};
  int64_t total = 0;
  std::function<void(int64_t)> task;
  std::mutex mu;
  std::string error;

  // Runs tasks until none is left; returns how many this thread ran.
  int64_t work() {
    ffi_buffers::OmpThreads seq(1);  // sequential GEMMs on this thread
    int64_t ran = 0;
    for (int64_t t; (t = next.fetch_add(1)) < total; ++ran) {
      try {
        task(t);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (error.empty()) error = e.what();
      }
      if (done.fetch_add(1, std::memory_order_release) + 1 == total) done.notify_all();
    }
    return ran;
  }
};

// Calls left to run on the caller alone, and the length of the next such run (see above).
inline std::atomic<int> solo_calls{0}, solo_backoff{0};

using Clock = std::chrono::steady_clock;
}  // namespace ffi_tasks

// Runs task(0) .. task(total - 1) on the caller and up to threads - 1 helpers; rethrows a task's error.
inline void run_tasks(int64_t total, int64_t threads, std::function<void(int64_t)> task) {
  using namespace ffi_tasks;
  if (total <= 0) return;
  auto st = std::make_shared<TaskState>();
  st->total = total;
  st->task = std::move(task);
  int64_t helpers = std::min(threads, total) - 1;
  if (helpers > 0 && solo_calls.load(std::memory_order_relaxed) > 0) {
    solo_calls.fetch_sub(1, std::memory_order_relaxed);
    helpers = 0;
  }
  for (int64_t h = 0; h < helpers; ++h) at::launch([st] { st->work(); });
  const auto t0 = Clock::now();
  const int64_t own = st->work();
  if (st->done.load(std::memory_order_acquire) < total) {
    // A helper still runs a task: spin briefly (it is usually mid-task on the other core), then sleep.
    const auto t1 = Clock::now();
    const auto per_task = own > 0 ? (t1 - t0) / own : std::chrono::microseconds(50);
    for (int64_t d; (d = st->done.load(std::memory_order_acquire)) < total;) {
      if (Clock::now() - t1 < std::chrono::microseconds(100)) {
        std::this_thread::yield();
      } else {
        st->done.wait(d, std::memory_order_acquire);
      }
    }
    if (Clock::now() - t1 > 2 * per_task + std::chrono::microseconds(20)) {
      const int b = std::clamp(2 * solo_backoff.load(std::memory_order_relaxed), 8, 256);
      solo_backoff.store(b, std::memory_order_relaxed);
      solo_calls.store(b, std::memory_order_relaxed);
    } else {
      solo_backoff.store(solo_backoff.load(std::memory_order_relaxed) / 2, std::memory_order_relaxed);
    }
  } else if (helpers > 0) {
    solo_backoff.store(solo_backoff.load(std::memory_order_relaxed) / 2, std::memory_order_relaxed);
  }
  // The helpers' references into this call die here; drop the closure before returning.
  st->task = nullptr;
  if (!st->error.empty()) throw std::runtime_error(st->error);
}

}  // namespace tpu::aten
