#include "builder.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace tpu::shlo {

bool is_float(ElemType t) {
  return t == ElemType::F16 || t == ElemType::BF16 || t == ElemType::F32 || t == ElemType::F64 || is_f8(t);
}
bool is_unsigned(ElemType t) {
  return t == ElemType::U8 || t == ElemType::U16 || t == ElemType::U32 || t == ElemType::U64;
}
int bit_width(ElemType t) {
  switch (t) {
    case ElemType::Pred: return 1;
    case ElemType::S8: case ElemType::U8: case ElemType::F8E4M3FN: case ElemType::F8E5M2: return 8;
    case ElemType::S16: case ElemType::U16: case ElemType::F16: case ElemType::BF16: return 16;
    case ElemType::S32: case ElemType::U32: case ElemType::F32: return 32;
    case ElemType::C128: return 128;
    default: return 64;
  }
}
const char* mlir_name(ElemType t) {
  switch (t) {
    case ElemType::Pred: return "i1";
    case ElemType::S8: return "i8";
    case ElemType::S16: return "i16";
    case ElemType::S32: return "i32";
    case ElemType::S64: return "i64";
    case ElemType::U8: return "ui8";
    case ElemType::U16: return "ui16";
    case ElemType::U32: return "ui32";
    case ElemType::U64: return "ui64";
    case ElemType::F16: return "f16";
    case ElemType::BF16: return "bf16";
    case ElemType::F32: return "f32";
    case ElemType::F64: return "f64";
    case ElemType::F8E4M3FN: return "f8E4M3FN";
    case ElemType::F8E5M2: return "f8E5M2";
    case ElemType::C64: return "complex<f32>";
    case ElemType::C128: return "complex<f64>";
  }
  return "?";
}

std::string Type::str() const {
  std::string s = "tensor<";
  for (int64_t d : shape) s += std::to_string(d) + "x";
  s += mlir_name(elem);
  s += ">";
  return s;
}
int64_t Type::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string Builder::ints(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}
std::string Builder::dense_array(const std::vector<int64_t>& v) {
  return v.empty() ? "array<i64>" : "array<i64: " + ints(v) + ">";
}

Value Builder::arg(const Type& t) {
  Value v = fresh(t);
  args_.push_back(v);
  return v;
}

void Builder::alias(int arg_index, int result_index) { aliases_.emplace_back(arg_index, result_index); }

std::string Builder::module(const std::vector<Value>& results) const {
  std::ostringstream os;
  os << "module @torch_tpu {\n  func.func public @main(";
  for (size_t i = 0; i < args_.size(); ++i) {
    if (i) os << ", ";
    os << args_[i].name() << ": " << args_[i].type.str();
    for (auto [a, r] : aliases_)
      if (a == static_cast<int>(i)) os << " {tf.aliasing_output = " << r << " : i32}";
  }
  os << ") -> (";
  for (size_t i = 0; i < results.size(); ++i) os << (i ? ", " : "") << results[i].type.str();
  os << ") {\n" << bodies_.front() << "    \"func.return\"(";
  for (size_t i = 0; i < results.size(); ++i) os << (i ? ", " : "") << results[i].name();
  os << ") : (";
  for (size_t i = 0; i < results.size(); ++i) os << (i ? ", " : "") << results[i].type.str();
  os << ") -> ()\n  }\n";
  for (const auto& f : functions_) os << f.second << "\n";
  os << "}\n";
  return os.str();
}

void Builder::add_functions(const std::string& key, const std::string& text) {
  for (const auto& f : functions_)
    if (f.first == key) return;
  functions_.emplace_back(key, text);
}

std::vector<Value> Builder::call(const std::string& callee, const std::vector<Value>& operands,
                                 const std::vector<Type>& results) {
  return op_multi("func.call", operands, results, "callee = @" + callee);
}

std::vector<Value> Builder::op_multi(std::string_view name, const std::vector<Value>& operands,
                                     const std::vector<Type>& results, std::string_view attrs,
                                     std::string_view region) {
  std::vector<Value> outs;
  for (const Type& t : results) outs.push_back(fresh(t));
  std::string& b = body();
  b += "    ";
  if (outs.size() == 1) {
    b += outs[0].name() + " = ";
  } else if (!outs.empty()) {
    // Multi-result ops bind a pack %vN:k; we then alias each element by name.
    b += "%r" + std::to_string(outs[0].id) + ":" + std::to_string(outs.size()) + " = ";
  }
  // Names with a dialect prefix ("func.call") are printed as given; the rest are StableHLO ops.
  b += name.find('.') == std::string_view::npos ? "\"stablehlo." : "\"";
  b += name;
  b += "\"(";
  for (size_t i = 0; i < operands.size(); ++i) b += (i ? ", " : "") + operands[i].name();
  b += ")";
  if (!region.empty()) {
    b += " (";
    b += region;
    b += ")";
  }
  if (!attrs.empty()) {
    b += " {";
    b += attrs;
    b += "}";
  }
  b += " : (";
  for (size_t i = 0; i < operands.size(); ++i) b += (i ? ", " : "") + operands[i].type.str();
  b += ") -> ";
  if (outs.size() == 1) {
    b += outs[0].type.str();
  } else {
    b += "(";
    for (size_t i = 0; i < outs.size(); ++i) b += (i ? ", " : "") + outs[i].type.str();
    b += ")";
  }
  b += "\n";
  if (outs.size() > 1) {
    // Rebind pack elements to plain SSA names through a no-op-free alias: MLIR lets us refer
    // to %rN#i directly, so record names by emitting identity reshapes? Cheaper: rename below.
    for (size_t i = 0; i < outs.size(); ++i) {
      // stablehlo has no identity op that is free to print; use a reshape to the same type,
      // which XLA removes.
      b += "    " + outs[i].name() + " = \"stablehlo.reshape\"(%r" + std::to_string(outs[0].id) +
           "#" + std::to_string(i) + ") : (" + outs[i].type.str() + ") -> " +
           outs[i].type.str() + "\n";
    }
  }
  return outs;
}

Value Builder::op(std::string_view name, const std::vector<Value>& operands, const Type& result,
                  std::string_view attrs) {
  return op_multi(name, operands, {result}, attrs)[0];
}

std::string Builder::region(const std::vector<Type>& types,
                            const std::function<std::vector<Value>(const std::vector<Value>&)>& fn) {
  std::vector<Value> args;
  for (const Type& t : types) args.push_back(fresh(t));
  bodies_.emplace_back();
  std::vector<Value> res = fn(args);
  std::string inner = std::move(bodies_.back());
  bodies_.pop_back();
  std::string r = "{\n  ^bb0(";
  for (size_t i = 0; i < args.size(); ++i)
    r += (i ? ", " : "") + args[i].name() + ": " + args[i].type.str();
  r += "):\n" + inner + "    \"stablehlo.return\"(";
  for (size_t i = 0; i < res.size(); ++i) r += (i ? ", " : "") + res[i].name();
  r += ") : (";
  for (size_t i = 0; i < res.size(); ++i) r += (i ? ", " : "") + res[i].type.str();
  r += ") -> ()\n  }";
  return r;
}

std::vector<Value> Builder::while_loop(const std::vector<Value>& init,
                                       const std::function<Value(const std::vector<Value>&)>& cond,
                                       const std::function<std::vector<Value>(const std::vector<Value>&)>& body) {
  std::vector<Type> types;
  for (const Value& v : init) types.push_back(v.type);
  std::string rc = region(types, [&](const std::vector<Value>& st) { return std::vector<Value>{cond(st)}; });
  std::string rb = region(types, body);
  return op_multi("while", init, types, "", rc + ", " + rb);
}

// ------------------------------------------------------------------ constants
namespace {
std::string float_literal(double v, ElemType t) {
  // Hex bit patterns are exact and also spell inf/nan.
  char buf[32];
  switch (t) {
    case ElemType::F64: {
      uint64_t bits = std::bit_cast<uint64_t>(v);
      snprintf(buf, sizeof buf, "0x%016llX", static_cast<unsigned long long>(bits));
      return buf;
    }
    case ElemType::F32: {
      uint32_t bits = std::bit_cast<uint32_t>(static_cast<float>(v));
      snprintf(buf, sizeof buf, "0x%08X", bits);
      return buf;
    }
    case ElemType::BF16: {
      uint32_t bits = std::bit_cast<uint32_t>(static_cast<float>(v));
      uint32_t rounded;
      if (std::isnan(static_cast<float>(v))) {
        rounded = 0x7FC0;
      } else {
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;  // round to nearest even
      }
      snprintf(buf, sizeof buf, "0x%04X", rounded & 0xFFFF);
      return buf;
    }
    case ElemType::F16: {
      _Float16 h = static_cast<_Float16>(v);
      uint16_t bits;
      std::memcpy(&bits, &h, 2);
      snprintf(buf, sizeof buf, "0x%04X", bits);
      return buf;
    }
    default:
      throw std::logic_error("float_literal on a non-float type");
  }
}
}  // namespace

Value Builder::constant_f(double v, ElemType t, const Shape& shape) {
  if (is_complex(t)) return complex(constant_f(v, part_type(t), shape), constant_f(0.0, part_type(t), shape));
  if (!is_float(t)) {
    if (t == ElemType::Pred) return constant_i(v != 0, t, shape);
    return constant_i(static_cast<int64_t>(v), t, shape);
  }
  // f8 literals: an f32 constant converted on the device (XLA rounds like c10's f8 casts).
  if (is_f8(t)) return convert(constant_f(v, ElemType::F32, shape), t);
  Type ty{t, shape};
  Type scalar{t, {}};
  Value c = op("constant", {}, scalar,
               "value = dense<" + float_literal(v, t) + "> : " + scalar.str());
  return shape.empty() ? c : broadcast_in_dim(c, shape, {});
}

Value Builder::constant_i(int64_t v, ElemType t, const Shape& shape) {
  if (is_float(t) || is_complex(t)) return constant_f(static_cast<double>(v), t, shape);
  Type scalar{t, {}};
  std::string lit;
  if (t == ElemType::Pred) {
    lit = v ? "true" : "false";
  } else if (is_unsigned(t)) {
    lit = std::to_string(static_cast<uint64_t>(v) &
                         (bit_width(t) == 64 ? ~0ULL : ((1ULL << bit_width(t)) - 1)));
  } else {
    lit = std::to_string(v);
  }
  Value c = op("constant", {}, scalar, "value = dense<" + lit + "> : " + scalar.str());
  return shape.empty() ? c : broadcast_in_dim(c, shape, {});
}

Value Builder::iota(const Type& t, int64_t dim) {
  return op("iota", {}, t, "iota_dimension = " + std::to_string(dim) + " : i64");
}

Value Builder::lowest(ElemType t, const Shape& shape) {
  if (is_float(t)) return constant_f(-std::numeric_limits<double>::infinity(), t, shape);
  if (t == ElemType::Pred) return constant_i(0, t, shape);
  if (is_unsigned(t)) return constant_i(0, t, shape);
  int w = bit_width(t);
  return constant_i(w == 64 ? std::numeric_limits<int64_t>::min() : -(int64_t{1} << (w - 1)), t,
                    shape);
}

Value Builder::highest(ElemType t, const Shape& shape) {
  if (is_float(t)) return constant_f(std::numeric_limits<double>::infinity(), t, shape);
  if (t == ElemType::Pred) return constant_i(1, t, shape);
  int w = bit_width(t);
  if (is_unsigned(t)) return constant_i(w == 64 ? -1 : static_cast<int64_t>((1ULL << w) - 1), t, shape);
  return constant_i(w == 64 ? std::numeric_limits<int64_t>::max() : (int64_t{1} << (w - 1)) - 1, t,
                    shape);
}

// ------------------------------------------------------------------ elementwise
Value Builder::unary(std::string_view name, Value x) { return op(name, {x}, x.type); }

Value Builder::binary(std::string_view name, Value a, Value b) {
  if (a.type.str() != b.type.str())
    throw std::logic_error("stablehlo." + std::string(name) + ": operand types differ: " +
                           a.type.str() + " vs " + b.type.str());
  return op(name, {a, b}, a.type);
}

Value Builder::compare(Cmp dir, Value a, Value b) {
  static const char* names[] = {"EQ", "NE", "LT", "LE", "GT", "GE"};
  const char* ct = is_float(a.elem()) || is_complex(a.elem()) ? "FLOAT"
                   : (is_unsigned(a.elem()) || a.elem() == ElemType::Pred) ? "UNSIGNED"
                                                                            : "SIGNED";
  if (a.type.str() != b.type.str())
    throw std::logic_error("stablehlo.compare: operand types differ: " + a.type.str() + " vs " +
                           b.type.str());
  return op("compare", {a, b}, Type{ElemType::Pred, a.shape()},
            std::string("comparison_direction = #stablehlo<comparison_direction ") +
                names[static_cast<int>(dir)] + ">, compare_type = #stablehlo<comparison_type " +
                ct + ">");
}

Value Builder::select(Value pred, Value t, Value f) { return op("select", {pred, t, f}, t.type); }

void Builder::add_error(Value bad, int32_t code) {
  if (!checking_) return;
  if (bad.type.numel() == 0) return;
  if (bad.type.numel() == 1) {
    bad = reshape(bad, {});  // one index (a decode step's token): no reduce
  } else if (bad.rank() > 0) {
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < bad.rank(); ++d) dims.push_back(d);
    bad = reduce(bad, constant_i(0, ElemType::Pred), dims, "or");
  }
  error_codes_.push_back(code);
  errors_.push_back(select(bad, constant_i(code, ElemType::S32), constant_i(0, ElemType::S32)));
}

Value Builder::error_status() {
  if (errors_.empty()) return constant_i(0, ElemType::S32);
  Value s = errors_[0];
  for (size_t i = 1; i < errors_.size(); ++i) s = max(s, errors_[i]);
  return s;
}

Value Builder::fold_status(Value status) {
  Value passed = reshape(slice(status, {0}, {1}), {});
  Value code_in = reshape(slice(status, {1}, {2}), {});
  Value zero = constant_i(0, ElemType::S32);
  // The first failure sticks, and the passed count stops there: it then indexes the failed launch.
  Value code = select(compare(Cmp::NE, code_in, zero), code_in, error_status());
  Value ok = compare(Cmp::EQ, code, zero);
  passed = add(passed, select(ok, constant_i(1, ElemType::S32), zero));
  return concatenate({reshape(passed, {1}), reshape(code, {1})}, 0);
}

Value Builder::clamp(Value lo, Value x, Value hi) { return op("clamp", {lo, x, hi}, x.type); }

Value Builder::convert(Value x, ElemType to) {
  if (x.elem() == to) return x;
  // Complex to real keeps the real part (PyTorch's cast); to bool: either part nonzero.
  if (is_complex(x.elem()) && to == ElemType::Pred)
    return or_(convert(real(x), to), convert(imag(x), to));
  if (is_complex(x.elem()) && !is_complex(to)) return convert(real(x), to);
  if (to == ElemType::Pred) return compare(Cmp::NE, x, zeros(x.type));
  if (is_complex(to) && !is_complex(x.elem())) {  // real -> (x, 0)
    Value re = convert(x, part_type(to));
    return complex(re, zeros(re.type));
  }
  if (is_f8(to)) return convert_to_f8(x, to);
  // c10 casts floats to uint8 through int64 (wrapping: -1.7 -> 255); XLA's direct convert saturates.
  if (to == ElemType::U8 && is_float(x.elem())) x = op("convert", {x}, Type{ElemType::S64, x.shape()});
  return op("convert", {x}, Type{to, x.shape()});
}

// Bit-exact with c10's casts: through f32 (as c10 converts), e4m3fn saturates finite overflow
// and +-inf to +-448, and e5m2 spells NaN 0x7F|sign (XLA writes 0x7E|sign).
Value Builder::convert_to_f8(Value x, ElemType to) {
  const Shape& sh = x.shape();
  Value f = x.elem() == ElemType::F32 ? x : op("convert", {x}, Type{ElemType::F32, sh});
  if (to == ElemType::F8E4M3FN) f = clamp(constant_f(-448.0, ElemType::F32, sh), f, constant_f(448.0, ElemType::F32, sh));
  Value r = op("convert", {f}, Type{to, sh});
  if (to == ElemType::F8E5M2) {
    Value u = bitcast(r, Type{ElemType::U8, sh});
    u = select(compare(Cmp::NE, f, f), or_(u, constant_i(1, ElemType::U8, sh)), u);
    r = bitcast(u, Type{to, sh});
  }
  return r;
}

Value Builder::bitcast(Value x, const Type& to) { return op("bitcast_convert", {x}, to); }

Value Builder::real(Value x) {
  if (!is_complex(x.elem())) return x;
  return op("real", {x}, Type{part_type(x.elem()), x.shape()});
}

Value Builder::imag(Value x) {
  if (!is_complex(x.elem())) return zeros(x.type);
  return op("imag", {x}, Type{part_type(x.elem()), x.shape()});
}

Value Builder::complex(Value re, Value im) {
  if (re.type.str() != im.type.str())
    throw std::logic_error("stablehlo.complex: operand types differ: " + re.type.str() + " vs " + im.type.str());
  return op("complex", {re, im}, Type{complex_type(re.elem()), re.shape()});
}

// ------------------------------------------------------------------ shape
Value Builder::reshape(Value x, const Shape& shape) {
  if (x.shape() == shape) return x;
  return op("reshape", {x}, Type{x.elem(), shape});
}

Value Builder::broadcast_in_dim(Value x, const Shape& shape, const std::vector<int64_t>& dims) {
  if (x.shape() == shape) {
    bool identity = true;
    for (size_t i = 0; i < dims.size(); ++i) identity &= dims[i] == static_cast<int64_t>(i);
    if (identity) return x;
  }
  return op("broadcast_in_dim", {x}, Type{x.elem(), shape},
            "broadcast_dimensions = " + dense_array(dims));
}

Value Builder::broadcast_to(Value x, const Shape& shape) {
  if (x.shape() == shape) return x;
  int64_t off = static_cast<int64_t>(shape.size()) - x.rank();
  if (off < 0) throw std::logic_error("broadcast_to: target rank is smaller than operand rank");
  // Size-1 operand dims that stretch must be reshaped away first.
  Shape kept;
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < x.rank(); ++i) {
    if (x.shape()[i] == shape[off + i]) {
      kept.push_back(x.shape()[i]);
      dims.push_back(off + i);
    } else if (x.shape()[i] != 1) {
      throw std::logic_error("broadcast_to: incompatible shapes");
    }
  }
  return broadcast_in_dim(reshape(x, kept), shape, dims);
}

Value Builder::transpose(Value x, const std::vector<int64_t>& perm) {
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity &= perm[i] == static_cast<int64_t>(i);
  if (identity) return x;
  Shape s;
  for (int64_t p : perm) s.push_back(x.shape()[p]);
  Value r = op("transpose", {x}, Type{x.elem(), s}, "permutation = " + dense_array(perm));
  transposes_.emplace_back(r.id, x, perm);
  return r;
}

std::optional<Value> Builder::transposed_from(Value v, const std::vector<int64_t>& perm) const {
  for (auto it = transposes_.rbegin(); it != transposes_.rend(); ++it)
    if (std::get<0>(*it) == v.id) return std::get<2>(*it) == perm ? std::optional<Value>(std::get<1>(*it)) : std::nullopt;
  return std::nullopt;
}

Value Builder::slice(Value x, const Shape& start, const Shape& limit, const Shape& strides_in) {
  Shape strides = strides_in.empty() ? Shape(x.rank(), 1) : strides_in;
  Shape s;
  bool identity = true;
  for (int64_t i = 0; i < x.rank(); ++i) {
    s.push_back(std::max<int64_t>(0, (limit[i] - start[i] + strides[i] - 1) / strides[i]));
    identity &= start[i] == 0 && limit[i] == x.shape()[i] && strides[i] == 1;
  }
  if (identity) return x;
  return op("slice", {x}, Type{x.elem(), s},
            "start_indices = " + dense_array(start) + ", limit_indices = " + dense_array(limit) +
                ", strides = " + dense_array(strides));
}

Value Builder::dynamic_slice(Value x, const std::vector<Value>& starts, const Shape& sizes) {
  std::vector<Value> ops{x};
  ops.insert(ops.end(), starts.begin(), starts.end());
  return op("dynamic_slice", ops, Type{x.elem(), sizes}, "slice_sizes = " + dense_array(sizes));
}

Value Builder::dynamic_update_slice(Value x, Value update, const std::vector<Value>& starts) {
  std::vector<Value> ops{x, update};
  ops.insert(ops.end(), starts.begin(), starts.end());
  return op("dynamic_update_slice", ops, x.type);
}

Value Builder::concatenate(const std::vector<Value>& xs, int64_t dim) {
  if (xs.size() == 1) return xs[0];
  Shape s = xs[0].shape();
  s[dim] = 0;
  for (const Value& v : xs) s[dim] += v.shape()[dim];
  return op("concatenate", xs, Type{xs[0].elem(), s}, "dimension = " + std::to_string(dim) + " : i64");
}

Value Builder::pad(Value x, Value pad_value, const Shape& lo, const Shape& hi, const Shape& interior_in) {
  Shape interior = interior_in.empty() ? Shape(x.rank(), 0) : interior_in;
  Shape s;
  for (int64_t i = 0; i < x.rank(); ++i) {
    int64_t d = x.shape()[i];
    s.push_back(lo[i] + hi[i] + d + std::max<int64_t>(0, d - 1) * interior[i]);
  }
  return op("pad", {x, pad_value}, Type{x.elem(), s},
            "edge_padding_low = " + dense_array(lo) + ", edge_padding_high = " + dense_array(hi) +
                ", interior_padding = " + dense_array(interior));
}

Value Builder::reverse(Value x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x;
  return op("reverse", {x}, x.type, "dimensions = " + dense_array(dims));
}

// ------------------------------------------------------------------ contractions, reductions
const char* precision_name(Precision p) {
  switch (p) {
    case Precision::Default: return "DEFAULT";
    case Precision::High: return "HIGH";
    case Precision::Highest: return "HIGHEST";
  }
  return "HIGHEST";
}

std::string Builder::precision_config() const {
  const std::string one = std::string("#stablehlo<precision ") + precision_name(precision_) + ">";
  return "precision_config = [" + one + ", " + one + "]";
}

Value Builder::dot_general(Value a, Value b, const std::vector<int64_t>& lb,
                           const std::vector<int64_t>& rb, const std::vector<int64_t>& lc,
                           const std::vector<int64_t>& rc, ElemType result) {
  Shape s;
  for (int64_t d : lb) s.push_back(a.shape()[d]);
  auto free_dims = [](const Value& v, const std::vector<int64_t>& x, const std::vector<int64_t>& y,
                      Shape& out) {
    for (int64_t i = 0; i < v.rank(); ++i) {
      bool used = false;
      for (int64_t d : x) used |= d == i;
      for (int64_t d : y) used |= d == i;
      if (!used) out.push_back(v.shape()[i]);
    }
  };
  free_dims(a, lb, lc, s);
  free_dims(b, rb, rc, s);
  return op("dot_general", {a, b}, Type{result, s},
            "dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [" + ints(lb) +
                "], rhs_batching_dimensions = [" + ints(rb) + "], lhs_contracting_dimensions = [" +
                ints(lc) + "], rhs_contracting_dimensions = [" + ints(rc) + "]>, " + precision_config());
}

std::vector<Value> Builder::reduce_multi(
    const std::vector<Value>& xs, const std::vector<Value>& inits, const std::vector<int64_t>& dims,
    const std::function<std::vector<Value>(const std::vector<Value>&)>& fn) {
  std::vector<Type> body_types;
  for (const Value& v : inits) body_types.push_back(Type{v.elem(), {}});
  for (const Value& v : inits) body_types.push_back(Type{v.elem(), {}});
  std::string reg = region(body_types, fn);
  std::vector<Type> results;
  for (const Value& x : xs) {
    Shape s;
    for (int64_t i = 0; i < x.rank(); ++i) {
      bool reduced = false;
      for (int64_t d : dims) reduced |= d == i;
      if (!reduced) s.push_back(x.shape()[i]);
    }
    results.push_back(Type{x.elem(), s});
  }
  std::vector<Value> ops = xs;
  ops.insert(ops.end(), inits.begin(), inits.end());
  return op_multi("reduce", ops, results, "dimensions = " + dense_array(dims), reg);
}

Value Builder::reduce(Value x, Value init, const std::vector<int64_t>& dims, std::string_view body_op) {
  if (dims.empty()) return x;
  std::string name(body_op);
  return reduce_multi({x}, {init}, dims, [&](const std::vector<Value>& a) {
    return std::vector<Value>{binary(name, a[0], a[1])};
  })[0];
}

Value Builder::reduce_window(Value x, Value init, const Shape& window, const Shape& strides,
                             const std::vector<std::pair<int64_t, int64_t>>& padding,
                             std::string_view body_op) {
  std::string name(body_op);
  std::string reg = region({Type{init.elem(), {}}, Type{init.elem(), {}}},
                           [&](const std::vector<Value>& a) {
                             return std::vector<Value>{binary(name, a[0], a[1])};
                           });
  Shape s;
  std::string pad = "dense<[";
  for (int64_t i = 0; i < x.rank(); ++i) {
    int64_t padded = x.shape()[i] + padding[i].first + padding[i].second;
    s.push_back((padded - window[i]) / strides[i] + 1);
    pad += std::string(i ? ", " : "") + "[" + std::to_string(padding[i].first) + ", " +
           std::to_string(padding[i].second) + "]";
  }
  pad += "]> : tensor<" + std::to_string(x.rank()) + "x2xi64>";
  return op_multi("reduce_window", {x, init}, {Type{x.elem(), s}},
                  "window_dimensions = " + dense_array(window) +
                      ", window_strides = " + dense_array(strides) + ", padding = " + pad,
                  reg)[0];
}

// ------------------------------------------------------------------ gather / scatter
Value Builder::gather(Value operand, Value indices, const std::vector<int64_t>& offset_dims,
                      const std::vector<int64_t>& collapsed, const std::vector<int64_t>& start_map,
                      int64_t index_vector_dim, const Shape& slice_sizes, const Shape& result_shape,
                      const std::vector<int64_t>& obatch, const std::vector<int64_t>& ibatch) {
  std::string dn = "dimension_numbers = #stablehlo.gather<offset_dims = [" + ints(offset_dims) +
                   "], collapsed_slice_dims = [" + ints(collapsed) + "]";
  if (!obatch.empty())
    dn += ", operand_batching_dims = [" + ints(obatch) + "], start_indices_batching_dims = [" +
          ints(ibatch) + "]";
  dn += ", start_index_map = [" + ints(start_map) +
        "], index_vector_dim = " + std::to_string(index_vector_dim) +
        ">, slice_sizes = " + dense_array(slice_sizes) + ", indices_are_sorted = false";
  return op("gather", {operand, indices}, Type{operand.elem(), result_shape}, dn);
}

Value Builder::scatter(Value operand, Value indices, Value updates,
                       const std::vector<int64_t>& uwd, const std::vector<int64_t>& iwd,
                       const std::vector<int64_t>& sdod, int64_t index_vector_dim,
                       std::string_view combine, const std::vector<int64_t>& ibatch,
                       const std::vector<int64_t>& sbatch) {
  std::string comb(combine);
  std::string reg = region({Type{operand.elem(), {}}, Type{operand.elem(), {}}},
                           [&](const std::vector<Value>& a) {
                             if (comb.empty()) return std::vector<Value>{a[1]};
                             return std::vector<Value>{binary(comb, a[0], a[1])};
                           });
  std::string dn = "scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [" +
                   ints(uwd) + "], inserted_window_dims = [" + ints(iwd) + "]";
  if (!ibatch.empty())
    dn += ", input_batching_dims = [" + ints(ibatch) + "], scatter_indices_batching_dims = [" +
          ints(sbatch) + "]";
  dn += ", scatter_dims_to_operand_dims = [" + ints(sdod) +
        "], index_vector_dim = " + std::to_string(index_vector_dim) +
        ">, indices_are_sorted = false, unique_indices = false";
  return op_multi("scatter", {operand, indices, updates}, {operand.type}, dn, reg)[0];
}

std::vector<Value> Builder::sort(const std::vector<Value>& xs, int64_t dim,
                                 const std::function<Value(const std::vector<Value>&)>& less) {
  std::vector<Type> body_types;
  for (const Value& x : xs) {
    body_types.push_back(Type{x.elem(), {}});
    body_types.push_back(Type{x.elem(), {}});
  }
  std::string reg = region(body_types, [&](const std::vector<Value>& a) {
    return std::vector<Value>{less(a)};
  });
  std::vector<Type> results;
  for (const Value& x : xs) results.push_back(x.type);
  return op_multi("sort", xs, results,
                  "dimension = " + std::to_string(dim) + " : i64, is_stable = true", reg);
}

std::pair<Value, Value> Builder::rng_bits(Value state, const Type& bits_type) {
  auto r = op_multi("rng_bit_generator", {state}, {state.type, bits_type},
                    "rng_algorithm = #stablehlo<rng_algorithm PHILOX>");
  return {r[0], r[1]};
}

}  // namespace tpu::shlo
