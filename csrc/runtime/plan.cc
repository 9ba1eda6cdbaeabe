#include "plan.h"

#include <stdexcept>

#include "device_checks.h"

namespace tpu::runtime {

using shlo::Type;
using shlo::Value;

pjrt::ElementType pjrt_of(shlo::ElemType t) {
  switch (t) {
    case shlo::ElemType::Pred: return pjrt::ElementType::Pred;
    case shlo::ElemType::U8: return pjrt::ElementType::U8;
    case shlo::ElemType::S8: return pjrt::ElementType::S8;
    case shlo::ElemType::S16: return pjrt::ElementType::S16;
    case shlo::ElemType::S32: return pjrt::ElementType::S32;
    case shlo::ElemType::S64: return pjrt::ElementType::S64;
    case shlo::ElemType::F16: return pjrt::ElementType::F16;
    case shlo::ElemType::BF16: return pjrt::ElementType::BF16;
    case shlo::ElemType::F32: return pjrt::ElementType::F32;
    case shlo::ElemType::F64: return pjrt::ElementType::F64;
    case shlo::ElemType::U16: return pjrt::ElementType::U16;
    case shlo::ElemType::U32: return pjrt::ElementType::U32;
    case shlo::ElemType::U64: return pjrt::ElementType::U64;
    case shlo::ElemType::F8E4M3FN: return pjrt::ElementType::F8E4M3FN;
    case shlo::ElemType::F8E5M2: return pjrt::ElementType::F8E5M2;
    case shlo::ElemType::C64: return pjrt::ElementType::C64;
    case shlo::ElemType::C128: return pjrt::ElementType::C128;
  }
  return pjrt::ElementType::F32;
}

void key_tensor(std::string& k, const TensorRef& r, const Slot& s) {
  k += 'T';
  k += shlo::mlir_name(r.view.elem);
  k += '[';
  for (int64_t d : r.view.sizes) { k += std::to_string(d); k += ','; }
  k += "][";
  for (int64_t d : r.view.strides) { k += std::to_string(d); k += ','; }
  k += "]@";
  k += std::to_string(r.view.offset);
  k += 's';
  k += std::to_string(r.slot);
  k += ':';
  k += std::to_string(s.numel);
  k += shlo::mlir_name(s.elem);
  k += ';';
}

void key_dims(std::string& k, const shlo::Shape& dims) {
  k += '<';
  for (int64_t d : dims) { k += std::to_string(d); k += ','; }
  k += '>';
}

void plan_out_dims(Slot& s, const std::vector<TensorRef>& outs, int slot) {
  s.out_dims = s.dims;
  s.whole_write = false;
  for (const TensorRef& r : outs) {
    if (r.slot != slot) continue;
    if (r.view.covers(s.numel)) {
      s.out_dims = r.view.sizes;
      s.whole_write = true;
    } else if (auto dims = r.view.permuted_whole(s.numel)) {
      s.out_dims = std::move(*dims);
      s.whole_write = true;
    }
  }
}

namespace {
int64_t numel_of(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

[[noreturn]] void internal_error(const std::string& msg) { throw std::logic_error("torch_tpu: " + msg); }
}  // namespace

void emit_op(shlo::Builder& b, std::vector<Value>& cur, const std::vector<Value>& host_vals, const Plan& plan) {
  auto read = [&](const TensorRef& r) { return b.reshape(read_view(b, cur[r.slot], r.view), r.logical); };
  lowering::OpCall call;
  call.name = plan.name;
  call.overload = plan.overload;
  call.common = plan.common;
  call.args.reserve(plan.args.size());
  auto constant = [&](const ArgPlan& ap) {
    return ap.scalar_const_elem == shlo::ElemType::F64 ? b.constant_f(*ap.scalar_const, ap.scalar_const_elem)
                                                       : b.constant_i(static_cast<int64_t>(*ap.scalar_const), ap.scalar_const_elem);
  };
  for (const ArgPlan& ap : plan.args) {
    lowering::Arg a = ap.value;
    switch (a.kind) {
      case lowering::Arg::Kind::Tensor:
        a.tensor = !ap.refs.empty() ? read(*ap.refs[0]) : ap.scalar_const ? constant(ap) : host_vals[ap.host_index[0]];
        break;
      case lowering::Arg::Kind::TensorList:
      case lowering::Arg::Kind::OptTensorList:
        for (size_t i = 0; i < ap.refs.size(); ++i) {
          if (ap.refs[i]) a.tensors.push_back(read(*ap.refs[i]));
          else if (ap.list_host[i]) a.tensors.push_back(host_vals[*ap.list_host[i]]);
          else a.tensors.push_back(std::nullopt);
        }
        break;
      case lowering::Arg::Kind::Scalar:
        a.scalar = ap.scalar_const ? constant(ap) : host_vals[ap.host_index[0]];
        break;
      default: break;  // constants are already in `value`
    }
    call.args.emplace_back(ap.name, std::move(a));
  }
  for (const TensorRef& r : plan.outs) call.outs.push_back(Type{r.view.elem, r.logical});  // undefined: empty
  struct Checking {  // the op's device-side checks (lowering.h check()) go into `b`
    shlo::Builder& b;
    ~Checking() { b.set_checking(false); }
  } checking{b};
  b.set_checking(plan.checked && device_checks());
  b.set_precision(plan.precision);
  std::vector<Value> res = plan.entry->fn(b, call);
  if (res.size() < plan.outs.size())
    internal_error("lowering of " + plan.name + " returned " + std::to_string(res.size()) + " values for " +
                   std::to_string(plan.outs.size()) + " outputs");
  for (size_t i = 0; i < plan.outs.size(); ++i) {
    const TensorRef& r = plan.outs[i];
    if (r.slot < 0) continue;
    Value v = b.convert(res[i], r.view.elem);
    if (v.shape() != r.view.sizes) {
      if (v.type.numel() != numel_of(r.view.sizes))
        internal_error("lowering of " + plan.name + " produced shape " + v.type.str() + " for an output of " +
                       std::to_string(r.view.sizes.size()) + " dims");
      v = b.reshape(v, r.view.sizes);
    }
    const Slot& s = plan.slots[r.slot];
    cur[r.slot] = write_view(b, cur[r.slot], v, r.view, s.numel, s.elem);
  }
}

std::vector<Value> emit_strict_body(shlo::Builder& b, const Plan& plan) {
  std::vector<Value> cur(plan.slots.size());
  for (size_t i = 0; i < plan.slots.size(); ++i)
    if (plan.slots[i].read) cur[i] = b.arg(Type{plan.slots[i].elem, plan.slots[i].dims});
  std::vector<Value> host_vals;
  for (const HostOperand& h : plan.host) host_vals.push_back(b.arg(Type{h.elem, h.dims()}));
  emit_op(b, cur, host_vals, plan);
  return cur;
}

std::string build_program(const Plan& plan) {
  shlo::Builder b;
  std::vector<Value> cur = emit_strict_body(b, plan);
  std::vector<Value> results;
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const Slot& s = plan.slots[i];
    if (!s.written) continue;
    // Equal dims in and out (an in-place op): XLA updates the donated buffer in place.
    if (s.read) b.alias(s.arg, static_cast<int>(results.size()));
    results.push_back(cur[i].shape() == s.out_dims ? cur[i] : b.reshape(cur[i], s.out_dims));
  }
  if (plan.checked && device_checks()) {  // the device's status: last argument, donated to the last result
    Value status = b.arg(Type{shlo::ElemType::S32, {2}});
    b.alias(b.num_args() - 1, static_cast<int>(results.size()));
    results.push_back(b.fold_status(status));
  }
  return b.module(results);
}

}  // namespace tpu::runtime
