// Fused LSTM / GRU cells. PyTorch's recurrent layers (aten/native/RNN.cpp: nn.LSTM, nn.GRU,
// nn.LSTMCell, nn.GRUCell) call _thnn_fused_lstm_cell / _thnn_fused_gru_cell for every time step on
// any non-CPU device (CUDA, XPU, PrivateUse1), and autograd calls their backwards; none of them has
// a CPU kernel, so without these lowerings those layers cannot run on tpu at all.
// Inputs: the gate pre-activations x W_ih^T and h W_hh^T ([B, 4H] for LSTM in order i, f, g, o;
// [B, 3H] for GRU in order r, z, n), optional biases [4H]/[3H]. The workspace is the contract
// between each forward and its backward (sizes from PyTorch's meta functions): LSTM keeps the
// activated gates [i, f, g, o]; GRU keeps [r, z, n, h, hn] (hn = h W_hn^T + b_hn).
// float16/bfloat16 compute in float32, as the CUDA kernels do.
#include "elementwise_math.h"
#include "lowering.h"
#include "shape_util.h"

namespace tpu::lowering {

namespace {

// Gate block k (columns [k h, (k+1) h)) of a [B, n h] value.
Value gate(Builder& b, Value x, int64_t k, int64_t h) {
  return b.slice(x, {0, k * h}, {x.shape()[0], (k + 1) * h});
}

// Argument `name` ([B, n h]) as `t`, plus its bias [n h] when given.
Value gates_with_bias(Builder& b, const OpCall& c, const char* name, const char* bias, ElemType t) {
  Value g = b.convert(c.tensor(name), t);
  if (g.rank() != 2) throw Unsupported(c.name + ": expected 2-D gates");
  if (!c.has(bias)) return g;
  return b.add(g, b.broadcast_in_dim(b.convert(c.tensor(bias), t), g.shape(), {1}));
}

Value one_minus(Builder& b, Value x) { return b.sub(b.constant_f(1.0, x.elem(), x.shape()), x); }

Value out(Builder& b, const OpCall& c, size_t i, Value v) { return b.convert(fit(b, v, out_type(c, i)), out_type(c, i).elem); }

// An output PyTorch's meta leaves undefined (no bias): a placeholder the runtime drops.
Value undefined(Builder& b, const OpCall& c, size_t i) {
  return i < c.outs.size() ? b.zeros(c.outs[i]) : b.constant_i(0, ElemType::F32);
}

// Sum over the batch rows: the bias gradient.
Value bias_grad(Builder& b, Value g) { return sum_drop(b, g, {0}); }

}  // namespace

TPU_LOWER(_thnn_fused_lstm_cell) {
  const ElemType t = opmath(out_type(c, 0).elem);
  const int64_t h = out_type(c, 0).shape.at(1);
  Value gates = b.add(gates_with_bias(b, c, "input_gates", "input_bias", t),
                      gates_with_bias(b, c, "hidden_gates", "hidden_bias", t));
  Value i = ew::sigmoid(b, gate(b, gates, 0, h));
  Value f = ew::sigmoid(b, gate(b, gates, 1, h));
  Value g = b.tanh(gate(b, gates, 2, h));
  Value o = ew::sigmoid(b, gate(b, gates, 3, h));
  Value cy = b.add(b.mul(f, b.convert(c.tensor("cx"), t)), b.mul(i, g));
  Value hy = b.mul(o, b.tanh(cy));
  return {out(b, c, 0, hy), out(b, c, 1, cy), out(b, c, 2, b.concatenate({i, f, g, o}, 1))};
}

TPU_LOWER(_thnn_fused_lstm_cell_backward_impl) {
  const ElemType t = opmath(out_type(c, 1).elem);
  const int64_t h = out_type(c, 1).shape.at(1);
  Value ws = b.convert(c.tensor("workspace"), t);
  Value i = gate(b, ws, 0, h), f = gate(b, ws, 1, h), g = gate(b, ws, 2, h), o = gate(b, ws, 3, h);
  Value cx = b.convert(c.tensor("cx"), t), cy = b.convert(c.tensor("cy"), t);
  Value zero = b.zeros(Type{t, cx.shape()});
  Value ghy = c.has("grad_hy") ? b.convert(c.tensor("grad_hy"), t) : zero;
  Value gcy = c.has("grad_cy") ? b.convert(c.tensor("grad_cy"), t) : zero;
  Value tc = b.tanh(cy);
  // d cy: through hy = o tanh(cy), plus the incoming cell gradient.
  Value dc = b.add(b.mul(b.mul(ghy, o), one_minus(b, b.mul(tc, tc))), gcy);
  Value di = b.mul(b.mul(dc, g), b.mul(i, one_minus(b, i)));
  Value df = b.mul(b.mul(dc, cx), b.mul(f, one_minus(b, f)));
  Value dg = b.mul(b.mul(dc, i), one_minus(b, b.mul(g, g)));
  Value d_o = b.mul(b.mul(ghy, tc), b.mul(o, one_minus(b, o)));
  Value dgates = b.concatenate({di, df, dg, d_o}, 1);
  Value dbias = c.bool_("has_bias") && c.outs.size() > 2 && c.outs[2].numel() == 4 * h
                    ? out(b, c, 2, bias_grad(b, dgates)) : undefined(b, c, 2);
  return {out(b, c, 0, dgates), out(b, c, 1, b.mul(dc, f)), dbias};
}

TPU_LOWER(_thnn_fused_gru_cell) {
  const ElemType t = opmath(out_type(c, 0).elem);
  const int64_t h = out_type(c, 0).shape.at(1);
  Value x = gates_with_bias(b, c, "input_gates", "input_bias", t);
  Value hg = gates_with_bias(b, c, "hidden_gates", "hidden_bias", t);
  Value hx = b.convert(c.tensor("hx"), t);
  Value r = ew::sigmoid(b, b.add(gate(b, x, 0, h), gate(b, hg, 0, h)));
  Value z = ew::sigmoid(b, b.add(gate(b, x, 1, h), gate(b, hg, 1, h)));
  Value hn = gate(b, hg, 2, h);
  Value n = b.tanh(b.add(gate(b, x, 2, h), b.mul(r, hn)));
  Value hy = b.add(n, b.mul(z, b.sub(hx, n)));
  return {out(b, c, 0, hy), out(b, c, 1, b.concatenate({r, z, n, hx, hn}, 1))};
}

TPU_LOWER(_thnn_fused_gru_cell_backward) {
  const ElemType t = opmath(out_type(c, 2).elem);
  const int64_t h = out_type(c, 2).shape.at(1);
  Value ws = b.convert(c.tensor("workspace"), t);
  Value r = gate(b, ws, 0, h), z = gate(b, ws, 1, h), n = gate(b, ws, 2, h), hx = gate(b, ws, 3, h),
        hn = gate(b, ws, 4, h);
  Value go = b.convert(c.tensor("grad_hy"), t);
  Value dz = b.mul(b.mul(go, b.sub(hx, n)), b.mul(z, one_minus(b, z)));
  Value dn = b.mul(b.mul(go, one_minus(b, z)), one_minus(b, b.mul(n, n)));
  Value dhn = b.mul(dn, r);
  Value dr = b.mul(b.mul(dn, hn), b.mul(r, one_minus(b, r)));
  Value d_in = b.concatenate({dr, dz, dn}, 1);
  Value d_hidden = b.concatenate({dr, dz, dhn}, 1);
  const bool bias = c.bool_("has_bias") && c.outs.size() > 4 && c.outs[3].numel() == 3 * h;
  return {out(b, c, 0, d_in), out(b, c, 1, d_hidden), out(b, c, 2, b.mul(go, z)),
          bias ? out(b, c, 3, bias_grad(b, d_in)) : undefined(b, c, 3),
          bias ? out(b, c, 4, bias_grad(b, d_hidden)) : undefined(b, c, 4)};
}

}  // namespace tpu::lowering
