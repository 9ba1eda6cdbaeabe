// Whole-graph programs for torch.compile: an FX graph of ATen ops, described with plain values
// by the Python backend, lowered through the same lowering table as eager into ONE StableHLO
// module, compiled through the same cache, and run by the `torch_tpu::run_graph` op.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tpu::aten {

struct GArg {
  enum class Kind { None, Ref, RefList, OptRefList, ScalarRef, Int, IntList, Double, Bool, Str, DType, ScalarF, ScalarI, ScalarB };
  std::string name;
  Kind kind = Kind::None;
  int64_t i = 0;
  double d = 0;
  std::string s;
  std::vector<int64_t> ints;  // IntList, or value ids for Ref lists (-1 = None)
};

struct GType {
  int dtype;  // c10::ScalarType
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // outputs only
};

struct GNode {
  std::string op;        // ATen base name ("add", "native_layer_norm")
  std::string overload;  // "Tensor"
  std::vector<GArg> args;
  std::vector<int64_t> out_ids;  // value id per returned tensor (-1 = unused/None)
  std::vector<GType> out_types;
};

struct GraphDesc {
  std::vector<GType> inputs;      // value ids 0..n-1; 0-d CPU scalars allowed at run time
  std::vector<GNode> nodes;
  std::vector<int64_t> outputs;   // value id per graph output that the program produces
  std::vector<GType> output_types;  // sizes + strides for each
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
