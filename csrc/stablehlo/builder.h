// A small StableHLO module builder that prints MLIR text in the generic op form (the most
// stable syntax across StableHLO versions). SSA values are typed; every helper checks nothing
// the verifier will check for us, but computes result types so callers rarely spell them.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace tpu::shlo {

// F8E4M3FN / F8E5M2: storage and casts (torch.float8_e4m3fn / float8_e5m2); math runs in f32.
// C64 / C128: complex<f32> / complex<f64> (torch.complex64 / complex128), neither float nor integral.
enum class ElemType : uint8_t { Pred, S8, S16, S32, S64, U8, U16, U32, U64, F16, BF16, F32, F64, F8E4M3FN, F8E5M2, C64, C128 };
using Shape = std::vector<int64_t>;

bool is_float(ElemType t);
inline bool is_f8(ElemType t) { return t == ElemType::F8E4M3FN || t == ElemType::F8E5M2; }
bool is_unsigned(ElemType t);
inline bool is_complex(ElemType t) { return t == ElemType::C64 || t == ElemType::C128; }
inline bool is_integral(ElemType t) { return !is_float(t) && !is_complex(t) && t != ElemType::Pred; }
// The real type of a complex type's parts (C64 -> F32); other types map to themselves.
inline ElemType part_type(ElemType t) {
  return t == ElemType::C64 ? ElemType::F32 : t == ElemType::C128 ? ElemType::F64 : t;
}
// The complex type whose parts have type t (F32 -> C64, F64 -> C128; others -> C64).
inline ElemType complex_type(ElemType t) { return t == ElemType::F64 || t == ElemType::C128 ? ElemType::C128 : ElemType::C64; }
int bit_width(ElemType t);
const char* mlir_name(ElemType t);

struct Type {
  ElemType elem = ElemType::F32;
  Shape shape;
  std::string str() const;
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
};

struct Value {
  int id = -1;
  Type type;
  const Shape& shape() const { return type.shape; }
  ElemType elem() const { return type.elem; }
  int64_t rank() const { return type.rank(); }
  std::string name() const { return "%v" + std::to_string(id); }
};

// Precision of dot_general / convolution operands (StableHLO precision_config): DEFAULT lets
// the backend pick its fastest (bf16 passes on TPU), HIGH ~ bf16x3, HIGHEST = full float32.
enum class Precision : uint8_t { Default, High, Highest };
const char* precision_name(Precision p);

// Comparison direction names as StableHLO spells them.
enum class Cmp { EQ, NE, LT, LE, GT, GE };

class Builder {
 public:
  // ---- function signature
  Value arg(const Type& t);
  // Marks argument `arg_index` as donated into result `result_index` (XLA updates in place).
  void alias(int arg_index, int result_index);
  std::string module(const std::vector<Value>& results) const;

  // ---- foreign functions (JAX / Pallas modules spliced into this program)
  // Adds top-level `func.func` text (already renamed to unique, private symbols) once per key.
  void add_functions(const std::string& key, const std::string& text);
  // `func.call @callee(operands)` with the given result types.
  std::vector<Value> call(const std::string& callee, const std::vector<Value>& operands,
                          const std::vector<Type>& results);
  int num_args() const { return static_cast<int>(args_.size()); }

  // ---- generic op emission
  Value op(std::string_view name, const std::vector<Value>& operands, const Type& result,
           std::string_view attrs = "");
  std::vector<Value> op_multi(std::string_view name, const std::vector<Value>& operands,
                              const std::vector<Type>& results, std::string_view attrs = "",
                              std::string_view region = "");
  // Builds a region with one block whose arguments have `types`; `body` returns the values to
  // yield. Returns the region text for op_multi.
  std::string region(const std::vector<Type>& types,
                     const std::function<std::vector<Value>(const std::vector<Value>&)>& body);
  // stablehlo.while: `cond` maps the loop state to an i1 scalar, `body` to the next state. The
  // regions take everything through the state (nothing captured from above).
  std::vector<Value> while_loop(const std::vector<Value>& init,
                                const std::function<Value(const std::vector<Value>&)>& cond,
                                const std::function<std::vector<Value>(const std::vector<Value>&)>& body);

  // ---- constants
  Value constant_f(double v, ElemType t, const Shape& shape = {});
  Value constant_i(int64_t v, ElemType t, const Shape& shape = {});
  Value zeros(const Type& t) { return constant_i(0, t.elem, t.shape); }
  Value iota(const Type& t, int64_t dim);
  // Smallest / largest representable value (infinities for floats).
  Value lowest(ElemType t, const Shape& shape = {});
  Value highest(ElemType t, const Shape& shape = {});

  // ---- elementwise
  Value unary(std::string_view name, Value x);  // "stablehlo.<name>", result type of x
  Value binary(std::string_view name, Value a, Value b);  // same-shape same-type operands
  Value add(Value a, Value b) { return binary("add", a, b); }
  Value sub(Value a, Value b) { return binary("subtract", a, b); }
  Value mul(Value a, Value b) { return binary("multiply", a, b); }
  Value div(Value a, Value b) { return binary("divide", a, b); }
  Value rem(Value a, Value b) { return binary("remainder", a, b); }
  Value max(Value a, Value b) { return binary("maximum", a, b); }
  Value min(Value a, Value b) { return binary("minimum", a, b); }
  Value pow(Value a, Value b) { return binary("power", a, b); }
  Value and_(Value a, Value b) { return binary("and", a, b); }
  Value or_(Value a, Value b) { return binary("or", a, b); }
  Value xor_(Value a, Value b) { return binary("xor", a, b); }
  Value neg(Value x) { return unary("negate", x); }
  Value abs(Value x) { return unary("abs", x); }
  Value exp(Value x) { return unary("exponential", x); }
  Value log(Value x) { return unary("log", x); }
  Value sqrt(Value x) { return unary("sqrt", x); }
  Value rsqrt(Value x) { return unary("rsqrt", x); }
  Value tanh(Value x) { return unary("tanh", x); }
  Value floor(Value x) { return unary("floor", x); }
  Value not_(Value x) { return unary("not", x); }
  Value compare(Cmp dir, Value a, Value b);
  Value select(Value pred, Value on_true, Value on_false);
  Value clamp(Value lo, Value x, Value hi);
  Value convert(Value x, ElemType to);  // PyTorch cast semantics for bool targets (x != 0)
  Value bitcast(Value x, const Type& to);
  Value convert_to_f8(Value x, ElemType to);
  // Complex parts: real/imag of a complex value (a real value's imag is zeros), and the
  // complex value of two same-type real parts.
  Value real(Value x);
  Value imag(Value x);
  Value complex(Value re, Value im);

  // ---- shape
  Value reshape(Value x, const Shape& shape);
  Value broadcast_in_dim(Value x, const Shape& shape, const std::vector<int64_t>& dims);
  Value broadcast_to(Value x, const Shape& shape);  // numpy rules, trailing alignment
  Value transpose(Value x, const std::vector<int64_t>& perm);
  // The operand of `v` when transpose() made it with `perm` (else nullopt): a consumer that reads
  // either layout (the host GEMM, lowering/host_gemm.h) takes the array before the transpose.
  std::optional<Value> transposed_from(Value v, const std::vector<int64_t>& perm) const;
  Value slice(Value x, const Shape& start, const Shape& limit, const Shape& strides = {});
  Value dynamic_slice(Value x, const std::vector<Value>& starts, const Shape& sizes);
  Value dynamic_update_slice(Value x, Value update, const std::vector<Value>& starts);
  Value concatenate(const std::vector<Value>& xs, int64_t dim);
  Value pad(Value x, Value pad_value, const Shape& lo, const Shape& hi, const Shape& interior = {});
  Value reverse(Value x, const std::vector<int64_t>& dims);

  // ---- contractions, reductions
  // The precision the next contractions carry (set per op from torch.tpu.precision /
  // torch.set_float32_matmul_precision when the op was planned).
  void set_precision(Precision p) { precision_ = p; }
  Precision precision() const { return precision_; }
  // "precision_config = [...]" for a two-operand contraction at the current precision.
  std::string precision_config() const;
  Value dot_general(Value a, Value b, const std::vector<int64_t>& lhs_batch,
                    const std::vector<int64_t>& rhs_batch, const std::vector<int64_t>& lhs_contract,
                    const std::vector<int64_t>& rhs_contract, ElemType result);
  // Reduce with a single binary body op ("add", "multiply", "maximum", "minimum", "and", "or").
  Value reduce(Value x, Value init, const std::vector<int64_t>& dims, std::string_view body_op);
  std::vector<Value> reduce_multi(
      const std::vector<Value>& xs, const std::vector<Value>& inits,
      const std::vector<int64_t>& dims,
      const std::function<std::vector<Value>(const std::vector<Value>&)>& body);
  Value reduce_window(Value x, Value init, const Shape& window, const Shape& strides,
                      const std::vector<std::pair<int64_t, int64_t>>& padding,
                      std::string_view body_op);

  // ---- gather / scatter (dimension numbers as StableHLO names them)
  Value gather(Value operand, Value indices, const std::vector<int64_t>& offset_dims,
               const std::vector<int64_t>& collapsed_slice_dims,
               const std::vector<int64_t>& start_index_map, int64_t index_vector_dim,
               const Shape& slice_sizes, const Shape& result_shape,
               const std::vector<int64_t>& operand_batching_dims = {},
               const std::vector<int64_t>& start_indices_batching_dims = {});
  // `combine` is "" for overwrite, otherwise the binary op applied as old (op) update.
  Value scatter(Value operand, Value indices, Value updates,
                const std::vector<int64_t>& update_window_dims,
                const std::vector<int64_t>& inserted_window_dims,
                const std::vector<int64_t>& scatter_dims_to_operand_dims, int64_t index_vector_dim,
                std::string_view combine,
                const std::vector<int64_t>& input_batching_dims = {},
                const std::vector<int64_t>& scatter_indices_batching_dims = {});
  // Stable sort of several same-shape operands along `dim`; `less` compares the pairs.
  std::vector<Value> sort(const std::vector<Value>& xs, int64_t dim,
                          const std::function<Value(const std::vector<Value>&)>& less);

  // (new_state, bits) from a 2 x ui64 state, with the Philox algorithm.
  std::pair<Value, Value> rng_bits(Value state, const Type& bits_type);

  // Device-side error checks. While checking() is on, lowerings record (bad predicate, code)
  // pairs; error_status() folds them into one i32 (0 = fine, else the largest failing code), and
  // fold_status() adds that to the device's status s32[2] = {checked launches that passed, first
  // failure's code} (runtime/device_checks.h), so no host sync is needed per op.
  void set_checking(bool on) { checking_ = on; }
  bool checking() const { return checking_; }
  void add_error(Value bad, int32_t code);  // `bad`: pred of any shape (any element set = error)
  bool has_errors() const { return !errors_.empty(); }
  const std::vector<int32_t>& error_codes() const { return error_codes_; }
  Value error_status();
  Value fold_status(Value status);  // status: s32[2]; returns the updated status
  static std::string ints(const std::vector<int64_t>& v);  // "1, 2, 3"
  static std::string dense_array(const std::vector<int64_t>& v);  // "array<i64: 1, 2>"

 private:
  Value fresh(const Type& t) { return Value{next_id_++, t}; }
  std::string& body() { return bodies_.back(); }
  std::vector<Value> args_;
  std::vector<std::pair<int, int>> aliases_;
  std::vector<std::pair<std::string, std::string>> functions_;  // (key, text), printed after main
  std::vector<std::string> bodies_{std::string()};
  int next_id_ = 0;
  bool checking_ = false;
  Precision precision_ = Precision::Highest;
  std::vector<Value> errors_;  // i32 scalars: code or 0
  std::vector<int32_t> error_codes_;
  std::vector<std::tuple<int, Value, std::vector<int64_t>>> transposes_;  // (result id, operand, perm)
};

}  // namespace tpu::shlo
