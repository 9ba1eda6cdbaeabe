#include "common.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>

#include <array>

#include <atomic>

namespace tpu::aten {

namespace {
std::atomic<int> g_precision_override{-1};
}  // namespace

shlo::Precision matmul_precision() {
  int o = g_precision_override.load(std::memory_order_relaxed);
  if (o >= 0) return static_cast<shlo::Precision>(o);
  switch (at::globalContext().float32MatmulPrecision()) {
    case at::Float32MatmulPrecision::HIGHEST: return shlo::Precision::Highest;
    case at::Float32MatmulPrecision::HIGH: return shlo::Precision::High;
    case at::Float32MatmulPrecision::MEDIUM: return shlo::Precision::Default;
  }
  return shlo::Precision::Highest;
}

void set_precision_override(int p) {
  TORCH_CHECK_VALUE(p >= -1 && p <= 2, "torch_tpu: precision must be DEFAULT, HIGH or HIGHEST");
  g_precision_override.store(p, std::memory_order_relaxed);
}

int precision_override() { return g_precision_override.load(std::memory_order_relaxed); }

void ResultTypeAccumulator::tensor(const at::Tensor& t) {
  try {
    state_ = at::native::update_result_type_state(t, state_);
    any_ = true;
  } catch (const c10::Error&) {  // float8 next to other floats (_scaled_mm): no promotion
  }
}

void ResultTypeAccumulator::value(c10::ScalarType dtype, bool zero_dim) {
  // A meta tensor per (dtype, rank 0 or not): the state machine reads nothing else.
  thread_local std::array<at::Tensor, 2 * static_cast<size_t>(c10::ScalarType::NumOptions)> metas;
  at::Tensor& m = metas[static_cast<size_t>(dtype) * 2 + (zero_dim ? 1 : 0)];
  if (!m.defined())
    m = at::empty(zero_dim ? c10::IntArrayRef{} : c10::IntArrayRef{1}, at::TensorOptions().device(c10::kMeta).dtype(dtype));
  tensor(m);
}

void ResultTypeAccumulator::scalar(const c10::Scalar& sc) {
  scalar_kind(sc.isFloatingPoint() ? at::kDouble : sc.isBoolean() ? at::kBool : sc.isComplex() ? at::kComplexDouble : at::kLong);
}

void ResultTypeAccumulator::scalar_kind(c10::ScalarType kind) {
  // One wrapped 0-d tensor per kind (the flag makes it promote as a Python number).
  thread_local at::Tensor d, l, b, z;
  at::Tensor& w = kind == at::kDouble ? d : kind == at::kLong ? l : kind == at::kComplexDouble ? z : b;
  if (!w.defined()) {
    w = at::scalar_tensor(0, at::TensorOptions().device(c10::kCPU).dtype(kind));
    w.unsafeGetTensorImpl()->set_wrapped_number(true);
  }
  tensor(w);
}

c10::ScalarType ResultTypeAccumulator::result(c10::ScalarType fallback) const {
  if (!any_) return fallback;
  c10::ScalarType r = at::native::result_type(state_);
  return supported_dtype(r) ? r : fallback;
}


using shlo::ElemType;

bool supported_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kBool: case c10::kByte: case c10::kChar: case c10::kShort: case c10::kInt:
    case c10::kLong: case c10::kHalf: case c10::kBFloat16: case c10::kFloat: case c10::kDouble:
    case c10::kUInt16: case c10::kUInt32: case c10::kUInt64:
    case c10::kFloat8_e4m3fn: case c10::kFloat8_e5m2:
    case c10::kComplexFloat: case c10::kComplexDouble:
      return true;
    default:
      return false;
  }
}

ElemType elem_of(c10::ScalarType t) {
  switch (t) {
    case c10::kBool: return ElemType::Pred;
    case c10::kByte: return ElemType::U8;
    case c10::kChar: return ElemType::S8;
    case c10::kShort: return ElemType::S16;
    case c10::kInt: return ElemType::S32;
    case c10::kLong: return ElemType::S64;
    case c10::kHalf: return ElemType::F16;
    case c10::kBFloat16: return ElemType::BF16;
    case c10::kFloat: return ElemType::F32;
    case c10::kDouble: return ElemType::F64;
    case c10::kUInt16: return ElemType::U16;
    case c10::kUInt32: return ElemType::U32;
    case c10::kUInt64: return ElemType::U64;
    case c10::kFloat8_e4m3fn: return ElemType::F8E4M3FN;
    case c10::kFloat8_e5m2: return ElemType::F8E5M2;
    case c10::kComplexFloat: return ElemType::C64;
    case c10::kComplexDouble: return ElemType::C128;
    default:
      TORCH_CHECK_TYPE(false, "torch_tpu does not support dtype ", t,
                       " on the tpu device; keep such tensors on the CPU");
  }
}

c10::ScalarType scalar_of(ElemType t) {
  switch (t) {
    case ElemType::Pred: return c10::kBool;
    case ElemType::U8: return c10::kByte;
    case ElemType::S8: return c10::kChar;
    case ElemType::S16: return c10::kShort;
    case ElemType::S32: return c10::kInt;
    case ElemType::S64: return c10::kLong;
    case ElemType::F16: return c10::kHalf;
    case ElemType::BF16: return c10::kBFloat16;
    case ElemType::F32: return c10::kFloat;
    case ElemType::F64: return c10::kDouble;
    case ElemType::U16: return c10::kUInt16;
    case ElemType::U32: return c10::kUInt32;
    case ElemType::U64: return c10::kUInt64;
    case ElemType::F8E4M3FN: return c10::kFloat8_e4m3fn;
    case ElemType::F8E5M2: return c10::kFloat8_e5m2;
    case ElemType::C64: return c10::kComplexFloat;
    case ElemType::C128: return c10::kComplexDouble;
  }
  return c10::kFloat;
}

runtime::StorageState& state_of(const c10::Storage& s) {
  auto* st = static_cast<runtime::StorageState*>(s.data_ptr().get_context());
  TORCH_CHECK(st != nullptr, "torch_tpu: tensor storage was not allocated by the tpu allocator");
  return *st;
}

}  // namespace tpu::aten
