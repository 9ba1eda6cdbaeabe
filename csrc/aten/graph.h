// Whole-graph programs for torch.compile: an FX graph of ATen ops, described with plain values
// by the Python backend, lowered through the same lowering table as eager into ONE StableHLO
// module, compiled through the same cache, and run by the `torch_tpu::run_graph` op.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tpu::aten {

// How one argument of a graph node is given. Bound to Python as torch_tpu._C.ArgKind, which the
// describer (python/torch_tpu/_internal/compile.py) uses: this enum is the one definition.
enum class ArgKind : int {
  None,                // None, or a device / layout / memory_format: nothing for the lowering
  Tensor,              // value_ids[0]
  TensorList,          // value_ids
  OptionalTensorList,  // value_ids, -1 = None
  NumberValue,         // a Scalar argument computed in the graph: value_ids[0] is a 0-d value
  Int,                 // int_value
  IntList,             // ints
  Double,              // double_value
  Bool,                // int_value (0 / 1)
  String,              // string_value
  DType,               // int_value = c10::ScalarType
  FloatScalar,         // a constant Python float for a Scalar argument: double_value
  IntScalar,           // ... a Python int: int_value
  BoolScalar,          // ... a Python bool: int_value
};

struct GraphArg {
  std::string name;  // the schema argument's name
  ArgKind kind = ArgKind::None;
  int64_t int_value = 0;
  double double_value = 0;
  std::string string_value;
  std::vector<int64_t> ints;
  std::vector<int64_t> value_ids;  // graph values this argument reads
};

struct TensorType {
  int dtype = -1;  // c10::ScalarType; -1 = no tensor (an unused optional output)
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // graph outputs only
};

struct GraphNode {
  std::string op;        // ATen base name ("add", "native_layer_norm")
  std::string overload;  // "Tensor"
  std::vector<GraphArg> args;
  std::vector<int64_t> out_ids;  // value id per returned tensor (-1 = unused/None)
  std::vector<TensorType> out_types;
};

struct GraphDesc {
  std::vector<TensorType> inputs;      // value ids 0..n-1; 0-d CPU scalars allowed at run time
  std::vector<GraphNode> nodes;
  std::vector<int64_t> outputs;   // value id per graph output that the program produces
  std::vector<TensorType> output_types;  // sizes + strides for each
  std::vector<std::pair<int64_t, int64_t>> mutations;  // (input index, value id written)
  // (input index, Philox counters consumed) per random op: inputs that run_graph fills with the
  // device generator's state (u64[2] = seed, offset), advancing it as eager random ops do. They
  // are the last inputs; callers pass the others.
  std::vector<std::pair<int64_t, int64_t>> rng;
  std::string name;
  std::string compile_options;  // extra serialized CompileOptionsProto fields (XLA options)
  bool plain_outputs = false;   // graph_text for export: outputs as shaped values
  int precision = -1;           // shlo::Precision of contractions; -1: matmul_precision() now
};

// Builds and compiles the program; returns a graph id for run_graph.
int64_t build_graph(const GraphDesc& desc);
// The StableHLO text of the program (torch_tpu.export).
std::string graph_text(const GraphDesc& desc);
// Ops of the description without a lowering (empty when the graph compiles).
std::vector<std::string> unsupported_ops(const GraphDesc& desc);

}  // namespace tpu::aten
