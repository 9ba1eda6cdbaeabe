#include "view_io.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace tpu::runtime {

using shlo::Builder;
using shlo::ElemType;
using shlo::Shape;
using shlo::Type;
using shlo::Value;

int64_t ViewDesc::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

namespace {

// Dims that matter for addressing: size > 1 and stride != 0, ordered by decreasing stride.
struct Layout {
  std::vector<int64_t> real;  // original dim indices with size > 1 and stride > 0, in order
  std::vector<int64_t> ord;   // `real` sorted by decreasing stride (stable)
  bool has_broadcast = false; // some dim has size > 1 and stride 0
  bool dense = false;         // ord dims form a contiguous block
  int64_t span = 1;           // elements in that block when dense
};

Layout analyze(const ViewDesc& v) {
  Layout l;
  for (size_t i = 0; i < v.sizes.size(); ++i) {
    if (v.sizes[i] <= 1) continue;
    if (v.strides[i] == 0) {
      l.has_broadcast = true;
      continue;
    }
    l.real.push_back(static_cast<int64_t>(i));
  }
  l.ord = l.real;
  std::stable_sort(l.ord.begin(), l.ord.end(),
                   [&](int64_t a, int64_t b) { return v.strides[a] > v.strides[b]; });
  int64_t expect = 1;
  l.dense = true;
  for (auto it = l.ord.rbegin(); it != l.ord.rend(); ++it) {
    if (v.strides[*it] != expect) l.dense = false;
    expect *= v.sizes[*it];
  }
  l.span = expect;
  return l;
}

Value as_elem(Builder& b, Value x, ElemType elem) {
  if (x.elem() == elem) return x;
  // Complex values <-> their (re, im) pairs in memory order, flat: a storage whose fused pending
  // value has the other type (view_as_real / view_as_complex; strict eager retypes the storage
  // first, aten/plan_call.cc). bitcast_convert excludes complex.
  if (shlo::is_complex(x.elem()) && !shlo::is_complex(elem)) {
    const int64_t n = x.type.numel();
    Value f = b.reshape(x, {n, 1});
    return as_elem(b, b.reshape(b.concatenate({b.real(f), b.imag(f)}, 1), {2 * n}), elem);
  }
  if (!shlo::is_complex(x.elem()) && shlo::is_complex(elem)) {
    Value p = as_elem(b, b.reshape(x, {x.type.numel()}), shlo::part_type(elem));
    const int64_t n = p.type.numel() / 2;
    p = b.reshape(p, {n, 2});
    return b.complex(b.reshape(b.slice(p, {0, 0}, {n, 1}), {n}), b.reshape(b.slice(p, {0, 1}, {n, 2}), {n}));
  }
  if (shlo::bit_width(x.elem()) != shlo::bit_width(elem) || x.elem() == ElemType::Pred ||
      elem == ElemType::Pred)
    throw std::invalid_argument("torch_tpu: reinterpreting storage between element types of "
                                "different widths");
  return b.bitcast(x, Type{elem, x.shape()});
}

// Index (into the flat storage) of every element of the view, shaped like the view.
Value flat_indices(Builder& b, const ViewDesc& v, int64_t storage_numel) {
  ElemType it = storage_numel < (int64_t{1} << 31) ? ElemType::S32 : ElemType::S64;
  Type t{it, v.sizes};
  Value idx = b.constant_i(v.offset, it, v.sizes);
  for (size_t d = 0; d < v.sizes.size(); ++d) {
    if (v.sizes[d] <= 1 || v.strides[d] == 0) continue;
    Value io = b.iota(t, static_cast<int64_t>(d));
    idx = b.add(idx, b.mul(io, b.constant_i(v.strides[d], it, v.sizes)));
  }
  return idx;
}

// Permutation that brings dims stored in `ord` order back to `real` order.
std::vector<int64_t> back_perm(const Layout& l) {
  std::vector<int64_t> perm;
  for (int64_t r : l.real) {
    perm.push_back(std::find(l.ord.begin(), l.ord.end(), r) - l.ord.begin());
  }
  return perm;
}

// From a value laid out over `real` dims (in real order) to the full view shape.
Value expand_to_view(Builder& b, Value x, const Layout& l, const ViewDesc& v) {
  std::vector<int64_t> dims = l.real;  // positions of x's dims inside the view shape
  return b.broadcast_in_dim(x, v.sizes, dims);
}

}  // namespace

bool ViewDesc::covers(int64_t storage_numel) const {
  if (offset != 0 || numel() != storage_numel) return false;
  int64_t expect = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] != 1 && strides[i] != expect) return false;
    expect *= sizes[i];
  }
  return true;
}

std::optional<std::vector<int64_t>> ViewDesc::permuted_whole(int64_t storage_numel) const {
  if (offset != 0 || storage_numel == 0 || numel() != storage_numel) return std::nullopt;
  Layout l = analyze(*this);
  if (!l.dense || l.has_broadcast || l.span != storage_numel) return std::nullopt;
  std::vector<int64_t> dims;
  for (int64_t d : l.ord) dims.push_back(sizes[d]);
  return dims;
}

Value read_view(Builder& b, Value storage, const ViewDesc& v) {
  storage = as_elem(b, storage, v.elem);
  const int64_t n = storage.type.numel();
  if (v.numel() == 0) return b.zeros(Type{v.elem, v.sizes});
  // The storage's own shape (runtime/storage.h): the parameter itself, no reshape.
  if (storage.shape() == v.sizes && v.covers(n)) return storage;
  if (v.covers(n)) return b.reshape(storage, v.sizes);
  if (storage.shape().size() != 1) storage = b.reshape(storage, {n});  // a bitcast: flat addressing
  Layout l = analyze(v);
  Shape real_sizes;
  for (int64_t d : l.ord) real_sizes.push_back(v.sizes[d]);
  if (l.dense) {
    Value x = b.slice(storage, {v.offset}, {v.offset + l.span});
    x = b.reshape(x, real_sizes);
    x = b.transpose(x, back_perm(l));
    return expand_to_view(b, x, l, v);
  }
  // Nested strided box: each stride a multiple of the next and rows that do not overlap.
  bool boxed = !l.ord.empty();
  for (size_t i = 0; boxed && i + 1 < l.ord.size(); ++i) {
    int64_t s0 = v.strides[l.ord[i]], s1 = v.strides[l.ord[i + 1]];
    boxed = s0 % s1 == 0 && s0 / s1 >= v.sizes[l.ord[i + 1]];
  }
  if (boxed) {
    int64_t s0 = v.strides[l.ord[0]];
    int64_t end = v.offset + v.sizes[l.ord[0]] * s0;
    Value x = storage;
    if (end > n) x = b.pad(x, b.zeros(Type{v.elem, {}}), {0}, {end - n});
    x = b.slice(x, {v.offset}, {end});
    Shape cur{v.sizes[l.ord[0]], s0};
    x = b.reshape(x, cur);
    for (size_t i = 1; i < l.ord.size(); ++i) {
      int64_t prev = v.strides[l.ord[i - 1]], s = v.strides[l.ord[i]];
      Shape split = cur;
      split.back() = prev / s;
      split.push_back(s);
      x = b.reshape(x, split);
      Shape start(split.size(), 0), limit = split;
      limit[limit.size() - 2] = v.sizes[l.ord[i]];
      x = b.slice(x, start, limit);
      cur = limit;
    }
    // Keep element 0 of the innermost stride.
    Shape start(cur.size(), 0), limit = cur;
    limit.back() = 1;
    x = b.slice(x, start, limit);
    x = b.reshape(x, real_sizes);
    x = b.transpose(x, back_perm(l));
    return expand_to_view(b, x, l, v);
  }
  // General case (overlapping windows such as unfold, odd strides): gather.
  Value idx = flat_indices(b, v, n);
  Shape ishape = v.sizes;
  ishape.push_back(1);
  idx = b.reshape(idx, ishape);
  return b.gather(storage, idx, {}, {0}, {0}, static_cast<int64_t>(v.sizes.size()), {1}, v.sizes);
}

namespace {
// A write through `v` into the flat storage value [n] (dynamic-update-slice or scatter).
Value write_flat(Builder& b, Value storage, Value value, const ViewDesc& v, int64_t n) {
  Layout l = analyze(v);
  if (l.dense && !l.has_broadcast) {
    Shape real_sizes;
    for (int64_t d : l.real) real_sizes.push_back(v.sizes[d]);
    Value x = b.reshape(value, real_sizes);
    std::vector<int64_t> to_ord;  // real order -> ord order
    for (int64_t o : l.ord) to_ord.push_back(std::find(l.real.begin(), l.real.end(), o) - l.real.begin());
    x = b.transpose(x, to_ord);
    x = b.reshape(x, {l.span});
    if (l.span == n) return x;
    ElemType it = n < (int64_t{1} << 31) ? ElemType::S32 : ElemType::S64;
    return b.dynamic_update_slice(storage, x, {b.constant_i(v.offset, it)});
  }
  Value idx = flat_indices(b, v, n);
  int64_t m = v.numel();
  idx = b.reshape(idx, {m, 1});
  Value upd = b.reshape(value, {m});
  return b.scatter(storage, idx, upd, {}, {0}, {0}, 1, "");
}

}  // namespace

Value write_view(Builder& b, Value storage, Value value, const ViewDesc& v, int64_t n,
                 ElemType storage_elem) {
  value = as_elem(b, value, storage_elem);
  if (v.covers(n)) return value;  // the storage takes the view's shape (runtime/storage.h)
  if (v.permuted_whole(n)) {  // every element, in another order: the storage takes memory order
    Layout l = analyze(v);
    Shape real_sizes;
    for (int64_t d : l.real) real_sizes.push_back(v.sizes[d]);
    std::vector<int64_t> to_ord;  // real order -> ord order
    for (int64_t o : l.ord) to_ord.push_back(std::find(l.real.begin(), l.real.end(), o) - l.real.begin());
    return b.transpose(b.reshape(value, real_sizes), to_ord);
  }
  if (storage.id < 0) throw std::logic_error("write_view: partial write needs the old storage");
  storage = as_elem(b, storage, storage_elem);  // a fused pending value of the other complex-ness
  if (v.numel() == 0) return storage;
  // A partial write keeps the storage's dims: addressed flat, reshaped back (both bitcasts).
  const Shape dims = storage.shape();
  Value flat = write_flat(b, dims.size() == 1 ? storage : b.reshape(storage, {n}), value, v, n);
  return dims.size() == 1 ? flat : b.reshape(flat, dims);
}


}  // namespace tpu::runtime
