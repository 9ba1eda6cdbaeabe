// _foreach_* ops in compiled graphs (Dynamo-traced optimizers): the per-tensor lowering of the
// underlying op applied to every list element. Eager keeps PyTorch's composite loops, which
// already reach the per-tensor lowerings.
#include "lowering.h"

namespace tpu::lowering {

namespace {

// Builds element i's call of `op`: list arguments contribute their i-th tensor, scalars pass
// through, and foreach's "scalar"/"scalars" arguments become the op's "other".
std::vector<Value> foreach_apply(Builder& b, const OpCall& c, const std::string& op) {
  const OpEntry* e = find_op(op);
  if (!e) throw Unsupported("_foreach_" + op + ": no lowering for " + op);
  size_t n = c.outs.size();
  std::vector<Value> res;
  for (size_t i = 0; i < n; ++i) {
    OpCall ci;
    ci.name = op;
    ci.overload = c.overload;
    ci.outs = {c.outs[i]};
    ci.common = c.outs[i].elem;
    for (const auto& [name, a] : c.args) {
      std::string nm = (name == "scalar" || name == "scalars") ? "other" : name;
      Arg ai = a;
      if (a.kind == Arg::Kind::TensorList || a.kind == Arg::Kind::OptTensorList) {
        if (i >= a.tensors.size() || !a.tensors[i]) throw Unsupported("_foreach_" + op + ": ragged list");
        ai.kind = Arg::Kind::Tensor;
        ai.tensor = *a.tensors[i];
        ai.tensors.clear();
      }
      ci.args.emplace_back(nm, std::move(ai));
    }
    res.push_back(e->fn(b, ci)[0]);
  }
  return res;
}

}  // namespace

#define TPU_FOREACH(op) \
  TPU_LOWER_GRAPH(_foreach_##op) { return foreach_apply(b, c, #op); }
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
#undef TPU_FOREACH

}  // namespace tpu::lowering
