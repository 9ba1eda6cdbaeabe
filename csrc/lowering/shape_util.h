// Dimension-list and reshape helpers shared by the reduction and normalization lowerings.
#pragma once

#include <cstdint>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {

inline bool contains(const std::vector<int64_t>& dims, int64_t d) {
  for (int64_t x : dims)
    if (x == d) return true;
  return false;
}

// `s` with `dims` removed (keep = false) or set to 1 (keep = true).
inline Shape reduced_shape(const Shape& s, const std::vector<int64_t>& dims, bool keep) {
  Shape r;
  for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i) {
    if (!contains(dims, i)) r.push_back(s[i]);
    else if (keep) r.push_back(1);
  }
  return r;
}

// 0, 1, ..., rank - 1.
inline std::vector<int64_t> all_dims(int64_t rank) {
  std::vector<int64_t> d;
  for (int64_t i = 0; i < rank; ++i) d.push_back(i);
  return d;
}

// Number of elements over `dims` of `s`.
inline int64_t reduced_numel(const Shape& s, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= s[d];
  return n;
}

// `v` reshaped to the output type's shape when the element counts match (a reduced value in the
// keepdim = false layout, mean/rstd as [M] or [M, 1, 1], ...); otherwise unchanged.
inline Value reshape_to_output(Builder& b, Value v, const Type& o) {
  if (v.type.numel() == o.numel()) return b.reshape(v, o.shape);
  return v;
}

// Sum over `dims` (dropped from the shape).
inline Value sum_over(Builder& b, Value x, const std::vector<int64_t>& dims) {
  return b.reduce(x, b.constant_i(0, x.elem()), dims, "add");
}

}  // namespace tpu::lowering
