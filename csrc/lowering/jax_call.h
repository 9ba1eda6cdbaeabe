// Registry of foreign StableHLO modules that the `jax_call` lowering splices into programs.
#pragma once
#include <string>
#include <vector>

#include "../stablehlo/builder.h"

namespace tpu::lowering {

struct ForeignModule {
  std::string key;     // unique id, also the kernel argument of torch_tpu::jax_call
  std::string op;      // the user-facing op name, for error messages ("mylib::add")
  std::string text;    // top-level func.func definitions, private, uniquely named
  std::string callee;  // the entry function among them
  std::vector<shlo::Type> in_types, out_types;  // the entry's argument / result types
};

void register_foreign_module(ForeignModule m);
// The element type named as MLIR spells it ("f32", "bf16", "i1", "ui8"); throws for others.
shlo::ElemType elem_from_mlir_name(const std::string& name);
bool has_foreign_module(const std::string& key);
ForeignModule foreign_module(const std::string& key);

}  // namespace tpu::lowering
