// torch.fft: aten::_fft_r2c / _fft_c2r / _fft_c2c (what every torch.fft.* function, stft and
// istft call after padding/cropping their input) as StableHLO `fft`. That op transforms the
// innermost 1-3 dims, so the requested dims are moved to the end (in the order given: ATen halves
// the LAST one for r2c/c2r) and back, and more than 3 dims take several transforms. XLA's
// inverse transforms divide by n (StableHLO spec); ATen's `normalization` already states the
// whole scale for either direction, so inverses are multiplied back by n first.
#include <algorithm>
#include <cmath>

#include "lowering.h"

namespace tpu::lowering {

namespace {
// ATen's fft_norm_mode (aten/src/ATen/native/SpectralOpsUtils.h).
enum class Norm : int64_t { None = 0, ByRootN = 1, ByN = 2 };


// One stablehlo.fft over the innermost `lengths.size()` (1-3) dims of x.
Value fft_inner(Builder& b, Value x, const char* kind, const std::vector<int64_t>& lengths) {
  Shape out = x.shape();
  const size_t r = out.size();
  ElemType elem = x.elem();
  const std::string k = kind;
  if (k == "RFFT") {
    elem = x.elem() == ElemType::F64 ? ElemType::C128 : ElemType::C64;
    out[r - 1] = lengths.back() / 2 + 1;
  } else if (k == "IRFFT") {
    elem = part_type(x.elem());
    out[r - 1] = lengths.back();
  }
  return b.op("fft", {x}, Type{elem, out},
              "fft_type = #stablehlo<fft_type " + k + ">, fft_length = " + Builder::dense_array(lengths));
}

// The call's dims (normalized, checked) and the permutation moving them, in order, to the end.
struct Layout {
  std::vector<int64_t> dims, perm, inverse;
};

Layout layout(const OpCall& c, int64_t rank) {
  Layout l;
  std::vector<bool> used(rank, false);
  for (int64_t d : c.ints("dim")) {
    d = norm_dim(d, rank);
    if (used[d]) throw Unsupported(c.name + ": repeated dim");
    used[d] = true;
    l.dims.push_back(d);
  }
  for (int64_t d = 0; d < rank; ++d)
    if (!used[d]) l.perm.push_back(d);
  l.perm.insert(l.perm.end(), l.dims.begin(), l.dims.end());
  l.inverse.assign(rank, 0);
  for (int64_t i = 0; i < rank; ++i) l.inverse[l.perm[i]] = i;
  return l;
}


// Sizes of dims [from, to) of shape.
std::vector<int64_t> tail(const Shape& s, size_t from, size_t to) {
  return std::vector<int64_t>(s.begin() + static_cast<int64_t>(from), s.begin() + static_cast<int64_t>(to));
}

// Multiplies by s (a real factor), scaling complex values part by part so inf/nan parts stay as
// ATen leaves them (a complex (s + 0i) product would mix them).
Value scale(Builder& b, Value x, double s) {
  if (s == 1.0) return x;
  ElemType p = part_type(x.elem());
  Value k = b.constant_f(s, p, x.shape());
  if (!is_complex(x.elem())) return b.mul(x, k);
  return b.complex(b.mul(b.real(x), k), b.mul(b.imag(x), k));
}

// The factor ATen applies (`norm` over the signal size n), times n for an XLA inverse transform.
double factor(const OpCall& c, double n, bool xla_inverse) {
  const auto norm = static_cast<Norm>(c.int_("normalization"));
  double f = norm == Norm::None ? 1.0 : norm == Norm::ByRootN ? 1.0 / std::sqrt(n) : norm == Norm::ByN ? 1.0 / n : -1;
  if (f < 0) throw Unsupported(c.name + ": unknown normalization");
  return xla_inverse ? f * n : f;
}

void check_elem(const OpCall& c, ElemType e, bool want_complex) {
  const bool ok = want_complex ? is_complex(e) : (e == ElemType::F32 || e == ElemType::F64);
  if (!ok) throw Unsupported(c.name + ": float32/float64 (complex64/complex128) only");  // CPU raises for others
}

// c2c over the signal dims [from, to) of the already-permuted x, in chunks of <= 3 dims.
Value c2c_dims(Builder& b, Value x, size_t from, size_t to, bool forward) {
  const size_t r = x.shape().size();
  for (size_t start = from; start < to; start += 3) {
    const size_t end = std::min(start + 3, to);
    // stablehlo.fft works on the innermost dims: rotate chunk [start, end) to the end and back.
    std::vector<int64_t> perm, inv(r);
    for (size_t d = 0; d < r; ++d)
      if (d < start || d >= end) perm.push_back(static_cast<int64_t>(d));
    for (size_t d = start; d < end; ++d) perm.push_back(static_cast<int64_t>(d));
    for (size_t i = 0; i < r; ++i) inv[perm[i]] = static_cast<int64_t>(i);
    Value y = b.transpose(x, perm);
    y = fft_inner(b, y, forward ? "FFT" : "IFFT", tail(y.shape(), r - (end - start), r));
    x = b.transpose(y, inv);
  }
  return x;
}

double numel_of(const Shape& s, size_t from) {
  double n = 1;
  for (size_t i = from; i < s.size(); ++i) n *= static_cast<double>(s[i]);
  return n;
}
}  // namespace

TPU_LOWER_COMPLEX(_fft_c2c) {
  Value x = c.tensor("self");
  check_elem(c, x.elem(), true);
  const Layout l = layout(c, x.rank());
  if (l.dims.empty()) return {x};
  const bool forward = c.bool_("forward");
  Value y = b.transpose(x, l.perm);
  const size_t r = y.shape().size(), first = r - l.dims.size();
  const double n = numel_of(y.shape(), first);
  y = c2c_dims(b, y, first, r, forward);
  return {b.transpose(scale(b, y, factor(c, n, !forward)), l.inverse)};
}

TPU_LOWER_COMPLEX(_fft_r2c) {
  Value x = c.tensor("self");
  check_elem(c, x.elem(), false);
  const Layout l = layout(c, x.rank());
  if (l.dims.empty()) throw Unsupported("_fft_r2c: no dims");
  Value y = b.transpose(x, l.perm);
  const size_t r = y.shape().size(), first = r - l.dims.size();
  const double n = numel_of(y.shape(), first);
  if (!c.bool_("onesided")) {
    // The full spectrum: the c2c transform of the real input (equal to the onesided half plus
    // its conjugate-symmetric mirror).
    y = b.complex(y, b.constant_f(0.0, x.elem(), y.shape()));
    y = c2c_dims(b, y, first, r, true);
  } else {
    // RFFT over the last <= 3 signal dims (the last one halved), then c2c over the rest.
    const size_t rstart = std::max(first, r >= 3 ? r - 3 : 0);
    y = fft_inner(b, y, "RFFT", tail(y.shape(), rstart, r));
    y = c2c_dims(b, y, first, rstart, true);
  }
  return {b.transpose(scale(b, y, factor(c, n, false)), l.inverse)};
}

TPU_LOWER_COMPLEX(_fft_c2r) {
  Value x = c.tensor("self");
  check_elem(c, x.elem(), true);
  const Layout l = layout(c, x.rank());
  if (l.dims.empty()) throw Unsupported("_fft_c2r: no dims");
  const int64_t last = c.int_("last_dim_size");
  Value y = b.transpose(x, l.perm);
  const size_t r = y.shape().size(), first = r - l.dims.size();
  // The real signal's sizes: the halved last dim becomes last_dim_size.
  Shape signal = y.shape();
  if (y.shape().back() != last / 2 + 1) throw Unsupported("_fft_c2r: last dim is not last_dim_size/2+1");
  signal.back() = last;
  const double n = numel_of(signal, first);
  // c2c (inverse) over the leading signal dims beyond the innermost 3, then IRFFT over those 3.
  const size_t rstart = std::max(first, r >= 3 ? r - 3 : 0);
  y = c2c_dims(b, y, first, rstart, false);
  // Both XLA inverses divide by their lengths, together by n.
  y = fft_inner(b, y, "IRFFT", tail(signal, rstart, r));
  return {b.transpose(scale(b, y, factor(c, n, true)), l.inverse)};
}

}  // namespace tpu::lowering
