// Fused optimizer steps: _fused_adam_, _fused_adamw_, _fused_sgd_ (float or Tensor lr, optional
// grad_scale / found_inf, and the .out forms). One program updates every tensor of the lists.
//
// The math follows PyTorch's CPU fused kernels (FusedAdamKernel.cpp, FusedSGDKernel.cpp)
// operation by operation: bias corrections and the step size in float64 from the float32 step,
// then the element math in the parameter's opmath type (float32 for float16/bfloat16) with the
// double constants rounded to it. found_inf == 1 skips the step entirely (grads included).
//
// The runtime turns every mutated list argument into extra outputs in argument order (grads only
// with a grad_scale, max_exp_avg_sqs only with amsgrad; see fallback.cc) and passes a float lr as
// a runtime f64 operand so a learning-rate schedule does not recompile the step.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {

namespace {

std::vector<Value> list_arg(const OpCall& c, const std::string& name) {
  std::vector<Value> out;
  const Arg* a = c.find(name);
  if (!a || a->kind == Arg::Kind::None) return out;
  if (a->kind != Arg::Kind::TensorList && a->kind != Arg::Kind::OptTensorList)
    throw Unsupported(c.name + ": '" + name + "' is not a tensor list");
  for (const auto& v : a->tensors) {
    if (!v) throw std::runtime_error(c.name + ": '" + name + "' holds an undefined tensor");
    out.push_back(*v);
  }
  return out;
}

void check_len(const OpCall& c, const std::vector<Value>& l, size_t n, const std::string& name) {
  if (l.size() != n)
    throw std::runtime_error(c.name + ": expected " + std::to_string(n) + " tensors in '" + name +
                             "', got " + std::to_string(l.size()));
}

// A one-element tensor as a 0-d value of type t.
Value one_element(Builder& b, Value v, ElemType t) {
  if (v.type.numel() != 1) throw std::runtime_error("expected a one-element tensor, got " + v.type.str());
  return b.convert(b.reshape(v, {}), t);
}

// The learning rate as a 0-d f64: a runtime scalar, a (device or 0-d host) tensor, or a
// constant (compiled graphs).
Value lr_f64(Builder& b, const OpCall& c) {
  const Arg& a = c.arg("lr");
  switch (a.kind) {
    case Arg::Kind::Scalar: return b.convert(a.scalar, ElemType::F64);
    case Arg::Kind::Tensor: return one_element(b, a.tensor, ElemType::F64);
    case Arg::Kind::Double: return b.constant_f(a.d, ElemType::F64);
    default: throw Unsupported(c.name + ": unexpected lr argument");
  }
}

Value bcast(Builder& b, Value scalar0d, ElemType t, const Shape& shape) {
  return b.broadcast_in_dim(b.convert(scalar0d, t), shape, {});
}

bool is_out_overload(const OpCall& c) { return c.overload == "out" || c.overload == "tensor_lr_out"; }

// Shared prologue: the optional grad_scale (as f32, the kernels read it through a float*) and
// the found_inf skip predicate.
struct AmpArgs {
  std::optional<Value> scale;  // f32 0-d
  std::optional<Value> skip;   // i1 0-d: found_inf == 1
};

AmpArgs amp_args(Builder& b, const OpCall& c) {
  AmpArgs r;
  if (c.has("grad_scale")) r.scale = one_element(b, c.tensor("grad_scale"), ElemType::F32);
  if (c.has("found_inf")) {
    Value f = one_element(b, c.tensor("found_inf"), ElemType::F32);
    r.skip = b.compare(Cmp::EQ, f, b.constant_f(1.0, ElemType::F32));
  }
  return r;
}

// new value, or the old one when the step is skipped.
Value keep_if_skipped(Builder& b, const AmpArgs& amp, Value old_v, Value new_v) {
  new_v = b.convert(new_v, old_v.elem());
  if (!amp.skip) return new_v;
  Value pred = b.broadcast_in_dim(*amp.skip, old_v.shape(), {});
  return b.select(pred, old_v, new_v);
}

// Emits the written lists in schema order. `updated` maps a list name to its new values.
std::vector<Value> emit_in_schema_order(const OpCall& c, const std::map<std::string, std::vector<Value>>& updated) {
  std::vector<Value> res;
  for (const auto& [name, a] : c.args) {
    auto it = updated.find(name);
    if (it == updated.end()) continue;
    res.insert(res.end(), it->second.begin(), it->second.end());
  }
  return res;
}

enum class AdamMode { Original, AdamW };

std::vector<Value> lower_fused_adam(Builder& b, const OpCall& c, AdamMode mode) {
  auto params = list_arg(c, "self");
  size_t n = params.size();
  auto grads = list_arg(c, "grads");
  auto exp_avgs = list_arg(c, "exp_avgs");
  auto exp_avg_sqs = list_arg(c, "exp_avg_sqs");
  auto max_sqs = list_arg(c, "max_exp_avg_sqs");
  auto steps = list_arg(c, "state_steps");
  bool amsgrad = c.bool_("amsgrad"), maximize = c.bool_("maximize");
  check_len(c, grads, n, "grads");
  check_len(c, exp_avgs, n, "exp_avgs");
  check_len(c, exp_avg_sqs, n, "exp_avg_sqs");
  check_len(c, steps, n, "state_steps");
  check_len(c, max_sqs, amsgrad ? n : 0, "max_exp_avg_sqs");  // the CPU kernel's checks
  double beta1 = c.double_("beta1"), beta2 = c.double_("beta2"), wd = c.double_("weight_decay"),
         eps = c.double_("eps");
  AmpArgs amp = amp_args(b, c);
  Value lr = lr_f64(b, c);
  const ElemType F64 = ElemType::F64;
  // AdamW's decoupled decay factor, computed in double like the kernel's (1 - lr * wd).
  Value decay = b.sub(b.constant_f(1.0, F64), b.mul(lr, b.constant_f(wd, F64)));

  std::vector<Value> new_p, new_g, new_m, new_v, new_max;
  for (size_t i = 0; i < n; ++i) {
    const Shape& sh = params[i].shape();
    ElemType t = opmath(params[i].elem());
    auto C = [&](double v) { return b.constant_f(v, t, sh); };
    // Host-side double math of the kernel, on the device: step read as float, then double.
    Value step = one_element(b, b.convert(steps[i], ElemType::F32), F64);
    Value bc1 = b.sub(b.constant_f(1.0, F64), b.pow(b.constant_f(beta1, F64), step));
    Value bc2 = b.sub(b.constant_f(1.0, F64), b.pow(b.constant_f(beta2, F64), step));
    Value step_size = bcast(b, b.div(lr, bc1), t, sh);
    Value bc2_sqrt = bcast(b, b.sqrt(bc2), t, sh);

    Value p = b.convert(params[i], t);
    Value g = b.convert(grads[i], t);
    if (amp.scale) {
      g = b.div(g, bcast(b, *amp.scale, t, sh));
      new_g.push_back(keep_if_skipped(b, amp, grads[i], g));
    }
    if (maximize) g = b.neg(g);
    if (wd != 0) {
      if (mode == AdamMode::Original) g = b.add(g, b.mul(p, C(wd)));
      else p = b.mul(p, bcast(b, decay, t, sh));
    }
    // exp_avg.lerp_(grad, 1 - beta1), with the kernel's choice of formula by weight size.
    Value m = b.convert(exp_avgs[i], t);
    double w = 1 - beta1;
    double wt = t == F64 ? w : static_cast<double>(static_cast<float>(w));
    if (std::abs(wt) < 0.5) m = b.add(m, b.mul(C(w), b.sub(g, m)));
    else m = b.sub(g, b.mul(b.sub(g, m), b.sub(C(1.0), C(w))));
    Value v = b.add(b.mul(b.convert(exp_avg_sqs[i], t), C(beta2)), b.mul(b.mul(C(1 - beta2), g), g));
    Value vmax = v;
    if (amsgrad) {
      vmax = b.max(b.convert(max_sqs[i], t), v);
      new_max.push_back(keep_if_skipped(b, amp, max_sqs[i], vmax));
    }
    Value denom = b.add(b.div(b.sqrt(vmax), bc2_sqrt), C(eps));
    p = b.sub(p, b.div(b.mul(step_size, m), denom));
    new_p.push_back(keep_if_skipped(b, amp, params[i], p));
    new_m.push_back(keep_if_skipped(b, amp, exp_avgs[i], m));
    new_v.push_back(keep_if_skipped(b, amp, exp_avg_sqs[i], v));
  }
  std::map<std::string, std::vector<Value>> updated{
      {"exp_avgs", new_m}, {"exp_avg_sqs", new_v}, {is_out_overload(c) ? "out" : "self", new_p}};
  if (amp.scale) updated["grads"] = new_g;
  if (amsgrad) updated["max_exp_avg_sqs"] = new_max;
  if (is_out_overload(c)) check_len(c, list_arg(c, "out"), n, "out");
  return emit_in_schema_order(c, updated);
}

}  // namespace

TPU_LOWER(_fused_adam) { return lower_fused_adam(b, c, AdamMode::Original); }
TPU_LOWER(_fused_adamw) { return lower_fused_adam(b, c, AdamMode::AdamW); }

TPU_LOWER(_fused_sgd) {
  auto params = list_arg(c, "self");
  size_t n = params.size();
  auto grads = list_arg(c, "grads");
  auto bufs = list_arg(c, "momentum_buffer_list");
  check_len(c, grads, n, "grads");
  double wd = c.double_("weight_decay"), momentum = c.double_("momentum"), dampening = c.double_("dampening");
  bool nesterov = c.bool_("nesterov"), maximize = c.bool_("maximize"), first = c.bool_("is_first_step");
  if (momentum != 0) check_len(c, bufs, n, "momentum_buffer_list");
  else check_len(c, bufs, 0, "momentum_buffer_list");
  AmpArgs amp = amp_args(b, c);
  Value lr = lr_f64(b, c);

  std::vector<Value> new_p, new_g, new_buf;
  for (size_t i = 0; i < n; ++i) {
    const Shape& sh = params[i].shape();
    ElemType t = opmath(params[i].elem());
    auto C = [&](double v) { return b.constant_f(v, t, sh); };
    Value p = b.convert(params[i], t);
    Value g = b.convert(grads[i], t);
    if (amp.scale) {
      g = b.div(g, bcast(b, *amp.scale, t, sh));
      new_g.push_back(keep_if_skipped(b, amp, grads[i], g));
    }
    if (maximize) g = b.neg(g);
    if (wd != 0) g = b.add(g, b.mul(p, C(wd)));
    if (momentum != 0) {
      Value buf = first ? g : b.add(b.mul(b.convert(bufs[i], t), C(momentum)), b.mul(g, C(1 - dampening)));
      new_buf.push_back(keep_if_skipped(b, amp, bufs[i], buf));
      g = nesterov ? b.add(g, b.mul(buf, C(momentum))) : buf;
    }
    p = b.sub(p, b.mul(g, bcast(b, lr, t, sh)));
    new_p.push_back(keep_if_skipped(b, amp, params[i], p));
  }
  std::map<std::string, std::vector<Value>> updated{{is_out_overload(c) ? "out" : "self", new_p}};
  if (amp.scale) updated["grads"] = new_g;
  if (momentum != 0) updated["momentum_buffer_list"] = new_buf;
  if (is_out_overload(c)) check_len(c, list_arg(c, "out"), n, "out");
  return emit_in_schema_order(c, updated);
}

}  // namespace tpu::lowering
