// Batch normalization, training and inference, forward and backward. Statistics in float32 for
// reduced-precision inputs; running statistics are returned as extra values after the op's
// returns (the runtime writes them into the mutated running_mean/running_var arguments).
#include "lowering.h"

namespace tpu::lowering {

namespace {

struct BnShapes {
  std::vector<int64_t> reduce;  // all dims but the channel dim (1)
  Shape chan;                   // [C]
  double n = 1;                 // elements per channel
};

BnShapes bn_shapes(const Value& x) {
  BnShapes s;
  for (int64_t i = 0; i < x.rank(); ++i) {
    if (i == 1) continue;
    s.reduce.push_back(i);
    s.n *= static_cast<double>(x.shape()[i]);
  }
  s.chan = {x.rank() > 1 ? x.shape()[1] : 1};
  return s;
}

Value per_channel(Builder& b, Value v, const Shape& shape) {  // [C] -> x's shape
  if (shape.size() < 2) return b.broadcast_to(v, shape);
  return b.broadcast_in_dim(v, shape, {1});
}

Value opt_or(Builder& b, const OpCall& c, const std::string& name, double dflt, ElemType t, const Shape& chan) {
  if (c.has(name)) return b.convert(c.tensor(name), t);
  return b.constant_f(dflt, t, chan);
}

// Returns {out, mean, invstd, new_running_mean, new_running_var}.
std::vector<Value> bn_forward(Builder& b, const OpCall& c, bool training) {
  Value x0 = c.tensor("input");
  ElemType t = opmath(x0.elem()) == ElemType::F64 ? ElemType::F64 : ElemType::F32;
  Value x = b.convert(x0, t);
  BnShapes s = bn_shapes(x);
  double eps = c.double_("eps", 1e-5), momentum = c.double_("momentum", 0.1);
  Value mean, var, invstd, new_rm, new_rv;
  if (training) {
    Value sum = b.reduce(x, b.zeros(Type{t, {}}), s.reduce, "add");
    mean = b.div(sum, b.constant_f(s.n, t, s.chan));
    Value d = b.sub(x, per_channel(b, mean, x.shape()));
    var = b.div(b.reduce(b.mul(d, d), b.zeros(Type{t, {}}), s.reduce, "add"), b.constant_f(s.n, t, s.chan));
    invstd = b.rsqrt(b.add(var, b.constant_f(eps, t, s.chan)));
    if (c.has("running_mean")) {
      Value rm = c.tensor("running_mean"), rv = c.tensor("running_var");
      ElemType rt = rm.elem();
      Value m = b.constant_f(momentum, t, s.chan), om = b.constant_f(1.0 - momentum, t, s.chan);
      Value unbiased = b.mul(var, b.constant_f(s.n / std::max(s.n - 1, 1.0), t, s.chan));
      new_rm = b.convert(b.add(b.mul(om, b.convert(rm, t)), b.mul(m, mean)), rt);
      new_rv = b.convert(b.add(b.mul(om, b.convert(rv, t)), b.mul(m, unbiased)), rv.elem());
    }
  } else {
    mean = opt_or(b, c, "running_mean", 0.0, t, s.chan);
    Value rv = opt_or(b, c, "running_var", 1.0, t, s.chan);
    invstd = b.rsqrt(b.add(rv, b.constant_f(eps, t, s.chan)));
  }
  Value y = b.mul(b.sub(x, per_channel(b, mean, x.shape())), per_channel(b, invstd, x.shape()));
  if (c.has("weight")) y = b.mul(y, per_channel(b, b.convert(c.tensor("weight"), t), x.shape()));
  if (c.has("bias")) y = b.add(y, per_channel(b, b.convert(c.tensor("bias"), t), x.shape()));
  // Saved statistics: shaped as PyTorch's meta says ([C] in training, [0] in inference).
  auto saved = [&](size_t i, Value v) {
    const Type& o = out_type(c, i);
    return o.numel() == s.chan[0] ? b.reshape(v, o.shape) : b.zeros(o);
  };
  return {y, saved(1, mean), saved(2, invstd), new_rm.id >= 0 ? new_rm : mean,
          new_rv.id >= 0 ? new_rv : invstd};
}

}  // namespace

// The legacy schema mutates the running stats (in training) without declaring it.
TPU_LOWER_WITH(native_batch_norm, .writes = {{"running_mean", "training"}, {"running_var", "training"}}) { return bn_forward(b, c, c.bool_("training")); }

TPU_LOWER(_native_batch_norm_legit) { return bn_forward(b, c, c.bool_("training")); }

TPU_LOWER(_native_batch_norm_legit_no_training) { return bn_forward(b, c, false); }

TPU_LOWER(_batch_norm_with_update) {
  auto r = bn_forward(b, c, true);
  return {r[0], r[1], r[2], b.zeros(out_type(c, 3)), r[3], r[4]};
}

TPU_LOWER(_batch_norm_no_update) {
  auto r = bn_forward(b, c, false);
  return {r[0], r[1], r[2], b.zeros(out_type(c, 3))};
}

namespace {

std::vector<Value> bn_backward(Builder& b, const OpCall& c, bool train, Value save_invstd_or_var) {
  Value go0 = c.tensor("grad_out"), x0 = c.tensor("input");
  ElemType t = opmath(x0.elem()) == ElemType::F64 ? ElemType::F64 : ElemType::F32;
  Value go = b.convert(go0, t), x = b.convert(x0, t);
  BnShapes s = bn_shapes(x);
  double eps = c.double_("eps", 1e-5);
  Value mean, invstd;
  if (train) {
    mean = b.convert(c.tensor("save_mean"), t);
    invstd = b.convert(save_invstd_or_var, t);
  } else {
    mean = opt_or(b, c, "running_mean", 0.0, t, s.chan);
    invstd = b.rsqrt(b.add(opt_or(b, c, "running_var", 1.0, t, s.chan), b.constant_f(eps, t, s.chan)));
  }
  Value w = opt_or(b, c, "weight", 1.0, t, s.chan);
  Value xhat = b.mul(b.sub(x, per_channel(b, mean, x.shape())), per_channel(b, invstd, x.shape()));
  Value zero = b.zeros(Type{t, {}});
  Value sum_go = b.reduce(go, zero, s.reduce, "add");
  Value sum_go_xhat = b.reduce(b.mul(go, xhat), zero, s.reduce, "add");
  Value gi;
  if (train) {
    Value nn = b.constant_f(s.n, t, x.shape());
    Value inner = b.sub(b.sub(b.mul(nn, go), per_channel(b, sum_go, x.shape())),
                        b.mul(xhat, per_channel(b, sum_go_xhat, x.shape())));
    gi = b.mul(per_channel(b, b.div(b.mul(w, invstd), b.constant_f(s.n, t, s.chan)), x.shape()), inner);
  } else {
    gi = b.mul(go, per_channel(b, b.mul(w, invstd), x.shape()));
  }
  // grad_weight/grad_bias not asked for by output_mask are undefined outputs (not [C]): zeros.
  auto fit = [&](Value v, size_t i) {
    const Type& ot = out_type(c, i);
    return ot.numel() == v.type.numel() ? b.reshape(v, ot.shape) : b.zeros(Type{t, ot.shape});
  };
  return {gi, fit(sum_go_xhat, 1), fit(sum_go, 2)};
}

}  // namespace

TPU_LOWER(native_batch_norm_backward) {
  return bn_backward(b, c, c.bool_("train"), c.has("save_invstd") ? c.tensor("save_invstd") : Value{});
}

TPU_LOWER(batch_norm_backward) {
  return bn_backward(b, c, c.bool_("update"), c.has("save_var") ? c.tensor("save_var") : Value{});
}

}  // namespace tpu::lowering
