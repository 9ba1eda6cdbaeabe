// Constant/gather helpers shared by the pooling and upsample lowerings (defined in pooling.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "lowering.h"

namespace tpu::lowering {

// 1-d dense constant of host integers (S64/S32/Pred) / floats.
Value pool_const_ints(Builder& b, const std::vector<int64_t>& v, ElemType t);
Value pool_const_floats(Builder& b, const std::vector<double>& v, ElemType t);
// x's slices along `dim` at the host indices `idx` (one gather).
Value pool_take(Builder& b, Value x, int64_t dim, const std::vector<int64_t>& idx);
// out[..., q, ...] = sum_j w[q][j] * x[..., lists[q][j], ...] along `dim` (w empty: weight 1).
Value pool_ragged_sum(Builder& b, Value x, int64_t dim, const std::vector<std::vector<int64_t>>& lists,
                      const std::vector<std::vector<double>>& w);

}  // namespace tpu::lowering
