// _foreach_* ops (torch.optim's default foreach path, clip_grad_norm_): the per-tensor lowering of
// the underlying op applied to every list element, all in ONE program per call. Serves eager and
// compiled graphs alike. In eager, in-place forms (`_foreach_add_.List`) return nothing and write
// `self`: its elements are the call's outputs (docs/lowering.md, "mutated list args");
// out-of-place forms return one tensor per element. Scalar and ScalarList arguments are runtime
// operands (a ScalarList arrives as a list of 0-d host tensors), so changing lr never recompiles.
// A call the runtime or a lowering refuses keeps PyTorch's per-tensor composite (csrc/aten/dispatch.cc).
#include "lowering.h"

namespace tpu::lowering {

namespace {

// The per-tensor op's name for foreach argument `name` of `_foreach_<op>`.
std::string element_arg(const std::string& op, const std::string& name) {
  if (name == "scalar" || name == "scalars" || name == "other") {
    if (op == "addcdiv" || op == "addcmul") return "value";
    if (op == "clamp_min") return "min";
    if (op == "clamp_max") return "max";
    return "other";
  }
  if (op == "lerp") {
    if (name == "tensors1") return "end";
    if (name == "weights") return "weight";
  }
  return name;
}

// Builds element i's call of `op`: list arguments contribute their i-th tensor, scalars and
// tensor scalars pass through (renamed to the per-tensor op's argument names).
std::vector<Value> foreach_apply(Builder& b, const OpCall& c, const std::string& op) {
  const OpEntry* e = find_op(op);
  if (!e) throw Unsupported("_foreach_" + op + ": no lowering for " + op);
  size_t n = c.outs.size();
  std::vector<Value> res;
  res.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    OpCall ci;
    ci.name = op;
    ci.overload = c.overload;
    ci.outs = {c.outs[i]};
    ci.common = c.outs[i].elem;
    for (const auto& [name, a] : c.args) {
      Arg ai = a;
      if (a.kind == Arg::Kind::TensorList || a.kind == Arg::Kind::OptTensorList) {
        if (i >= a.tensors.size() || !a.tensors[i]) throw Unsupported("_foreach_" + op + ": ragged list");
        ai.kind = Arg::Kind::Tensor;
        ai.tensor = *a.tensors[i];
        ai.tensors.clear();
      } else if (a.kind == Arg::Kind::Tensor && name == "scalars" && a.tensor.rank() != 0) {
        // _foreach_addcdiv_.Tensor: one scalar per element in a 1-D tensor.
        throw Unsupported("_foreach_" + op + ": per-element scalars tensor");
      }
      ci.args.emplace_back(element_arg(op, name), std::move(ai));
    }
    res.push_back(e->fn(b, ci)[0]);
  }
  return res;
}

}  // namespace

#define TPU_FOREACH(op) \
  TPU_LOWER_WITH(_foreach_##op, .foreach = true) { return foreach_apply(b, c, #op); }
TPU_FOREACH(add)
TPU_FOREACH(sub)
TPU_FOREACH(mul)
TPU_FOREACH(div)
TPU_FOREACH(addcdiv)
TPU_FOREACH(addcmul)
TPU_FOREACH(sqrt)
TPU_FOREACH(rsqrt)
TPU_FOREACH(neg)
TPU_FOREACH(reciprocal)
TPU_FOREACH(pow)
TPU_FOREACH(lerp)
TPU_FOREACH(maximum)
TPU_FOREACH(minimum)
TPU_FOREACH(abs)
TPU_FOREACH(exp)
TPU_FOREACH(sign)
TPU_FOREACH(clamp_min)
TPU_FOREACH(clamp_max)
TPU_FOREACH(copy)
TPU_FOREACH(zero)
#undef TPU_FOREACH

// _foreach_norm(self, ord, dtype): linalg_vector_norm over all dims of each element.
TPU_LOWER_WITH(_foreach_norm, .foreach = true) { return foreach_apply(b, c, "linalg_vector_norm"); }

}  // namespace tpu::lowering
