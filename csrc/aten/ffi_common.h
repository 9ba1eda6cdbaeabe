// Shared by the host kernels (aten/ffi_kernels.cc: ragged dot; aten/ffi_conv.cc: convolution;
// aten/ffi_gemm.cc: matrix products): the XLA FFI headers of the installed jaxlib, pinned to the API
// version the plugin runs, an FFI buffer (host memory on the CPU plugin) seen as a CPU tensor
// without a copy, and the OpenMP team size of the kernels a handler runs. Include only under
// `#if __has_include("xla/ffi/api/ffi.h")`.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>

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
