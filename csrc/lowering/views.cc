// View and copy ops as value computations, for whole-graph programs (torch.compile). Eager never
// uses these: there, views are metadata over storages (runtime/view_io). All are dtype-generic
// (complex too: TPU_LOWER_GRAPH_COMPLEX).
#include <algorithm>

#include "lowering.h"

namespace tpu::lowering {

namespace {

// Elements of a logical (row-major) array read with explicit sizes/strides/offset.
Value strided_read(Builder& b, Value x, const Shape& sizes, const std::vector<int64_t>& strides, int64_t offset) {
  int64_t n = x.type.numel();
  Value flat = b.reshape(x, {n});
  ElemType it = ElemType::S64;
  Value idx = b.constant_i(offset, it, sizes);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] <= 1 || strides[d] == 0) continue;
    idx = b.add(idx, b.mul(b.iota(Type{it, sizes}, static_cast<int64_t>(d)), b.constant_i(strides[d], it, sizes)));
  }
  Shape ishape = sizes;
  ishape.push_back(1);
  return b.gather(flat, b.reshape(idx, ishape), {}, {0}, {0}, static_cast<int64_t>(sizes.size()), {1}, sizes);
}

std::vector<int64_t> contiguous_strides(const Shape& s) {
  std::vector<int64_t> st(s.size(), 1);
  for (int64_t i = static_cast<int64_t>(s.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * std::max<int64_t>(s[i + 1], 1);
  return st;
}

Value first_tensor(const OpCall& c) {
  for (const auto& [k, a] : c.args)
    if (a.kind == Arg::Kind::Tensor) return a.tensor;
  throw Unsupported(c.name + ": no tensor argument");
}

}  // namespace

#define TPU_RESHAPE_LIKE(name) \
  TPU_LOWER_GRAPH_COMPLEX(name) { return {b.reshape(first_tensor(c), out_type(c).shape)}; }
TPU_RESHAPE_LIKE(view)
TPU_RESHAPE_LIKE(_unsafe_view)
TPU_RESHAPE_LIKE(reshape)
TPU_RESHAPE_LIKE(_reshape_alias)
TPU_RESHAPE_LIKE(unsqueeze)
TPU_RESHAPE_LIKE(squeeze)
TPU_RESHAPE_LIKE(alias)
TPU_RESHAPE_LIKE(clone)
TPU_RESHAPE_LIKE(lift_fresh_copy)
TPU_RESHAPE_LIKE(detach)
TPU_RESHAPE_LIKE(contiguous)
TPU_RESHAPE_LIKE(_to_copy)  // the runtime converts to the output dtype
#undef TPU_RESHAPE_LIKE

TPU_LOWER_GRAPH_COMPLEX(permute) {
  Value x = c.tensor("self");
  std::vector<int64_t> dims;
  for (int64_t d : c.ints("dims")) dims.push_back(norm_dim(d, x.rank()));
  return {b.transpose(x, dims)};
}

TPU_LOWER_GRAPH_COMPLEX(t) {
  Value x = c.tensor("self");
  return {x.rank() < 2 ? x : b.transpose(x, {1, 0})};
}

TPU_LOWER_GRAPH_COMPLEX(transpose) {
  Value x = c.tensor("self");
  std::vector<int64_t> perm(x.rank());
  for (int64_t i = 0; i < x.rank(); ++i) perm[i] = i;
  if (x.rank() > 0) std::swap(perm[norm_dim(c.int_("dim0"), x.rank())], perm[norm_dim(c.int_("dim1"), x.rank())]);
  return {b.transpose(x, perm)};
}

TPU_LOWER_GRAPH_COMPLEX(expand) { return {b.broadcast_to(c.tensor("self"), out_type(c).shape)}; }

TPU_LOWER_GRAPH_COMPLEX(slice) {
  Value x = c.tensor("self");
  int64_t dim = norm_dim(c.int_("dim"), x.rank());
  int64_t size = x.shape()[dim];
  int64_t step = c.int_("step", 1);
  int64_t start = c.has("start") ? c.arg("start").i : 0;
  if (start < 0) start += size;
  start = std::clamp<int64_t>(start, 0, size);
  int64_t len = out_type(c).shape[dim];
  Shape st(x.rank(), 0), lim = x.shape(), strides(x.rank(), 1);
  st[dim] = start;
  lim[dim] = len == 0 ? start : start + (len - 1) * step + 1;
  strides[dim] = step;
  return {b.slice(x, st, lim, strides)};
}

TPU_LOWER_GRAPH_COMPLEX(select) {
  Value x = c.tensor("self");
  int64_t dim = norm_dim(c.int_("dim"), x.rank());
  int64_t idx = c.int_("index");
  if (idx < 0) idx += x.shape()[dim];
  Shape st(x.rank(), 0), lim = x.shape();
  st[dim] = idx;
  lim[dim] = idx + 1;
  return {b.reshape(b.slice(x, st, lim), out_type(c).shape)};
}

TPU_LOWER_GRAPH_COMPLEX(as_strided) {
  Value x = c.tensor("self");
  return {strided_read(b, x, out_type(c).shape, c.ints("stride"), c.int_("storage_offset", 0))};
}

TPU_LOWER_GRAPH_COMPLEX(diagonal) {
  Value x = c.tensor("self");
  int64_t d1 = norm_dim(c.int_("dim1", 0), x.rank()), d2 = norm_dim(c.int_("dim2", 1), x.rank());
  int64_t off = c.int_("offset", 0);
  auto cs = contiguous_strides(x.shape());
  std::vector<int64_t> strides;
  for (int64_t i = 0; i < x.rank(); ++i)
    if (i != d1 && i != d2) strides.push_back(cs[i]);
  strides.push_back(cs[d1] + cs[d2]);
  int64_t base = off >= 0 ? off * cs[d2] : -off * cs[d1];
  if (out_type(c).shape.back() == 0) base = 0;
  return {strided_read(b, x, out_type(c).shape, strides, base)};
}

// Multi-output splits: one slice per returned tensor.
static std::vector<Value> split_along(Builder& b, Value x, int64_t dim, const std::vector<int64_t>& sizes) {
  std::vector<Value> out;
  int64_t pos = 0;
  for (int64_t s : sizes) {
    Shape st(x.rank(), 0), lim = x.shape();
    st[dim] = pos;
    lim[dim] = pos + s;
    out.push_back(b.slice(x, st, lim));
    pos += s;
  }
  return out;
}

TPU_LOWER_GRAPH_COMPLEX(split_with_sizes) {
  Value x = c.tensor("self");
  return split_along(b, x, norm_dim(c.int_("dim"), x.rank()), c.ints("split_sizes"));
}

TPU_LOWER_GRAPH_COMPLEX(split) {
  Value x = c.tensor("self");
  int64_t dim = norm_dim(c.int_("dim"), x.rank());
  std::vector<int64_t> sizes;
  for (const Type& t : c.outs) sizes.push_back(t.shape[dim]);
  return split_along(b, x, dim, sizes);
}

TPU_LOWER_GRAPH_COMPLEX(unbind) {
  Value x = c.tensor("self");
  int64_t dim = norm_dim(c.int_("dim", 0), x.rank());
  std::vector<Value> out;
  for (size_t i = 0; i < c.outs.size(); ++i) {
    Shape st(x.rank(), 0), lim = x.shape();
    st[dim] = static_cast<int64_t>(i);
    lim[dim] = static_cast<int64_t>(i) + 1;
    out.push_back(b.reshape(b.slice(x, st, lim), c.outs[i].shape));
  }
  return out;
}

}  // namespace tpu::lowering

namespace tpu::lowering {

// Creation ops as they appear in compiled graphs (eager runs them through composites).
TPU_LOWER_GRAPH_COMPLEX(scalar_tensor) {
  const Type& o = out_type(c);
  return {operand(b, c.arg("s"), o.elem, o.shape)};
}

TPU_LOWER_GRAPH_COMPLEX(full) {
  const Type& o = out_type(c);
  return {operand(b, c.arg("fill_value"), o.elem, o.shape)};
}

TPU_LOWER_GRAPH_COMPLEX(full_like) {
  const Type& o = out_type(c);
  return {operand(b, c.arg("fill_value"), o.elem, o.shape)};
}

#define TPU_CONST_LIKE(name, v) \
  TPU_LOWER_GRAPH_COMPLEX(name) { return {b.constant_i(v, out_type(c).elem, out_type(c).shape)}; }
TPU_CONST_LIKE(zeros_like, 0)
TPU_CONST_LIKE(ones_like, 1)
TPU_CONST_LIKE(empty_like, 0)
TPU_CONST_LIKE(empty, 0)
TPU_CONST_LIKE(new_empty, 0)
TPU_CONST_LIKE(new_zeros, 0)
TPU_CONST_LIKE(new_ones, 1)
TPU_CONST_LIKE(zeros, 0)
TPU_CONST_LIKE(ones, 1)
TPU_CONST_LIKE(empty_strided, 0)
TPU_CONST_LIKE(empty_permuted, 0)
#undef TPU_CONST_LIKE

}  // namespace tpu::lowering
