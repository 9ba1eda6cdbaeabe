// aten::_grouped_mm: one matrix product per group, groups given by `offs` (int32 cumulative
// group ends), without reading the offsets back to the host (PyTorch's generic kernel loops
// over groups with one .item() each).
//
// Forms (G groups; row/column/contraction index r belongs to group #{g : offs[g] <= r}):
//   2-D x 3-D  [M,K] x [G,K,N] -> [M,N]    offs over the rows of self
//   3-D x 2-D  [G,M,K] x [K,N] -> [M,N]    offs over the columns of mat2
//   2-D x 2-D  [M,K] x [K,N]  -> [G,M,N]   offs over K (weight gradients)
//   3-D x 3-D  [G,M,K] x [G,K,N] -> [G,M,N] (batched, no offs)
// Rows (columns) at or past offs[G-1] belong to no group: PyTorch leaves them uninitialised,
// we write zeros. Empty groups give zero blocks (2-D x 2-D) or simply own no rows. Offsets
// must be non-decreasing (as PyTorch's CUDA kernel requires; the CPU's loop then agrees).
//
// Strategy (measured on XLA:CPU at MoE decode sizes, benchmarks/bench_grouped_mm.py):
// - 2-D x 3-D (the MoE forward and input gradients): a *window* of T rows per group gathered into
//   [G, T, K], one batched GEMM against the weights in place (each expert read once, no weight
//   copies), results gathered back per row; T is the smallest window of a static ladder that
//   holds the largest group, picked on device by stablehlo.case (no sync; ~1.5x the useful rows
//   for balanced routing, exact for any). With fewer rows than half the groups (decode batch
//   1-3), each row gathers its own expert's weights instead (batched mat-vec).
// - 2-D x 2-D (weight gradients): the same windows over K, masked to each group by a select.
// - 3-D x 2-D: every group's product densely (G x the useful flops), each column keeps its own
//   group's result with a select.
// The earlier tiled path (T-row tiles x (tile, group) pairs, one weight copy per pair) and the
// dense masked path stay selectable with TORCH_TPU_GROUPED_MM=tiled|dense for comparison: the
// weight copies made the tiled path 2-5x slower than the windowed one at decode batch 64.
// Selects, never masked multiplies: a NaN/inf in one expert's weights never leaks into rows
// routed elsewhere (0 * inf = NaN). float16/bfloat16 accumulate in float32 like mm; the
// runtime converts back.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "host_kernels.h"
#include "lowering.h"

namespace tpu::lowering {
namespace {

constexpr ElemType I64 = ElemType::S64;

// dot_general with both operands in one element type and a result of type `t`.
Value gdot(Builder& b, Value l, Value r, const std::vector<int64_t>& lb, const std::vector<int64_t>& rb,
           const std::vector<int64_t>& lc, const std::vector<int64_t>& rc, ElemType t) {
  if (l.elem() != r.elem() || !shlo::is_float(l.elem()) || shlo::bit_width(l.elem()) > shlo::bit_width(t)) {
    l = b.convert(l, t);
    r = b.convert(r, t);
  }
  return b.dot_general(l, r, lb, rb, lc, rc, t);
}

// Group id of each index 0..n-1 along a grouped dim: #{g : offs[g] <= i}, shape [n], s64.
// Equals G for indices past the last offset.
Value group_ids(Builder& b, Value offs, int64_t n) {
  const int64_t g = offs.shape()[0];
  Value o = b.broadcast_in_dim(b.convert(offs, I64), {n, g}, {1});
  Value i = b.iota(Type{I64, {n, g}}, 0);
  Value le = b.convert(b.compare(Cmp::LE, o, i), I64);
  return b.reduce(le, b.constant_i(0, I64), {1}, "add");
}

// mask[...] = (gid along `gid_dim` == group index along `g_dim`), for a result of `shape`.
Value group_mask(Builder& b, Value gid, const Shape& shape, int64_t gid_dim, int64_t g_dim) {
  Value gi = b.broadcast_in_dim(gid, shape, {gid_dim});
  return b.compare(Cmp::EQ, gi, b.iota(Type{I64, shape}, g_dim));
}

// Sums `all` over its group dim `g_dim`, keeping only the entries selected by `mask`.
Value select_group(Builder& b, Value all, Value mask, int64_t g_dim) {
  Value kept = b.select(mask, all, b.zeros(all.type));
  return b.reduce(kept, b.constant_i(0, all.elem()), {g_dim}, "add");
}

// ---- tiled path: rows sorted by group, cut into T-row tiles; each (tile, group) pair that can
// hold rows is one small GEMM. A tile overlaps groups first..last of its rows, and consecutive
// tiles share at most their boundary group, so nt + G - 1 pairs always suffice (a static
// count): (L + (G-1) T) rows of GEMM instead of G L, plus a copy of each pair's expert weights.

// x[idx[p]] for every p: [D0, rest...] x [P] -> [P, rest...].
Value take_leading(Builder& b, Value x, Value idx) {
  const int64_t p = idx.shape()[0];
  Shape slice = x.shape(), result = x.shape();
  slice[0] = 1;
  result[0] = p;
  std::vector<int64_t> offset_dims;
  for (int64_t d = 1; d < x.rank(); ++d) offset_dims.push_back(d);
  return b.gather(x, b.reshape(idx, {p, 1}), offset_dims, {0}, {0}, 1, slice, result);
}

struct Tiling {
  int64_t t = 0, nt = 0, p = 0;  // tile size, tiles, pairs
  Value tile;   // [P] s64, the pair's tile (clamped)
  Value group;  // [P] s64, the pair's group (clamped)
  Value rows;   // [P, T] pred: row j of the pair's tile belongs to the pair's group (and is real)
  Value first_pair, pair_count;  // [nt] s64: tile i owns pairs first_pair[i] .. + pair_count[i] - 1
};

int64_t tile_size(int64_t len, int64_t g) {
  int64_t per = (len + g - 1) / g, t = 8;
  while (t < per && t < 128) t *= 2;
  return t;
}

// Worth it when it saves at least half of the dense path's GEMM rows.
bool use_tiles(int64_t len, int64_t g) {
  if (g < 2) return false;
  const int64_t t = tile_size(len, g);
  return g * len >= 2 * (len + (g - 1) * t);
}

Tiling make_tiling(Builder& b, Value offs, int64_t len) {
  Tiling tl;
  const int64_t g = offs.shape()[0];
  tl.t = tile_size(len, g);
  tl.nt = (len + tl.t - 1) / tl.t;
  tl.p = tl.nt + g - 1;
  const int64_t lp = tl.nt * tl.t, nt = tl.nt, p = tl.p, t = tl.t;
  Value gid = group_ids(b, offs, lp);  // padded indices get G (or are masked below)
  Value real = b.compare(Cmp::LT, b.iota(Type{I64, {lp}}, 0), b.constant_i(len, I64, {lp}));
  gid = b.select(real, gid, b.constant_i(g, I64, {lp}));
  Value gt = b.reshape(gid, {nt, t});
  Value first = b.reshape(b.slice(gt, {0, 0}, {nt, 1}), {nt});
  Value last = b.reshape(b.slice(gt, {0, t - 1}, {nt, t}), {nt});
  Value gmax = b.constant_i(g - 1, I64, {nt});
  Value zero_t = b.constant_i(0, I64, {nt});
  // Pairs per tile: groups first..min(last, G-1); none when the tile is past the last group.
  Value cnt = b.add(b.sub(b.min(last, gmax), first), b.constant_i(1, I64, {nt}));
  cnt = b.select(b.compare(Cmp::GT, first, gmax), zero_t, cnt);
  // Inclusive/exclusive prefix sums over tiles (nt is small: a [nt, nt] triangle).
  Value ii = b.iota(Type{I64, {nt, nt}}, 0), jj = b.iota(Type{I64, {nt, nt}}, 1);
  Value cb = b.broadcast_in_dim(cnt, {nt, nt}, {1});
  Value zero_nn = b.zeros(Type{I64, {nt, nt}});
  Value end = b.reduce(b.select(b.compare(Cmp::LE, jj, ii), cb, zero_nn), b.constant_i(0, I64), {1}, "add");
  Value start = b.sub(end, cnt);
  // Pair q lies in the first tile whose end exceeds q.
  Value q = b.iota(Type{I64, {p, nt}}, 0);
  Value eb = b.broadcast_in_dim(end, {p, nt}, {1});
  Value tile = b.reduce(b.convert(b.compare(Cmp::LE, eb, q), I64), b.constant_i(0, I64), {1}, "add");
  Value valid = b.compare(Cmp::LT, tile, b.constant_i(nt, I64, {p}));
  tile = b.min(tile, b.constant_i(nt - 1, I64, {p}));
  Value qi = b.iota(Type{I64, {p}}, 0);
  Value group = b.add(take_leading(b, first, tile), b.sub(qi, take_leading(b, start, tile)));
  group = b.clamp(b.constant_i(0, I64, {p}), group, b.constant_i(g - 1, I64, {p}));
  Value pg = take_leading(b, gt, tile);  // [P, T] group of each row of the pair's tile
  Value rows = b.compare(Cmp::EQ, pg, b.broadcast_in_dim(group, {p, t}, {0}));
  rows = b.and_(rows, b.broadcast_in_dim(valid, {p, t}, {0}));
  tl.tile = tile;
  tl.group = group;
  tl.rows = rows;
  tl.first_pair = start;
  tl.pair_count = cnt;
  return tl;
}

// Entry q of a 1-D s64 value as a 0-d value.
Value at(Builder& b, Value v, int64_t q) { return b.reshape(b.slice(v, {q}, {q + 1}), {}); }

// [M,K] x [G,K,N] with offs over the M rows, tiled. Pairs are unrolled into small GEMMs whose
// operands are dynamic slices (plain copies): XLA:CPU's gather of large windows (each pair's
// expert weights) is an order of magnitude slower, and so is one batched GEMM over stacked
// slices. Operands are widened to the compute type first (XLA:CPU's dot thunk has no
// bf16 x bf16 -> f32 form; bf16 products are exact in f32 anyway).
Value rows_tiled(Builder& b, Value a, Value w, Value offs, ElemType t, bool w_col_major) {
  const int64_t m = a.shape()[0], k = a.shape()[1], n = w.shape()[2], g = offs.shape()[0];
  Tiling tl = make_tiling(b, offs, m);
  const int64_t mp = tl.nt * tl.t, tt = tl.t;
  if (mp > m) a = b.pad(a, b.constant_i(0, a.elem()), {0, 0}, {mp - m, 0});
  Value zero = b.constant_i(0, I64);
  Value row0 = b.mul(tl.tile, b.constant_i(tt, I64, {tl.p}));
  // Each expert as one row in the storage's own order: the slices are contiguous copies and a
  // column-major mat2 (Transformers passes weight.transpose(-2, -1)) is never transposed as a
  // whole: transpose(transpose(param)) folds away and the GEMM contracts the [N,K] slice.
  Value w2 = w_col_major ? b.reshape(b.transpose(w, {0, 2, 1}), {g, n * k}) : b.reshape(w, {g, k * n});
  std::vector<Value> ys;
  for (int64_t q = 0; q < tl.p; ++q) {
    Value aq = b.convert(b.dynamic_slice(a, {at(b, row0, q), zero}, {tt, k}), t);
    Value wq = b.dynamic_slice(w2, {at(b, tl.group, q), zero}, {1, k * n});
    Value yq = w_col_major ? b.dot_general(aq, b.convert(b.reshape(wq, {n, k}), t), {}, {}, {1}, {1}, t)
                           : b.dot_general(aq, b.convert(b.reshape(wq, {k, n}), t), {}, {}, {1}, {0}, t);
    ys.push_back(b.reshape(yq, {1, tt, n}));
  }
  Value y = b.concatenate(ys, 0);  // [P, T, N]
  y = b.select(b.broadcast_in_dim(tl.rows, y.shape(), {0, 1}), y, b.zeros(y.type));
  // Tile i sums its own pairs' rows: at most min(G, P) consecutive pairs from first_pair[i]
  // (each row is non-zero in exactly one of them). A select-sum over that window rather than a
  // one-hot product, so a NaN stays in its own row; y is padded so no window start is clamped.
  const int64_t win = std::min(g, tl.p);
  y = b.pad(y, b.constant_i(0, t), {0, 0, 0}, {win, 0, 0});
  Value jw = b.iota(Type{I64, {win, tt, n}}, 0);
  std::vector<Value> tiles;
  for (int64_t i = 0; i < tl.nt; ++i) {
    Value yi = b.dynamic_slice(y, {at(b, tl.first_pair, i), zero, zero}, {win, tt, n});
    Value own = b.compare(Cmp::LT, jw, b.broadcast_to(at(b, tl.pair_count, i), {win, tt, n}));
    tiles.push_back(b.reduce(b.select(own, yi, b.zeros(yi.type)), b.constant_i(0, t), {0}, "add"));
  }
  Value out = b.concatenate(tiles, 0);  // [nt * T, N]
  return b.slice(out, {0, 0}, {m, n});
}

// ---- windowed path: group g's rows are [start_g, start_g + size_g) (sorted by group). Each
// group's first T rows are gathered into [G, T, K] and multiplied by the weights in place (one
// batched GEMM, every expert read once, no weight copies), then each row gathers its result
// back. T is the smallest window >= the largest group, picked on device by a stablehlo.case
// over a static ladder of windows (no host sync): balanced decode routing costs ~1.5x the
// useful rows, and any routing stays exact (the last window is all rows).

// Window sizes 8, 16, 24, 32, 48, 64, 96, ... and finally `len` itself.
std::vector<int64_t> windows(int64_t len) {
  std::vector<int64_t> ws;
  for (int64_t w = 8; w < len; w = w < 32 ? w + 8 : w + w / 2) ws.push_back(w);
  ws.push_back(len);
  return ws;
}

struct Groups {
  Value starts, sizes;  // [G] s64
  Value gid;            // [len] s64, G for indices past the last group
  Value pos;            // [len] s64, index within its group (clamped group for past-the-end)
  Value in_group;       // [len] pred
  Value branch;         // 0-d s32: index of the smallest window >= max(sizes)
};

Groups groups_of(Builder& b, Value offs, int64_t len, const std::vector<int64_t>& ws) {
  Groups gr;
  const int64_t g = offs.shape()[0];
  Value ends = b.convert(offs, I64);
  gr.starts = g == 1 ? b.zeros(Type{I64, {1}})
                     : b.concatenate({b.zeros(Type{I64, {1}}), b.slice(ends, {0}, {g - 1})}, 0);
  gr.sizes = b.max(b.sub(ends, gr.starts), b.zeros(Type{I64, {g}}));
  gr.gid = group_ids(b, offs, len);
  gr.in_group = b.compare(Cmp::LT, gr.gid, b.constant_i(g, I64, {len}));
  Value gc = b.min(gr.gid, b.constant_i(g - 1, I64, {len}));
  gr.pos = b.sub(b.iota(Type{I64, {len}}, 0), take_leading(b, gr.starts, gc));
  gr.gid = gc;
  Value mx = b.reduce(gr.sizes, b.constant_i(0, I64), {0}, "maximum");
  const int64_t nw = static_cast<int64_t>(ws.size());
  Value ladder = b.constant_i(0, I64, {nw - 1});
  std::vector<Value> small;
  for (int64_t j = 0; j + 1 < nw; ++j) small.push_back(b.constant_i(ws[j], I64, {1}));
  Value below = nw > 1 ? b.convert(b.compare(Cmp::LT, b.concatenate(small, 0), b.broadcast_to(mx, {nw - 1})), I64)
                       : ladder;
  gr.branch = b.convert(nw > 1 ? b.reduce(below, b.constant_i(0, I64), {0}, "add") : b.constant_i(0, I64),
                        ElemType::S32);
  return gr;
}

// [G, T] source indices start_g + j (clamped) and whether j < size_g.
std::pair<Value, Value> window_rows(Builder& b, const Groups& gr, int64_t g, int64_t t, int64_t len) {
  Value j = b.iota(Type{I64, {g, t}}, 1);
  Value rows = b.add(b.broadcast_in_dim(gr.starts, {g, t}, {0}), j);
  rows = b.clamp(b.constant_i(0, I64, {g, t}), rows, b.constant_i(len - 1, I64, {g, t}));
  Value valid = b.compare(Cmp::LT, j, b.broadcast_in_dim(gr.sizes, {g, t}, {0}));
  return {rows, valid};
}

// One branch per window; `body(T)` builds the result for window T.
Value window_case(Builder& b, const Groups& gr, const std::vector<int64_t>& ws, const Type& out,
                  const std::function<Value(int64_t)>& body) {
  if (ws.size() == 1) return body(ws[0]);
  std::string regions;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (i) regions += ", ";
    regions += b.region({}, [&](const std::vector<Value>&) { return std::vector<Value>{body(ws[i])}; });
  }
  return b.op_multi("case", {gr.branch}, {out}, "", regions)[0];
}

// The batched product [G,T,K] x [G,K,N] -> [G,T,N]. A column-major `w` (a transposed [G,N,K]
// view, as Transformers passes nn.Linear-layout experts) is contracted on its own last dim: the
// view's transpose and this one fold away. Written as a plain dot, XLA:CPU instead copies the
// whole weight into [G,K,N] on every call (a 16 MB transpose at the benchmark shape, 27 ms in
// f32 and 6 ms in bf16 against 5 / 1 ms for the contraction over [G,N,K]).
Value batched_rows_dot(Builder& b, Value xs, Value w, ElemType t, bool w_col_major) {
  if (!w_col_major) return gdot(b, xs, w, {0}, {0}, {2}, {1}, t);
  return gdot(b, xs, b.transpose(w, {0, 2, 1}), {0}, {0}, {2}, {2}, t);
}

// [M,K] x [G,K,N] with offs over the M rows.
Value rows_windowed(Builder& b, Value a, Value w, Value offs, ElemType t, bool w_col_major) {
  const int64_t m = a.shape()[0], k = a.shape()[1], n = w.shape()[2], g = offs.shape()[0];
  std::vector<int64_t> ws = windows(m);
  Groups gr = groups_of(b, offs, m, ws);
  const Type out{t, {m, n}};
  return window_case(b, gr, ws, out, [&](int64_t tt) {
    auto [rows, valid] = window_rows(b, gr, g, tt, m);
    (void)valid;  // rows past a group's end compute garbage that no output row gathers
    Value xs = b.reshape(take_leading(b, a, b.reshape(rows, {g * tt})), {g, tt, k});
    Value y = b.reshape(batched_rows_dot(b, xs, w, t, w_col_major), {g * tt, n});
    Value src = b.add(b.mul(gr.gid, b.constant_i(tt, I64, {m})),
                      b.clamp(b.constant_i(0, I64, {m}), gr.pos, b.constant_i(tt - 1, I64, {m})));
    Value r = take_leading(b, y, src);
    return b.select(b.broadcast_in_dim(gr.in_group, {m, n}, {0}), r, b.zeros(out));
  });
}

// Few rows (decode): each row gathers its own expert's weights ([M,K,N], M small) for a batched
// matrix-vector product, instead of reading all G experts.
Value rows_gathered(Builder& b, Value a, Value w, Value offs, ElemType t, bool w_col_major) {
  const int64_t m = a.shape()[0], k = a.shape()[1], n = w.shape()[2], g = offs.shape()[0];
  Value gid = group_ids(b, offs, m);
  Value in_group = b.compare(Cmp::LT, gid, b.constant_i(g, I64, {m}));
  Value idx = b.min(gid, b.constant_i(g - 1, I64, {m}));
  // Each row's expert in the storage's own order ([M,K,N], or [M,N,K] when column-major).
  Value wr = take_leading(b, w_col_major ? b.transpose(w, {0, 2, 1}) : w, idx);
  Value y = b.reshape(batched_rows_dot(b, b.reshape(a, {m, 1, k}), w_col_major ? b.transpose(wr, {0, 2, 1}) : wr,
                                       t, w_col_major), {m, n});
  return b.select(b.broadcast_in_dim(in_group, {m, n}, {0}), y, b.zeros(Type{t, {m, n}}));
}

// [Kh,S] x [S,N] with offs over S -> [G,Kh,N] (weight gradients): each group's window of S
// gathered (masked to the group by a select) into one batched GEMM.
Value k_windowed(Builder& b, Value a, Value w, Value offs, ElemType t) {
  const int64_t kh = a.shape()[0], s = a.shape()[1], n = w.shape()[1], g = offs.shape()[0];
  if (s == 0) return b.zeros(Type{t, {g, kh, n}});
  std::vector<int64_t> ws = windows(s);
  Groups gr = groups_of(b, offs, s, ws);
  Value at_ = b.transpose(a, {1, 0});  // [S, Kh]: gathered by rows like w
  return window_case(b, gr, ws, Type{t, {g, kh, n}}, [&](int64_t tt) {
    auto [rows, valid] = window_rows(b, gr, g, tt, s);
    Value flat = b.reshape(rows, {g * tt});
    Value xa = b.reshape(take_leading(b, at_, flat), {g, tt, kh});
    Value xw = b.reshape(take_leading(b, w, flat), {g, tt, n});
    xa = b.select(b.broadcast_in_dim(valid, {g, tt, kh}, {0, 1}), xa, b.zeros(xa.type));
    xw = b.select(b.broadcast_in_dim(valid, {g, tt, n}, {0, 1}), xw, b.zeros(xw.type));
    return gdot(b, xa, xw, {0}, {0}, {1}, {1}, t);
  });
}

// TORCH_TPU_GROUPED_MM=dense|tiled|windowed|gather forces one strategy (benchmarks, tests).
std::string grouped_mm_path() {
  static const std::string p = [] {
    const char* v = std::getenv("TORCH_TPU_GROUPED_MM");
    return std::string(v ? v : "");
  }();
  return p;
}

// ---- host kernels (lowering/host_kernels.h): on the CPU plugin, one typed FFI custom call whose
// handler runs ATen's CPU GEMM per group on the program's own buffers. Operands in their own
// element type, result in the output's (the GEMM accumulates in float32 for bf16/f16).

std::atomic<bool> host_available{false}, host_enabled{true}, host_any_size{false};

// When the host kernel beats the XLA path, from the work each does on one thread (process CPU time,
// host kernel with torch.set_num_threads(1) vs XLA with --xla_cpu_multi_thread_eigen=false, medians of
// 7-9 alternated rounds, load 8-10, /work/wt/notes/issue-10.md; wall times at that load only agree).
// float32 (MKL): the host kernel did less work at every MoE shape measured, e.g. ms host / XLA
//   forward: 128 rows x [4,64,64] 0.034 / 0.071, 64 x [8,128,128] 0.059 / 0.077,
//   128 x [8,128,256] 0.120 / 0.118, 16 x [8,512,512] 0.38 / 0.51, 128 x [8,512,1024] (decode batch
//   64, the benchmark shape) 1.38-1.51 / 1.85-2.02, 1024 x [8,512,1024] 6.8 / 15.4, 2 x [8,2048,1408]
//   0.92 / 3.9; weight gradient: the same shapes 0.03-0.07 vs 0.04-0.07 at the smallest, 1.26 / 3.47 at
//   the benchmark shape. From 2^20 MACs (or 2^21 weights) it is taken: below, a call is a few tens of
//   microseconds either way.
// bfloat16/float16 (oneDNN, AMX): each group's GEMM costs ~20-25 us of oneDNN setup, so the XLA path
//   wins on small experts: 128 x [8,128,256] 0.25 / 0.08-0.13, 32 x [8,256,512] 0.39 / 0.30,
//   128 x [4,64,64] 0.10 / 0.03-0.06; the host kernel wins once each expert has 2^18 weights
//   (16 x [8,512,512] 0.48 / 0.54, 2 x [8,512,1024] 0.25 / 0.45, the benchmark shape 0.89 / 1.73,
//   8 x [64,2048,768] 2.3 / 23.8) or each group averages 2^20 MACs (1024 x [4,64,64] 0.12 / 0.13,
//   weight gradient 0.15 / 0.33). Weight gradients follow the same bounds (output [G,K,N]).
// The XLA paths' cost grows with the weights (a window of rows per group against every expert), so
// few rows against large experts (decode batch 1-4 of a real-size MoE) take the host kernel however
// few the MACs (8 rows x [64,2048,768]: 10x less work).
constexpr int64_t kHostKernelMinMacs32 = int64_t{1} << 20;
constexpr int64_t kHostKernelMinWeights32 = int64_t{1} << 21;
constexpr int64_t kHostKernelMinGroupMacs16 = int64_t{1} << 20;
constexpr int64_t kHostKernelMinExpert16 = int64_t{1} << 18;
constexpr int64_t kHostKernelMinWeights16 = int64_t{1} << 21;

// Whether this call takes the host kernel: the boxed kernels pass the switch as the hint
// "host_kernel" (part of the plan key); compiled graphs, which have no hint, read it now.
// TORCH_TPU_GROUPED_MM=<strategy> forces an XLA strategy instead. `macs`: rows x K x N over all
// groups; `g` groups of `k` x `n` weights (the output's [G,K,N] for the weight gradient).
bool use_host_kernel(const OpCall& c, ElemType in, ElemType out, int64_t macs, int64_t g, int64_t k, int64_t n) {
  if (!host_kernels_available() || in != out) return false;
  if (in != ElemType::F32 && in != ElemType::BF16 && in != ElemType::F16) return false;
  const std::string p = grouped_mm_path();
  if (!p.empty() && p != "host") return false;
  const bool on = c.has("host_kernel") ? c.bool_("host_kernel") : host_kernels_enabled();
  const bool any_size = c.has("host_kernel_any_size") ? c.bool_("host_kernel_any_size") : host_kernels_any_size();
  if (!on) return false;
  if (any_size) return true;
  const int64_t weights = g * k * n;
  if (in == ElemType::F32) return macs >= kHostKernelMinMacs32 || weights >= kHostKernelMinWeights32;
  return macs >= std::max<int64_t>(g, 1) * kHostKernelMinGroupMacs16 ||
         (k * n >= kHostKernelMinExpert16 && weights >= kHostKernelMinWeights16);
}

Value host_call(Builder& b, const char* target, const std::vector<Value>& operands, const Type& out,
                const std::string& config) {
  std::string attrs = std::string("call_target_name = \"") + target + "\", api_version = 4 : i32";
  if (!config.empty()) attrs += ", backend_config = {" + config + "}";
  return b.op("custom_call", operands, out, attrs);
}

// `groups` goes to the handler as the op passed it (int32/int64): cumulative ends (offs) or, when
// `sizes`, group sizes (ragged_dot) - no conversion or prefix sum in the program, so the program is
// the custom call alone.
std::string groups_attr(bool sizes) { return std::string("group_sizes = ") + (sizes ? "1" : "0") + " : i32"; }

// [M,K] x [G,K,N] (groups over rows) on the host kernel.
Value rows_host(Builder& b, Value a, Value w, Value groups, bool sizes, ElemType t, bool w_col_major) {
  const int64_t m = a.shape()[0], n = w.shape()[2];
  // A column-major w is passed as the [G,N,K] array it is stored as (the view's transpose and
  // this one fold away); the handler multiplies through a transposed view.
  Value wa = w_col_major ? b.transpose(w, {0, 2, 1}) : w;
  return host_call(b, kRaggedDotTarget, {a, wa, groups}, Type{t, {m, n}},
                   groups_attr(sizes) + ", rhs_col_major = " + (w_col_major ? "1" : "0") + " : i32");
}

// [S,Kh] x [S,N] (groups over S) -> [G,Kh,N] on the host kernel.
Value k_host(Builder& b, Value lhs_rows, Value w, Value groups, bool sizes, ElemType t) {
  const int64_t g = groups.shape()[0], kh = lhs_rows.shape()[1], n = w.shape()[1];
  return host_call(b, kRaggedDotWgradTarget, {lhs_rows, w, groups}, Type{t, {g, kh, n}}, groups_attr(sizes));
}

// The strategy for [M,K] x [G,K,N] with offs over rows, by shape.
Value rows_dispatch(Builder& b, Value a, Value w, Value offs, ElemType t, bool w_col_major) {
  const int64_t m = a.shape()[0], n = w.shape()[2], g = offs.shape()[0];
  std::string p = grouped_mm_path();
  if (p.empty()) p = 2 * m <= g ? "gather" : "windowed";
  if (p == "gather") return rows_gathered(b, a, w, offs, t, w_col_major);
  if (p == "windowed") return rows_windowed(b, a, w, offs, t, w_col_major);
  if (p == "tiled" && use_tiles(m, g)) return rows_tiled(b, a, w, offs, t, w_col_major);
  Value all = gdot(b, a, w, {}, {}, {1}, {1}, t);  // [M, G, N]
  Value mask = group_mask(b, group_ids(b, offs, m), {m, g, n}, 0, 1);
  return select_group(b, all, mask, 1);
}

}  // namespace

void set_host_kernels_available(bool available) { host_available = available; }
bool host_kernels_available() { return host_available; }
void set_host_kernels_enabled(bool enabled) { host_enabled = enabled; }
bool host_kernels_enabled() { return host_available && host_enabled; }
void set_host_kernels_any_size(bool any_size) { host_any_size = any_size; }
bool host_kernels_any_size() { return host_any_size; }

TPU_LOWER(_grouped_mm) {
  const Type& o = out_type(c);
  if (c.has("bias")) throw Unsupported("_grouped_mm: bias (PyTorch does not support it either)");
  if (!shlo::is_float(o.elem)) throw Unsupported("_grouped_mm: non-float output");
  const ElemType t = opmath(o.elem);
  Value a = c.tensor("self"), w = c.tensor("mat2");
  const int64_t ra = a.rank(), rw = w.rank();
  if (o.numel() == 0) return {b.zeros(o)};

  if (ra == 3 && rw == 3) return {gdot(b, a, w, {0}, {0}, {2}, {1}, t)};
  if (!c.has("offs")) throw Unsupported("_grouped_mm: 2-D operand without offs");
  Value offs = c.tensor("offs");
  const int64_t g = offs.shape()[0];

  if (ra == 2 && rw == 3) {  // [M,K] x [G,K,N]: offs over rows
    const int64_t macs = a.shape()[0] * a.shape()[1] * w.shape()[2];
    if (use_host_kernel(c, a.elem(), o.elem, macs, g, a.shape()[1], w.shape()[2]))
      return {rows_host(b, a, w, offs, false, o.elem, c.bool_("mat2_col_major"))};
    return {rows_dispatch(b, a, w, offs, t, c.bool_("mat2_col_major"))};
  }
  if (ra == 3 && rw == 2) {  // [G,M,K] x [K,N]: offs over columns
    const int64_t m = a.shape()[1], n = w.shape()[1];
    Value all = gdot(b, a, w, {}, {}, {2}, {0}, t);  // [G, M, N]
    Value mask = group_mask(b, group_ids(b, offs, n), {g, m, n}, 2, 0);
    return {select_group(b, all, mask, 0)};
  }
  if (ra == 2 && rw == 2) {  // [M,K] x [K,N]: offs over K -> [G,M,N]
    if (use_host_kernel(c, a.elem(), o.elem, a.shape()[0] * a.shape()[1] * w.shape()[1], g, a.shape()[0],
                        w.shape()[1]))
      return {k_host(b, b.transpose(a, {1, 0}), w, offs, false, o.elem)};
    if (grouped_mm_path() != "dense" && grouped_mm_path() != "tiled") return {k_windowed(b, a, w, offs, t)};
    const int64_t m = a.shape()[0], k = a.shape()[1], n = w.shape()[1];
    Value gid = group_ids(b, offs, k);
    Value am = group_mask(b, gid, {g, m, k}, 2, 0);
    Value wm = group_mask(b, gid, {g, k, n}, 1, 0);
    Value ae = b.broadcast_in_dim(a, {g, m, k}, {1, 2});
    Value we = b.broadcast_in_dim(w, {g, k, n}, {1, 2});
    ae = b.select(am, ae, b.zeros(ae.type));
    we = b.select(wm, we, b.zeros(we.type));
    return {gdot(b, ae, we, {0}, {0}, {2}, {1}, t)};
  }
  throw Unsupported("_grouped_mm: operands must be 2-D or 3-D");
}

// torch.tpu.ops.ragged_dot / ragged_dot_weight_grad (torch_tpu:: ops, python/torch_tpu/ops):
// JAX's ragged_dot contract with group sizes instead of offsets, on the same paths as
// _grouped_mm. Rows past sum(group_sizes) are zero.
namespace {
// Group ends from the (few) group sizes: an inclusive prefix sum (a [G, G] triangle) of the sizes
// with negative ones counted as 0, clipped to the m rows - as the CPU kernel reads them, so a group
// starting past the rows is empty (the weight gradient's windows would otherwise read rows of
// another group).
Value group_ends(Builder& b, Value sizes, int64_t m) {
  const int64_t g = sizes.shape()[0];
  Value pos = b.max(b.convert(sizes, I64), b.zeros(Type{I64, {g}}));
  Value s = b.broadcast_in_dim(pos, {g, g}, {1});
  Value keep = b.compare(Cmp::LE, b.iota(Type{I64, {g, g}}, 1), b.iota(Type{I64, {g, g}}, 0));
  Value ends = b.reduce(b.select(keep, s, b.zeros(s.type)), b.constant_i(0, I64), {1}, "add");
  return b.min(ends, b.constant_i(m, I64, {g}));
}
}  // namespace

TPU_LOWER(ragged_dot) {
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  const Value lhs = c.tensor("lhs"), rhs = c.tensor("rhs"), sizes = c.tensor("group_sizes");
  if (use_host_kernel(c, lhs.elem(), o.elem, lhs.shape()[0] * lhs.shape()[1] * o.shape[1], rhs.shape()[0],
                      rhs.shape()[1], rhs.shape()[2]))
    return {rows_host(b, lhs, rhs, sizes, true, o.elem, c.bool_("rhs_col_major"))};
  return {rows_dispatch(b, lhs, rhs, group_ends(b, sizes, lhs.shape()[0]), opmath(o.elem), c.bool_("rhs_col_major"))};
}

TPU_LOWER(ragged_dot_weight_grad) {
  const Type& o = out_type(c);
  if (o.numel() == 0) return {b.zeros(o)};
  const Value lhs = c.tensor("lhs"), grad = c.tensor("grad"), sizes = c.tensor("group_sizes");
  if (use_host_kernel(c, lhs.elem(), o.elem, lhs.shape()[0] * lhs.shape()[1] * o.shape[2], o.shape[0], o.shape[1],
                      o.shape[2]))
    return {k_host(b, lhs, grad, sizes, true, o.elem)};
  return {k_windowed(b, b.transpose(lhs, {1, 0}), grad, group_ends(b, sizes, lhs.shape()[0]), opmath(o.elem))};
}

}  // namespace tpu::lowering
