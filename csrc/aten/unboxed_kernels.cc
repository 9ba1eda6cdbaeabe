#include "unboxed_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_log_softmax_ops.h>
#include <ATen/ops/_softmax_ops.h>
#include <ATen/ops/abs_ops.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/amax_ops.h>
#include <ATen/ops/argmax_ops.h>
#include <ATen/ops/bitwise_and_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/cat_ops.h>
#include <ATen/ops/clamp_max_ops.h>
#include <ATen/ops/clamp_min_ops.h>
#include <ATen/ops/clamp_ops.h>
#include <ATen/ops/cos_ops.h>
#include <ATen/ops/cumsum_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/embedding_ops.h>
#include <ATen/ops/eq_ops.h>
#include <ATen/ops/erf_ops.h>
#include <ATen/ops/exp_ops.h>
#include <ATen/ops/fill_ops.h>
#include <ATen/ops/floor_ops.h>
#include <ATen/ops/ge_ops.h>
#include <ATen/ops/gelu_ops.h>
#include <ATen/ops/gt_ops.h>
#include <ATen/ops/index_select_ops.h>
#include <ATen/ops/le_ops.h>
#include <ATen/ops/log1p_ops.h>
#include <ATen/ops/log_ops.h>
#include <ATen/ops/logical_and_ops.h>
#include <ATen/ops/logical_not_ops.h>
#include <ATen/ops/lt_ops.h>
#include <ATen/ops/masked_fill_ops.h>
#include <ATen/ops/maximum_ops.h>
#include <ATen/ops/mean_ops.h>
#include <ATen/ops/minimum_ops.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/ne_ops.h>
#include <ATen/ops/neg_ops.h>
#include <ATen/ops/pow_ops.h>
#include <ATen/ops/reciprocal_ops.h>
#include <ATen/ops/relu_ops.h>
#include <ATen/ops/remainder_ops.h>
#include <ATen/ops/rsqrt_ops.h>
#include <ATen/ops/rsub_ops.h>
#include <ATen/ops/sigmoid_ops.h>
#include <ATen/ops/sign_ops.h>
#include <ATen/ops/silu_ops.h>
#include <ATen/ops/sin_ops.h>
#include <ATen/ops/sqrt_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/sum_ops.h>
#include <ATen/ops/tanh_ops.h>
#include <ATen/ops/where_ops.h>
#include <ATen/ops/zero_ops.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "dispatch.h"
#include "eager_dynamic.h"

namespace tpu::aten {

namespace {

std::atomic<bool> enabled{true};
std::atomic<int64_t> served{0}, boxed{0}, registered{0};

// Whether the call reads a storage marked dynamic (torch_tpu.mark_dynamic): such calls are boxed,
// so eager_dynamic::maybe_handle sees them first, as on the boxed path (one relaxed load per
// tensor while nothing is marked).
bool reads_marked_storage(c10::ArrayRef<c10::IValue> args) {
  for (const c10::IValue& v : args) {
    if (v.isTensor() && eager_dynamic::is_marked(v.toTensor())) return true;
    if (v.isList())
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor() && eager_dynamic::is_marked(e.toTensor())) return true;
  }
  return false;
}

// An unboxed call's arguments as the IValues boxing would make (aten/dispatch.h reads only
// these), except that tensors are borrowed: no reference count change, so no GIL.
class BorrowedArgs {
 public:
  template <class... A>
  explicit BorrowedArgs(const A&... a) {
    (push(a), ...);
  }
  ~BorrowedArgs() {
    for (uint8_t i : borrowed_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(values_[i].toTensor());
  }
  BorrowedArgs(const BorrowedArgs&) = delete;
  BorrowedArgs& operator=(const BorrowedArgs&) = delete;
  c10::ArrayRef<c10::IValue> values() const { return values_; }

 private:
  void push(const at::Tensor& t) {
    borrowed_.push_back(static_cast<uint8_t>(values_.size()));
    values_.emplace_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
  }
  void push(const std::optional<at::Tensor>& t) {
    if (t) push(*t);
    else values_.emplace_back();
  }
  template <class T>
  void push(const T& v) {
    values_.emplace_back(v);  // what boxing does (ATen/core/boxing/impl/boxing.h boxToStack)
  }
  c10::SmallVector<c10::IValue, 8> values_;
  c10::SmallVector<uint8_t, 4> borrowed_;
};

template <class T>
constexpr bool is_tensor_ref = std::is_same_v<T, at::Tensor&>;

// The typed kernel of ATen overload Op: the dispatch cache's fast path over borrowed arguments,
// else PyTorch's own boxing wrapper around tpu_boxed_kernel (exactly the boxed registration).
template <class Op, class Sig = typename Op::schema>
struct TypedKernel;

template <class Op, class R, class... A>
struct TypedKernel<Op, R(A...)> {
  // Functional ops return one fresh tensor; in-place ops return their first argument, out=
  // ops their last (the rule of c10::impl::BoxedKernelWrapper).
  static_assert(std::is_same_v<R, at::Tensor> ||
                    (std::is_same_v<R, at::Tensor&> &&
                     (is_tensor_ref<std::tuple_element_t<0, std::tuple<A...>>> ||
                      is_tensor_ref<std::tuple_element_t<sizeof...(A) - 1, std::tuple<A...>>>)),
                "typed kernels return one tensor");

  static R call(c10::DispatchKeySet ks, A... a) {
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    if (enabled.load(std::memory_order_relaxed)) {
      static const OpInfo& info = op_info(op);
      BorrowedArgs args(a...);
      CallOutputs outs;
      if (!reads_marked_storage(args.values()) && serve_from_cache(op, info, args.values(), outs)) {
        served.fetch_add(1, std::memory_order_relaxed);
        if constexpr (std::is_same_v<R, at::Tensor>) {
          return *std::move(outs[0]);  // fresh (owned): moved out
        } else if constexpr (is_tensor_ref<std::tuple_element_t<0, std::tuple<A...>>>) {
          return std::get<0>(std::forward_as_tuple(a...));
        } else {
          return std::get<sizeof...(A) - 1>(std::forward_as_tuple(a...));
        }
      }
    }
    boxed.fetch_add(1, std::memory_order_relaxed);
    return c10::impl::BoxedKernelWrapper<R(A...)>::call(c10::BoxedKernel::makeFromFunction<&tpu_boxed_kernel>(), op,
                                                        ks, std::forward<A>(a)...);
  }

  static torch::CppFunction make() { return torch::CppFunction(TORCH_FN(call)); }
};

using MakeKernel = torch::CppFunction (*)();

template <class... Ops>
void add_kernels(std::unordered_map<std::string, MakeKernel>& table) {
  auto add = [&](const char* name, const char* overload, MakeKernel make) {
    std::string key = std::string(name).substr(6);  // "aten::add" -> "add"
    if (*overload) key += std::string(".") + overload;
    table.emplace(std::move(key), make);
  };
  (add(Ops::name, Ops::overload_name, &TypedKernel<Ops>::make), ...);
}

// The hottest overloads of small eager programs (elementwise chains, activations, attention and
// MLP pieces, embeddings). Forward ops matter most: their arguments are Python-held tensors
// (backward ops get tensors autograd holds, whose copies take no GIL). Any lowered overload may be listed: registration still only covers overloads the
// boxed kernel would be registered for (aten/dispatch.cc register_lowered_kernels).
const std::unordered_map<std::string, MakeKernel>& kernels() {
  static const auto* table = [] {
    auto t = std::make_unique<std::unordered_map<std::string, MakeKernel>>();
    namespace o = at::_ops;
    add_kernels<o::add_Tensor, o::add__Tensor, o::add_out, o::add_Scalar, o::add__Scalar, o::sub_Tensor,
                o::sub__Tensor, o::sub_out, o::sub_Scalar, o::sub__Scalar, o::rsub_Tensor, o::rsub_Scalar,
                o::mul_Tensor, o::mul__Tensor, o::mul_out, o::mul_Scalar, o::mul__Scalar, o::div_Tensor,
                o::div__Tensor, o::div_out, o::div_Scalar, o::div__Scalar, o::div_Tensor_mode, o::div__Tensor_mode,
                o::pow_Tensor_Scalar, o::pow_Tensor_Tensor, o::pow__Scalar, o::pow__Tensor, o::maximum, o::minimum>(*t);
    add_kernels<o::eq_Tensor, o::eq_Scalar, o::ne_Tensor, o::ne_Scalar, o::lt_Tensor, o::lt_Scalar, o::le_Tensor,
                o::le_Scalar, o::gt_Tensor, o::gt_Scalar, o::ge_Tensor, o::ge_Scalar, o::where_self,
                o::logical_not, o::masked_fill_Scalar, o::masked_fill__Scalar, o::fill__Scalar, o::zero_>(*t);
    add_kernels<o::neg, o::neg_, o::exp, o::exp_, o::log, o::log_, o::sqrt, o::sqrt_, o::rsqrt, o::rsqrt_, o::tanh,
                o::tanh_, o::sigmoid, o::sigmoid_, o::relu, o::relu_, o::abs, o::abs_, o::sin, o::cos, o::reciprocal,
                o::erf, o::silu, o::silu_, o::gelu, o::gelu_, o::clamp, o::clamp_, o::clamp_min, o::clamp_max>(*t);
    add_kernels<o::sum_dim_IntList, o::mean_dim, o::_softmax, o::_log_softmax, o::mm, o::bmm, o::addmm, o::embedding,
                o::index_select, o::cat, o::cumsum, o::amax, o::argmax, o::log1p, o::floor, o::sign, o::logical_and,
                o::bitwise_and_Tensor, o::remainder_Tensor, o::remainder_Scalar>(*t);
    return t.release();
  }();
  return *table;
}

}  // namespace

bool register_unboxed_kernel(torch::Library& lib, const std::string& overload) {
  auto it = kernels().find(overload);
  if (it == kernels().end()) return false;
  lib.impl(overload.c_str(), it->second());
  registered.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void set_unboxed_fast_path(bool on) { enabled.store(on, std::memory_order_relaxed); }
bool unboxed_fast_path() { return enabled.load(std::memory_order_relaxed); }

UnboxedStats unboxed_stats() {
  return {served.load(std::memory_order_relaxed), boxed.load(std::memory_order_relaxed),
          registered.load(std::memory_order_relaxed)};
}

namespace {
void set_fast_path_op(bool on) { set_unboxed_fast_path(on); }
std::vector<int64_t> stats_op() {
  const UnboxedStats s = unboxed_stats();
  return {s.served, s.boxed, s.registered};
}
}  // namespace

// Bindings as torch ops (module.cc stays untouched): torch.ops.torch_tpu._unboxed_stats() ->
// [served, boxed, registered]; torch.ops.torch_tpu._set_unboxed_fast_path(bool).
TORCH_LIBRARY_FRAGMENT(torch_tpu, m) {
  m.def("_set_unboxed_fast_path(bool on) -> ()");
  m.def("_unboxed_stats() -> int[]");
}

TORCH_LIBRARY_IMPL(torch_tpu, CompositeExplicitAutograd, m) {
  m.impl("_set_unboxed_fast_path", &set_fast_path_op);
  m.impl("_unboxed_stats", &stats_op);
}

}  // namespace tpu::aten
