// Host operands of a plan (runtime::HostOperand): Python scalars, 0-d CPU tensors and a random
// op's generator state, passed per call so new values never recompile.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <mutex>
#include <tuple>

#include "common.h"
#include "generator.h"
#include "plan_call.h"

namespace tpu::aten {

using runtime::HostOperand;
using shlo::ElemType;

runtime::HostOperand draw_rng_state(const std::optional<at::Generator>& g, int device, int64_t counters) {
  at::Generator gen = g ? *g : default_generator(static_cast<c10::DeviceIndex>(device));
  TORCH_CHECK(gen.device().type() == kTpu, "Expected a 'tpu' device type for generator but found '",
              gen.device().str(), "'");
  uint64_t seed, offset;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    std::tie(seed, offset) = gen.get<TpuGenerator>()->next(static_cast<uint64_t>(counters));
  }
  HostOperand h{};
  h.elem = ElemType::U64;
  h.dim0 = 2;
  std::memcpy(h.bytes, &seed, 8);
  std::memcpy(h.bytes + 8, &offset, 8);
  return h;
}

// The scalar values baked into programs as constants (ArgPlan::scalar_const), each a word of the
// dispatch-cache key. -1..3: the values whose programs XLA simplifies. pow(x, 3.0) (GELU-tanh's
// cube in GPT-2 and its kin) with 3 as an operand is XLA:CPU's scalar pow per element, ~13x ATen's
// x*x*x; with 3 a constant XLA emits x*x*x, which also equals CPU bitwise. -2, 0.5, -0.5: ATen's
// pow special cases (1/(x*x), sqrt, rsqrt), which the pow lowering emits when it sees the constant.
namespace {
constexpr double kConstScalars[] = {-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0};
}

std::optional<int> const_scalar_index(const c10::Scalar& sc) {
  double d;
  if (sc.isFloatingPoint()) {
    d = sc.toDouble();
    if (d == 0.0 && std::signbit(d)) return std::nullopt;  // -0.0 stays an operand
  } else if (sc.isIntegral(false)) {
    int64_t i = sc.toLong();
    if (i < -2 || i > 3) return std::nullopt;
    d = static_cast<double>(i);
  } else {
    return std::nullopt;
  }
  for (int k = 0; k < static_cast<int>(std::size(kConstScalars)); ++k)
    if (kConstScalars[k] == d) return k;
  return std::nullopt;
}

double const_scalar_value(int index) { return kConstScalars[index]; }

std::optional<int> const_scalar_index(const at::Tensor& t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->is_wrapped_number()) return std::nullopt;
  // Wrapped numbers are double, int64, bool or complex (ATen's scalar_to_tensor); read in place
  // (t.item() would be a trip through the dispatcher).
  std::optional<int> k;
  if (t.scalar_type() == c10::ScalarType::Double) k = const_scalar_index(c10::Scalar(*t.const_data_ptr<double>()));
  if (t.scalar_type() == c10::ScalarType::Long) k = const_scalar_index(c10::Scalar(*t.const_data_ptr<int64_t>()));
  // 3 stays an operand: XLA rewrites x / constant as x * (1 / constant), exact only when the
  // reciprocal is (0, +-0.5, +-1, +-2), and `x / 3` is a Tensor overload (pow's cube is a Scalar).
  if (k && const_scalar_value(*k) == 3.0) return std::nullopt;
  return k;
}

runtime::HostOperand host_operand(const c10::Scalar& sc) {
  HostOperand h{};
  if (sc.isFloatingPoint()) {
    h.elem = ElemType::F64;
    double v = sc.toDouble();
    std::memcpy(h.bytes, &v, 8);
  } else if (sc.isBoolean()) {
    h.elem = ElemType::Pred;
    h.bytes[0] = sc.toBool() ? 1 : 0;
  } else if (sc.isIntegral(false)) {
    h.elem = ElemType::S64;
    int64_t v = sc.toLong();
    std::memcpy(h.bytes, &v, 8);
  } else {  // complex: a complex<f64> operand (bytes: re, im), like ATen's wrapped number
    h.elem = ElemType::C128;
    const c10::complex<double> v = sc.toComplexDouble();
    static_assert(sizeof(v) <= sizeof(h.bytes));
    std::memcpy(h.bytes, &v, sizeof(v));
  }
  return h;
}

runtime::HostOperand host_operand(const at::Tensor& t) {
  HostOperand h{};
  h.elem = elem_of(t.scalar_type());
  std::memcpy(h.bytes, t.data_ptr(), t.element_size());
  return h;
}

}  // namespace tpu::aten
