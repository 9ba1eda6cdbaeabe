#include "compile_reason.h"

#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "common.h"

namespace tpu::aten {

namespace {

// Human-readable signature of a call, one entry per argument, for explaining compiles.
std::vector<std::pair<std::string, std::string>> describe_call(const std::vector<const NamedArg*>& args,
                                                               const std::vector<at::Tensor>& outs) {
  auto tensor_desc = [](const at::Tensor& t) {
    if (!t.defined()) return std::string("None");
    std::string d = std::string(shlo::mlir_name(elem_of(t.scalar_type()))) + "[";
    for (int64_t i = 0; i < t.dim(); ++i) d += (i ? ", " : "") + std::to_string(t.size(i));
    d += "]";
    if (!t.is_contiguous() || t.storage_offset() != 0) {
      d += " strides (";
      for (int64_t i = 0; i < t.dim(); ++i) d += (i ? ", " : "") + std::to_string(t.stride(i));
      d += ") offset " + std::to_string(t.storage_offset());
    }
    if (t.device().is_cpu()) d += " (cpu scalar)";
    return d;
  };
  std::vector<std::pair<std::string, std::string>> out;
  for (const NamedArg* a : args) {
    const c10::IValue& v = a->value;
    std::string d;
    if (a->hint == NamedArg::Hint::Generator) d = "generator";
    else if (v.isTensor()) d = tensor_desc(v.toTensor());
    else if (v.isTensorList()) {
      d = "[";
      for (const at::Tensor& t : v.toTensorList()) d += tensor_desc(t) + "; ";
      d += "]";
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      // Tensor?[] (e.g. index's indices): describe by metadata; printing the IValue would read
      // every tensor's values back to the host (a hidden sync per index tensor per compile).
      d = "[";
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) d += tensor_desc(e.toTensor());
        else if (e.isNone()) d += "None";
        else {
          std::stringstream ss;
          ss << e;
          d += ss.str();
        }
        d += "; ";
      }
      d += "]";
    } else if (a->hint == NamedArg::Hint::Scalar && v.isScalar()) {
      d = v.isDouble() ? "float scalar" : v.isBool() ? "bool scalar" : "int scalar";
    } else {
      std::stringstream ss;
      ss << v;
      d = ss.str();
    }
    out.emplace_back(a->name, d);
  }
  for (size_t i = 0; i < outs.size(); ++i) out.emplace_back("out" + std::to_string(i), tensor_desc(outs[i]));
  return out;
}

// Why an op signature missed the dispatch cache: the first call, or what changed since the last
// signature compiled for the same overload.
std::string compile_reason(const std::string& op, std::vector<std::pair<std::string, std::string>> sig) {
  static std::mutex mu;
  static auto* last = std::make_unique<std::unordered_map<std::string, std::vector<std::pair<std::string, std::string>>>>().release();
  std::lock_guard<std::mutex> lock(mu);
  auto it = last->find(op);
  std::string why;
  if (it == last->end()) {
    why = "first call of " + op + " (";
    for (size_t i = 0; i < sig.size(); ++i) why += (i ? ", " : "") + sig[i].first + "=" + sig[i].second;
    why += ")";
  } else {
    for (size_t i = 0; i < sig.size() && i < it->second.size(); ++i) {
      if (sig[i] == it->second[i]) continue;
      bool dtype_change = sig[i].second.substr(0, sig[i].second.find('[')) !=
                          it->second[i].second.substr(0, it->second[i].second.find('['));
      why += std::string(why.empty() ? "" : "; ") + (dtype_change ? "new dtype" : "new shape") + " for '" +
             sig[i].first + "': " + it->second[i].second + " -> " + sig[i].second;
    }
    if (why.empty()) why = "new signature (storage layout, buffer dims or aliasing changed)";
  }
  (*last)[op] = std::move(sig);
  return why;
}

}  // namespace

std::string compile_reason(const std::string& op, const std::vector<const NamedArg*>& args,
                           const std::vector<at::Tensor>& outs) {
  return compile_reason(op, describe_call(args, outs));
}

}  // namespace tpu::aten
