// Foreign StableHLO (JAX / Pallas, exported by JAX) as an op of the one lowering table:
// `torch_tpu::jax_call(Tensor[] args, str kernel) -> Tensor[]`. The Python side lowers the JAX
// function once per shape signature, renames its functions to private, unique symbols and
// registers the text here; the lowering splices the functions into whatever program is being
// built (strict eager, fused eager, a torch.compile graph) and emits one `func.call`, so XLA
// sees the kernel as part of the program (no extra launch, no host round trip).
#include "jax_call.h"

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "lowering.h"

namespace tpu::lowering {

namespace {
std::mutex mu;
std::map<std::string, ForeignModule>& modules() {
  static auto* m = std::make_unique<std::map<std::string, ForeignModule>>().release();
  return *m;
}
}  // namespace

shlo::ElemType elem_from_mlir_name(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(ElemType::F64); ++i)
    if (name == shlo::mlir_name(static_cast<ElemType>(i))) return static_cast<ElemType>(i);
  throw std::invalid_argument("element type '" + name + "' has no tpu dtype (supported: bool, int8-64, "
                              "uint8-64, float16, bfloat16, float32, float64)");
}

void register_foreign_module(ForeignModule m) {
  std::lock_guard<std::mutex> lock(mu);
  modules()[m.key] = std::move(m);
}

bool has_foreign_module(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu);
  return modules().count(key) != 0;
}

ForeignModule foreign_module(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = modules().find(key);
  if (it == modules().end())
    throw std::invalid_argument("torch_tpu: no JAX kernel registered under '" + key + "'");
  return it->second;
}

}  // namespace tpu::lowering

namespace {
using namespace tpu::lowering;

// jax_call returns fresh results; jax_call_out writes them into `out` (a donated input may be
// among them: its storage is then read and written, so the program aliases its buffer).
std::vector<Value> foreign_call(Builder& b, const OpCall& c) {
  ForeignModule m = foreign_module(c.str("kernel"));
  const Arg& a = c.arg("args");
  std::vector<Value> args;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (!a.tensors[i]) throw std::invalid_argument(m.op + ": argument " + std::to_string(i) + " is None");
    args.push_back(*a.tensors[i]);
  }
  if (args.size() != m.in_types.size())
    throw std::invalid_argument(m.op + ": the JAX kernel takes " + std::to_string(m.in_types.size()) +
                                " arrays, got " + std::to_string(args.size()) + " tensors");
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].type.str() != m.in_types[i].str())
      throw std::invalid_argument(m.op + ": tensor argument " + std::to_string(i) + " is " + args[i].type.str() +
                                  " but the JAX kernel was lowered for " + m.in_types[i].str());
  }
  if (c.outs.size() != m.out_types.size())
    throw std::invalid_argument(m.op + ": the JAX kernel returns " + std::to_string(m.out_types.size()) +
                                " arrays, the op expects " + std::to_string(c.outs.size()));
  for (size_t i = 0; i < c.outs.size(); ++i) {
    if (c.outs[i].str() != m.out_types[i].str())
      throw std::invalid_argument(m.op + ": result " + std::to_string(i) + " of the JAX kernel is " +
                                  m.out_types[i].str() + " but the op's output is " + c.outs[i].str());
  }
  b.add_functions(m.key, m.text);
  return b.call(m.callee, args, c.outs);
}

TPU_LOWER(jax_call) { return foreign_call(b, c); }
TPU_LOWER(jax_call_out) { return foreign_call(b, c); }
}  // namespace
