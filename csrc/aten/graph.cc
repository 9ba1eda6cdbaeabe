#include "graph.h"

#include <ATen/core/Tensor.h>
#include <ATen/native/TypeProperties.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/scalar_tensor.h>

#include "common.h"
#include "plan_call.h"
#include "lowering/host_gemm.h"
#include "lowering/lowering.h"
#include "runtime/compile_cache.h"
#include "runtime/context.h"
#include "runtime/device_checks.h"
#include "runtime/executor.h"
#include "runtime/view_io.h"

namespace tpu::aten {

using lowering::Arg;
using shlo::Builder;
using shlo::ElemType;
using shlo::Type;
using shlo::Value;

namespace {

// Input dims of a program: per input, the dims of the buffer it is given (runtime/storage.h).
using InputDims = std::vector<shlo::Shape>;

struct Graph {
  pjrt::ExecutablePtr exe;  // inputs given as buffers of their logical shapes (the common case)
  GraphDesc desc;
  std::vector<int64_t> out_numel;     // storage elements of each output buffer
  std::vector<shlo::Shape> out_dims;  // dims of each output buffer
  std::vector<runtime::CheckSource> checks;  // device-side checks: the last result is their status
  // The same graph for inputs whose storages hold other dims (a view's base shape): its parameters
  // have those dims and are reshaped inside (a bitcast). Built on first use.
  std::mutex variants_mu;
  std::map<InputDims, pjrt::ExecutablePtr> variants;
};

std::mutex graphs_mu;
std::vector<std::shared_ptr<Graph>>& graphs() {
  static auto* g = std::make_unique<std::vector<std::shared_ptr<Graph>>>().release();
  return *g;
}

int64_t span_of(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  int64_t n = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) return 0;
    n += (sizes[i] - 1) * strides[i];
  }
  return n;
}

// PyTorch's result type over the node's inputs, as eager computes it (ResultTypeAccumulator).
c10::ScalarType common_dtype(const GraphNode& node, const std::unordered_map<int64_t, Value>& vals) {
  ResultTypeAccumulator promotion;
  for (const GraphArg& a : node.args) {
    if (a.name == "out" || a.name == "generator") continue;
    switch (a.kind) {
      case ArgKind::Tensor: {
        const Value& v = vals.at(a.value_ids[0]);
        promotion.value(scalar_of(v.elem()), v.shape().empty());
        break;
      }
      case ArgKind::NumberValue: {
        const ElemType e = vals.at(a.value_ids[0]).elem();
        promotion.scalar_kind(shlo::is_float(e)     ? at::kDouble
                              : shlo::is_complex(e) ? at::kComplexDouble
                              : e == ElemType::Pred ? at::kBool
                                                    : at::kLong);
        break;
      }
      case ArgKind::FloatScalar: promotion.scalar_kind(at::kDouble); break;
      case ArgKind::IntScalar: promotion.scalar_kind(at::kLong); break;
      case ArgKind::BoolScalar: promotion.scalar_kind(at::kBool); break;
      default: break;
    }
  }
  return promotion.result(node.out_types.empty() || node.out_types[0].dtype < 0
                              ? c10::kFloat
                              : static_cast<c10::ScalarType>(node.out_types[0].dtype));
}

}  // namespace

std::vector<std::string> unsupported_ops(const GraphDesc& desc) {
  std::vector<std::string> out;
  for (const GraphNode& n : desc.nodes)
    if (!lowering::find_op(n.op)) out.push_back(n.op + "." + n.overload);
  return out;
}

namespace {

// A graph argument as the lowering reads it: values by id, Python numbers as constants.
Arg lowering_arg(Builder& b, const GraphArg& arg, const std::unordered_map<int64_t, Value>& vals) {
  Arg a;
  switch (arg.kind) {
    case ArgKind::None: a.kind = Arg::Kind::None; break;
    case ArgKind::Tensor: a.kind = Arg::Kind::Tensor; a.tensor = vals.at(arg.value_ids[0]); break;
    case ArgKind::TensorList:
    case ArgKind::OptionalTensorList:
      a.kind = arg.kind == ArgKind::TensorList ? Arg::Kind::TensorList : Arg::Kind::OptTensorList;
      for (int64_t id : arg.value_ids) {
        if (id < 0) a.tensors.push_back(std::nullopt);
        else a.tensors.push_back(vals.at(id));
      }
      break;
    case ArgKind::NumberValue: a.kind = Arg::Kind::Scalar; a.scalar = vals.at(arg.value_ids[0]); break;
    case ArgKind::FloatScalar:
      a.kind = Arg::Kind::Scalar;
      a.scalar = b.constant_f(arg.double_value, ElemType::F64);
      a.scalar_value = arg.double_value;
      break;
    case ArgKind::IntScalar:
      a.kind = Arg::Kind::Scalar;
      a.scalar = b.constant_i(arg.int_value, ElemType::S64);
      a.scalar_value = static_cast<double>(arg.int_value);
      break;
    case ArgKind::BoolScalar: a.kind = Arg::Kind::Scalar; a.scalar = b.constant_i(arg.int_value, ElemType::Pred); break;
    case ArgKind::Int: a.kind = Arg::Kind::Int; a.i = arg.int_value; break;
    case ArgKind::IntList: a.kind = Arg::Kind::IntList; a.ints = arg.ints; break;
    case ArgKind::Double: a.kind = Arg::Kind::Double; a.d = arg.double_value; break;
    case ArgKind::Bool: a.kind = Arg::Kind::Bool; a.b = arg.int_value != 0; break;
    case ArgKind::String: a.kind = Arg::Kind::String; a.s = arg.string_value; break;
    case ArgKind::DType: a.kind = Arg::Kind::DType; a.dtype = elem_of(static_cast<c10::ScalarType>(arg.int_value)); break;
  }
  return a;
}

// Eager grouped-GEMM kernels tell the lowering that the weight is column-major from its strides
// (aten/explicit_kernels.cc); graphs have no strides, but the weight is then a transpose node:
// true when `node` swaps the last two dims of a 3-D value (Transformers' weight.transpose(-2, -1)).
bool swaps_last_two_dims(const GraphNode& node, const std::unordered_map<int64_t, Value>& vals) {
  if (node.op != "transpose" && node.op != "permute") return false;
  if (node.args.empty() || node.args[0].kind != ArgKind::Tensor) return false;
  auto in = vals.find(node.args[0].value_ids[0]);
  if (in == vals.end() || in->second.rank() != 3) return false;
  auto norm = [](int64_t d) { return d < 0 ? d + 3 : d; };
  if (node.op == "transpose") {
    if (node.args.size() < 3) return false;
    const int64_t a = norm(node.args[1].int_value), b = norm(node.args[2].int_value);
    return std::min(a, b) == 1 && std::max(a, b) == 2;
  }
  if (node.args.size() < 2) return false;
  const auto& d = node.args[1].ints;
  return d.size() == 3 && norm(d[0]) == 0 && norm(d[1]) == 2 && norm(d[2]) == 1;
}

// The column-major hint ("mat2_col_major" / "rhs_col_major") for the weight of a grouped GEMM
// node whose weight value an earlier transpose node produced.
void add_layout_hint(const GraphDesc& desc, size_t node_index, const std::unordered_map<int64_t, Value>& vals,
                     lowering::OpCall& call) {
  const GraphNode& node = desc.nodes[node_index];
  const char* weight = node.op == "_grouped_mm" ? "mat2" : node.op == "ragged_dot" ? "rhs" : nullptr;
  if (!weight) return;
  for (const GraphArg& arg : node.args) {
    if (arg.name != weight || arg.kind != ArgKind::Tensor) continue;
    const int64_t id = arg.value_ids[0];
    for (size_t j = node_index; j-- > 0;) {
      const GraphNode& p = desc.nodes[j];
      if (p.out_ids.empty() || p.out_ids[0] != id) continue;
      if (swaps_last_two_dims(p, vals)) {
        Arg hint;
        hint.kind = Arg::Kind::Bool;
        hint.b = true;
        call.args.emplace_back(std::string(weight) + "_col_major", std::move(hint));
      }
      return;
    }
  }
}

// The weight behind `mm(x, t(W))`: W when the node's mat2 is a transpose (t, or permute/transpose
// of the two dims) of a 2-D value an earlier node produced; nullopt otherwise.
std::optional<Value> transposed_weight(const GraphDesc& desc, size_t node_index,
                                       const std::unordered_map<int64_t, Value>& vals) {
  const GraphNode& node = desc.nodes[node_index];
  const GraphArg* mat2 = nullptr;
  for (const GraphArg& a : node.args)
    if (a.name == "mat2" && a.kind == ArgKind::Tensor) mat2 = &a;
  if (!mat2) return std::nullopt;
  for (size_t j = node_index; j-- > 0;) {
    const GraphNode& p = desc.nodes[j];
    if (p.out_ids.empty() || p.out_ids[0] != mat2->value_ids[0]) continue;
    if (p.args.empty() || p.args[0].kind != ArgKind::Tensor) return std::nullopt;
    auto in = vals.find(p.args[0].value_ids[0]);
    if (in == vals.end() || in->second.rank() != 2) return std::nullopt;
    bool swaps = p.op == "t" || (p.op == "transpose" && p.args.size() >= 3 &&
                                 (p.args[1].int_value + 2) % 2 != (p.args[2].int_value + 2) % 2) ||
                 (p.op == "permute" && p.args.size() >= 2 && p.args[1].ints.size() == 2 &&
                  (p.args[1].ints[0] + 2) % 2 == 1);
    if (!swaps) return std::nullopt;
    return in->second;
  }
  return std::nullopt;
}

// Products of many rows against a transposed [N, K] weight (every nn.Linear: mm(x, t(W))) are
// lowered as t(dot(W, t(x))) with an optimization_barrier before the final transpose. XLA:CPU
// canonicalizes dot(x, t(W)) to a [K, N] right operand, and its GEMM (Eigen) then packs the
// transposed weight on every call: measured (process CPU, x[128,512] @ W[1376,512].t()) 2.9 ms
// against 1.7 ms for the swapped product. Without the barrier XLA's algebraic simplifier folds the
// outer transpose back into the dot and undoes the swap. Same lowering (mm), same sums per
// element; only which operand XLA treats as the left one changes. One-row products (decode) keep
// the plain form: XLA fuses those into a vectorized loop that already streams W row by row.
constexpr int64_t kSwapMinRows = 2;
constexpr int64_t kSwapMinMacs = int64_t{1} << 20;

bool lower_swapped_product(Builder& b, const GraphDesc& desc, size_t node_index,
                           std::unordered_map<int64_t, Value>& vals) {
  const GraphNode& node = desc.nodes[node_index];
  if (node.op != "mm" || node.out_ids.size() != 1 || node.out_types.size() != 1 || node.out_types[0].dtype < 0)
    return false;
  const ElemType out = elem_of(static_cast<c10::ScalarType>(node.out_types[0].dtype));
  if (!shlo::is_float(out)) return false;
  std::optional<Value> w = transposed_weight(desc, node_index, vals);
  const GraphArg* self = nullptr;
  for (const GraphArg& a : node.args)
    if (a.name == "self" && a.kind == ArgKind::Tensor) self = &a;
  if (!w || !self) return false;
  const Value x = vals.at(self->value_ids[0]);
  if (x.rank() != 2 || x.elem() != w->elem() || x.elem() != out) return false;
  const int64_t m = x.shape()[0], k = x.shape()[1], n = w->shape()[0];
  if (w->shape()[1] != k || m < kSwapMinRows || m > n || m * n * k < kSwapMinMacs) return false;
  if (lowering::host_gemm_wanted(out, 1, m, k, n)) return false;  // mm's host GEMM reads W as it is
  const lowering::OpEntry* entry = lowering::find_op("mm");
  lowering::OpCall call;
  call.name = "mm";
  call.common = out;
  Arg lhs, rhs;
  lhs.kind = rhs.kind = Arg::Kind::Tensor;
  lhs.tensor = *w;
  rhs.tensor = b.transpose(x, {1, 0});
  call.args.emplace_back("self", std::move(lhs));
  call.args.emplace_back("mat2", std::move(rhs));
  call.outs.push_back(Type{out, {n, m}});
  Value swapped = b.convert(entry->fn(b, call).at(0), out);
  Value kept = b.op("optimization_barrier", {swapped}, swapped.type);
  vals[node.out_ids[0]] = b.transpose(kept, {1, 0});
  return true;
}

// Lowers one node into `b`: its results become values `node.out_ids` (converted to the meta
// dtype and shape). Device-side checks it records are appended to `checks` (when given).
void lower_node(Builder& b, const GraphDesc& desc, size_t node_index, std::unordered_map<int64_t, Value>& vals,
                std::vector<runtime::CheckSource>* checks) {
  const GraphNode& node = desc.nodes[node_index];
  if (!desc.plain_outputs && lower_swapped_product(b, desc, node_index, vals)) return;
  const lowering::OpEntry* entry = lowering::find_op(node.op);
  TORCH_CHECK(entry, "torch_tpu: no lowering for aten::", node.op, " in the compiled graph");
  lowering::OpCall call;
  call.name = node.op;
  call.overload = node.overload;
  call.common = elem_of(common_dtype(node, vals));
  for (const GraphArg& arg : node.args) call.args.emplace_back(arg.name, lowering_arg(b, arg, vals));
  add_layout_hint(desc, node_index, vals, call);
  for (const TensorType& t : node.out_types)
    call.outs.push_back(Type{t.dtype < 0 ? ElemType::F32 : elem_of(static_cast<c10::ScalarType>(t.dtype)), t.sizes});
  std::vector<Value> res;
  // Empty results hold no data: zeros of the right type (lowerings need not handle 0-size reads).
  bool all_empty = !call.outs.empty();
  for (size_t i = 0; i < call.outs.size(); ++i)
    all_empty &= node.out_types[i].dtype >= 0 && call.outs[i].numel() == 0;
  if (all_empty) {
    for (const Type& t : call.outs) res.push_back(b.zeros(t));
  } else {
    try {
      size_t ncodes = b.error_codes().size();
      if (!entry->complex) {  // lowerings written for real numbers never see complex values
        bool any = shlo::is_complex(call.common);
        for (const Type& t : call.outs) any |= shlo::is_complex(t.elem);
        for (const auto& [name, a] : call.args) {
          any |= a.kind == Arg::Kind::Tensor && shlo::is_complex(a.tensor.elem());
          for (const auto& t : a.tensors) any |= t && shlo::is_complex(t->elem());
        }
        if (any) throw lowering::Unsupported("no complex lowering");
      }
      b.set_checking(checks && !desc.plain_outputs && entry->checked && runtime::device_checks());
      res = entry->fn(b, call);
      b.set_checking(false);
      for (size_t k = ncodes; k < b.error_codes().size(); ++k)
        checks->push_back({b.error_codes()[k], "aten::" + node.op + " in graph " + desc.name, {}});
    } catch (const lowering::Unsupported& e) {
      // The Python backend parses "graph node <i>" and runs that node outside the compiled pieces.
      throw lowering::Unsupported("torch_tpu: graph node " + std::to_string(node_index) +
                                  " unsupported (aten::" + node.op + "): " + e.what());
    }
  }
  TORCH_CHECK(res.size() >= node.out_ids.size() || node.out_ids.empty(),
              "torch_tpu: lowering of ", node.op, " returned too few values");
  for (size_t i = 0; i < node.out_ids.size(); ++i) {
    if (node.out_ids[i] < 0) continue;
    const Type& ot = call.outs[i];
    Value v = b.convert(res[i], ot.elem);
    if (v.shape() != ot.shape) v = b.reshape(v, ot.shape);
    vals[node.out_ids[i]] = v;
  }
}

// The program's results: graph outputs written into storages of their FX strides (shaped values
// for export), then aot's input mutations (aliased to their inputs: donated), then the status.
std::vector<Value> graph_results(Builder& b, const GraphDesc& desc, const std::unordered_map<int64_t, Value>& vals,
                                 std::vector<int64_t>& out_numel, std::vector<shlo::Shape>& out_dims) {
  std::vector<Value> results;
  for (size_t i = 0; i < desc.outputs.size(); ++i) {
    const TensorType& t = desc.output_types[i];
    ElemType e = elem_of(static_cast<c10::ScalarType>(t.dtype));
    Value v = b.convert(vals.at(desc.outputs[i]), e);
    if (v.shape() != t.sizes) v = b.reshape(v, t.sizes);
    if (desc.plain_outputs) {  // export: results as shaped values, no storage layout
      results.push_back(v);
      continue;
    }
    int64_t n = span_of(t.sizes, t.strides);
    runtime::ViewDesc vd{e, t.sizes, t.strides, 0};
    Value storage = vd.covers(n) || vd.permuted_whole(n) ? Value{} : b.zeros(Type{e, {n}});
    results.push_back(runtime::write_view(b, storage, v, vd, n, e));  // whole: its logical shape
    out_numel.push_back(n);
    out_dims.push_back(results.back().shape());
  }
  for (const auto& [input, id] : desc.mutations) {
    const TensorType& t = desc.inputs[input];
    Value v = b.convert(vals.at(id), elem_of(static_cast<c10::ScalarType>(t.dtype)));
    if (v.shape() != t.sizes) v = b.reshape(v, t.sizes);
    b.alias(static_cast<int>(input), static_cast<int>(results.size()));
    results.push_back(v);
  }
  if (b.has_errors()) {  // the device's status: last argument, donated to the last result
    Value status = b.arg(Type{ElemType::S32, {2}});
    b.alias(b.num_args() - 1, static_cast<int>(results.size()));
    results.push_back(b.fold_status(status));
  }
  return results;
}

// The program text; `out_numel` / `out_dims` get the storage elements and dims of each output
// buffer. `input_dims` (when given) are the dims of the buffers the inputs arrive in.
std::string graph_module(const GraphDesc& desc, std::vector<int64_t>& out_numel, std::vector<shlo::Shape>& out_dims,
                         std::vector<runtime::CheckSource>* checks = nullptr, const InputDims* input_dims = nullptr) {
  shlo::Builder b;
  const lowering::GraphGemmScope graph_gemm;  // host_gemm_wanted's compiled-graph rule (matmul.cc)
  b.set_precision(desc.precision < 0 ? matmul_precision() : static_cast<shlo::Precision>(desc.precision));
  std::unordered_map<int64_t, Value> vals;
  for (size_t i = 0; i < desc.inputs.size(); ++i) {
    const ElemType e = elem_of(static_cast<c10::ScalarType>(desc.inputs[i].dtype));
    const shlo::Shape& sizes = desc.inputs[i].sizes;
    if (input_dims && (*input_dims)[i] != sizes) vals[static_cast<int64_t>(i)] = b.reshape(b.arg(Type{e, (*input_dims)[i]}), sizes);
    else vals[static_cast<int64_t>(i)] = b.arg(Type{e, sizes});
  }
  for (size_t node_index = 0; node_index < desc.nodes.size(); ++node_index) lower_node(b, desc, node_index, vals, checks);
  return b.module(graph_results(b, desc, vals, out_numel, out_dims));
}

}  // namespace

std::string graph_text(const GraphDesc& desc) {
  std::vector<int64_t> out_numel;
  std::vector<shlo::Shape> out_dims;
  return graph_module(desc, out_numel, out_dims);
}

int64_t build_graph(const GraphDesc& desc) {
  auto g = std::make_shared<Graph>();
  g->desc = desc;
  std::string mlir = graph_module(desc, g->out_numel, g->out_dims, &g->checks);
  std::string why = "new graph, inputs (";
  for (size_t i = 0; i < desc.inputs.size(); ++i) {
    why += (i ? ", " : "") + std::string(shlo::mlir_name(elem_of(static_cast<c10::ScalarType>(desc.inputs[i].dtype)))) + "[";
    for (size_t k = 0; k < desc.inputs[i].sizes.size(); ++k) why += (k ? ", " : "") + std::to_string(desc.inputs[i].sizes[k]);
    why += "]";
  }
  why += "), " + std::to_string(desc.nodes.size()) + " ops";
  g->exe = runtime::CompileCache::get().get_or_compile(mlir, "graph " + desc.name, why, desc.compile_options);
  std::lock_guard<std::mutex> lock(graphs_mu);
  graphs().push_back(g);
  return static_cast<int64_t>(graphs().size() - 1);
}

namespace {

// The inputs after the given ones: each random op's generator state (u64[2] on the host), drawn
// in graph order as eager draws them op by op (draw_rng_state, the eager path's draw).
std::vector<at::Tensor> with_generator_states(const GraphDesc& d, at::TensorList given, int device) {
  std::vector<at::Tensor> inputs(given.begin(), given.end());
  for (const auto& [input, counters] : d.rng) {
    TORCH_CHECK(input == static_cast<int64_t>(inputs.size()), "torch_tpu: generator inputs come last");
    runtime::HostOperand state = draw_rng_state(std::nullopt, device, counters);
    at::Tensor s = at::empty({2}, at::TensorOptions().dtype(at::kUInt64));
    std::memcpy(s.data_ptr(), state.bytes, 16);
    inputs.push_back(s);
  }
  return inputs;
}

struct StagedInputs {
  std::vector<at::Tensor> staged;  // keeps copies alive through the launch
  std::vector<pjrt::BufferPtr> keep;
  std::vector<PJRT_Buffer*> args;
  std::vector<int64_t> non_donatable;
  InputDims dims;             // of each argument buffer
  bool logical_dims = true;   // every buffer has its input's logical shape
};

// The program's argument buffers: whole tpu storages as they are, strided views and dtype
// changes staged into contiguous copies, host scalars uploaded. Only mutated inputs whose storage
// appears once may be donated.
StagedInputs stage_inputs(const GraphDesc& d, const std::vector<at::Tensor>& inputs, size_t num_given, int device) {
  auto& ctx = runtime::Context::get();
  StagedInputs in;
  std::vector<const void*> storages;
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor t = inputs[i];
    ElemType e = elem_of(static_cast<c10::ScalarType>(d.inputs[i].dtype));
    if (t.device().type() != kTpu) {
      TORCH_CHECK(t.dim() == 0 || i >= num_given, "torch_tpu: compiled graph input ", i, " is on ",
                  t.device(), "; move it to tpu");
      at::Tensor h = t.to(scalar_of(e)).contiguous();
      in.keep.push_back(ctx.client().from_host(h.data_ptr(), pjrt_of(e), h.sizes().vec(), ctx.device(device)));
      in.args.push_back(in.keep.back()->raw());
      in.dims.push_back(h.sizes().vec());
      in.non_donatable.push_back(static_cast<int64_t>(i));
      continue;
    }
    TORCH_CHECK(t.device().index() == device, "Expected all tensors to be on the same device, but found "
                "at least two devices, tpu:", device, " and tpu:", t.device().index(), "!");
    materialize(t);
    runtime::StorageState* st = &state_of(t);
    bool whole = t.is_contiguous() && t.storage_offset() == 0 &&
                 static_cast<size_t>(t.numel()) * t.itemsize() == st->nbytes && st->elem == e &&
                 t.scalar_type() == scalar_of(e);
    if (!whole) {
      at::Tensor c = at::empty(t.sizes(), t.options().dtype(scalar_of(e)));
      copy_into(c, t);
      fused_flush(runtime::FlushReason::CompiledGraph);  // the staged buffer is passed below
      in.staged.push_back(c);
      st = &state_of(c);
    }
    for (const void* s : storages)
      if (s == st) in.non_donatable.push_back(static_cast<int64_t>(i));
    storages.push_back(st);
    in.args.push_back(st->buffer->raw());
    in.dims.emplace_back(st->dims.begin(), st->dims.end());
    if (in.dims.back() != d.inputs[i].sizes) in.logical_dims = false;
  }
  // Inputs that are not mutated must never be donated.
  for (size_t i = 0; i < inputs.size(); ++i) {
    bool mutated = false;
    for (const auto& m : d.mutations) mutated |= m.first == static_cast<int64_t>(i);
    if (!mutated) in.non_donatable.push_back(static_cast<int64_t>(i));
  }
  return in;
}

// The graph's program for inputs that arrive in buffers of other dims (`dims`, per input).
pjrt::ExecutablePtr graph_variant(Graph& g, const InputDims& dims) {
  std::lock_guard<std::mutex> lock(g.variants_mu);
  if (auto it = g.variants.find(dims); it != g.variants.end()) return it->second;
  std::vector<int64_t> out_numel;
  std::vector<shlo::Shape> out_dims;
  std::vector<runtime::CheckSource> checks;  // the same checks as g.checks: the same status result
  std::string mlir = graph_module(g.desc, out_numel, out_dims, &checks, &dims);
  auto exe = runtime::CompileCache::get().get_or_compile(mlir, "graph " + g.desc.name,
                                                         "input storages hold other dims (views of other shapes)",
                                                         g.desc.compile_options);
  if (g.variants.size() >= 16) g.variants.clear();  // bounded; a dropped variant is rebuilt
  g.variants.emplace(dims, exe);
  return exe;
}

// The graph outputs as tensors of their FX strides, holding the result buffers.
std::vector<at::Tensor> output_tensors(const Graph& g, const std::vector<pjrt::BufferPtr>& results, int device) {
  const GraphDesc& d = g.desc;
  c10::DeviceGuard guard(c10::Device(kTpu, static_cast<c10::DeviceIndex>(device)));
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < d.outputs.size(); ++i) {
    const TensorType& t = d.output_types[i];
    at::ScalarType st = static_cast<c10::ScalarType>(t.dtype);
    at::Tensor o = at::empty_strided(t.sizes, t.strides, at::TensorOptions().dtype(st).device(c10::Device(kTpu, device)));
    if (g.out_numel[i] > 0) {
      runtime::StorageState& s = state_of(o);
      std::lock_guard<std::mutex> lock(s.mu);
      s.hold(results[i], elem_of(st), g.out_dims[i]);
    }
    outs.push_back(o);
  }
  return outs;
}

// aot's input mutations: the result buffer becomes the input's storage (whole tensors) or is
// written through copy_ (strided views, CPU scalar inputs).
void write_back_mutations(const GraphDesc& d, const std::vector<at::Tensor>& inputs,
                          const std::vector<pjrt::BufferPtr>& results, int device) {
  for (size_t k = 0; k < d.mutations.size(); ++k) {
    const at::Tensor& t = inputs[d.mutations[k].first];
    const pjrt::BufferPtr& buf = results[d.outputs.size() + k];
    ElemType e = elem_of(t.scalar_type());
    bool on_tpu = t.device().type() == kTpu;
    if (on_tpu) {
      runtime::StorageState& s = state_of(t);
      bool whole = t.is_contiguous() && t.storage_offset() == 0 &&
                   static_cast<size_t>(t.numel()) * t.itemsize() == s.nbytes;
      if (whole) {
        std::lock_guard<std::mutex> lock(s.mu);
        s.hold(buf, e, t.sizes());
        continue;
      }
    }
    // A strided view, or a CPU scalar input (an optimizer's step count): write through copy_.
    at::Tensor tmp = at::empty(t.sizes(), t.options().device(c10::Device(kTpu, device))
                                              .memory_format(c10::MemoryFormat::Contiguous));
    runtime::StorageState& ts = state_of(tmp);
    ts.hold(buf, e, t.sizes());
    copy_into(t, tmp);
    fused_flush(runtime::FlushReason::CompiledGraph);
  }
}

std::vector<at::Tensor> run_graph(int64_t id, at::TensorList given) {
  fused_flush(runtime::FlushReason::CompiledGraph);  // inputs may have pending fused values
  std::shared_ptr<Graph> g;
  {
    std::lock_guard<std::mutex> lock(graphs_mu);
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(graphs().size()), "torch_tpu: unknown graph ", id);
    g = graphs()[id];
  }
  const GraphDesc& d = g->desc;
  TORCH_CHECK(given.size() + d.rng.size() == d.inputs.size(), "torch_tpu: graph expects ",
              d.inputs.size() - d.rng.size(), " inputs, got ", given.size());
  int device = -1;
  for (const at::Tensor& t : given)
    if (t.device().type() == kTpu) { device = t.device().index(); break; }
  if (device < 0) device = 0;
  std::vector<at::Tensor> inputs = with_generator_states(d, given, device);
  StagedInputs in = stage_inputs(d, inputs, given.size(), device);
  std::vector<runtime::CheckSource> sources;  // captured before the status lock (the capture takes the GIL)
  std::optional<runtime::CheckedLaunch> check;
  if (!g->checks.empty()) {
    sources = g->checks;
    runtime::LaunchSite site = runtime::capture_site();  // the line calling the compiled code
    for (auto& s : sources) s.site = site;
    check.emplace(device);
    in.args.push_back(check->status_arg());
  }
  const pjrt::ExecutablePtr exe = in.logical_dims ? g->exe : graph_variant(*g, in.dims);
  auto results = runtime::Executor::get().launch(*exe, device, in.args, in.non_donatable, "graph " + d.name);
  if (check) check->done(results.back(), std::move(sources));
  std::vector<at::Tensor> outs = output_tensors(*g, results, device);
  write_back_mutations(d, inputs, results, device);
  if (check) {
    try {
      check->raise_if_due();
    } catch (const runtime::DeviceCheckError& e) {  // debug eager raises at the launch
      throw_device_check(e.kind, e.what());
    }
  }
  dispatch_stats().ops++;
  return outs;
}

}  // namespace

TORCH_LIBRARY(torch_tpu, m) {
  m.def("run_graph(int graph, Tensor[] inputs) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(torch_tpu, CompositeExplicitAutograd, m) {
  m.impl("run_graph", run_graph);
}

}  // namespace tpu::aten
