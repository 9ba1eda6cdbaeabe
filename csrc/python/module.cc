// The only place Python meets C++: plain values in and out (no torch/extension.h, which costs
// ~70 s per build here). Tensors never cross this boundary; they flow through the dispatcher.
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <unordered_map>

#include "aten/allocator.h"
#include "aten/common.h"
#include "aten/plan_call.h"
#include "aten/cpu_fallback.h"
#include "aten/dispatch_cache.h"
#include "aten/generator.h"
#include "aten/graph.h"
#include "aten/hooks.h"
#include "lowering/jax_call.h"
#include "lowering/lowering.h"
#include "runtime/compile_cache.h"
#include "runtime/context.h"
#include "runtime/device_checks.h"
#include "runtime/executor.h"

namespace py = pybind11;


namespace {

using tpu::runtime::Context;

using tpu::aten::ArgKind;
using tpu::aten::GraphArg;
using tpu::aten::GraphNode;
using tpu::aten::TensorType;

// The graph description's value types, bound as classes with named fields: the Python describer
// builds them directly, so the schema is these structs (csrc/aten/graph.h) and nothing else.
// Picklable: warm start keeps descriptions in the AOTAutograd cache.
void bind_graph_schema(py::module_& m) {
  py::enum_<ArgKind>(m, "ArgKind")
      .value("NONE", ArgKind::None)
      .value("TENSOR", ArgKind::Tensor)
      .value("TENSOR_LIST", ArgKind::TensorList)
      .value("OPTIONAL_TENSOR_LIST", ArgKind::OptionalTensorList)
      .value("NUMBER_VALUE", ArgKind::NumberValue)
      .value("INT", ArgKind::Int)
      .value("INT_LIST", ArgKind::IntList)
      .value("DOUBLE", ArgKind::Double)
      .value("BOOL", ArgKind::Bool)
      .value("STRING", ArgKind::String)
      .value("DTYPE", ArgKind::DType)
      .value("FLOAT_SCALAR", ArgKind::FloatScalar)
      .value("INT_SCALAR", ArgKind::IntScalar)
      .value("BOOL_SCALAR", ArgKind::BoolScalar);
  py::class_<TensorType>(m, "TensorType")
      .def(py::init([](int dtype, std::vector<int64_t> sizes, std::vector<int64_t> strides) {
             return TensorType{dtype, std::move(sizes), std::move(strides)};
           }),
           py::arg("dtype"), py::arg("sizes"), py::arg("strides") = std::vector<int64_t>{})
      .def_readwrite("dtype", &TensorType::dtype)
      .def_readwrite("sizes", &TensorType::sizes)
      .def_readwrite("strides", &TensorType::strides)
      .def(py::pickle([](const TensorType& t) { return py::make_tuple(t.dtype, t.sizes, t.strides); },
                      [](const py::tuple& s) {
                        return TensorType{s[0].cast<int>(), s[1].cast<std::vector<int64_t>>(),
                                          s[2].cast<std::vector<int64_t>>()};
                      }));
  py::class_<GraphArg>(m, "GraphArg")
      .def(py::init([](std::string name, ArgKind kind, int64_t int_value, double double_value,
                       std::string string_value, std::vector<int64_t> ints, std::vector<int64_t> value_ids) {
             return GraphArg{std::move(name), kind, int_value, double_value, std::move(string_value),
                             std::move(ints), std::move(value_ids)};
           }),
           py::arg("name"), py::arg("kind"), py::arg("int_value") = 0, py::arg("double_value") = 0.0,
           py::arg("string_value") = "", py::arg("ints") = std::vector<int64_t>{},
           py::arg("value_ids") = std::vector<int64_t>{})
      .def_readwrite("name", &GraphArg::name)
      .def_readwrite("kind", &GraphArg::kind)
      .def_readwrite("int_value", &GraphArg::int_value)
      .def_readwrite("double_value", &GraphArg::double_value)
      .def_readwrite("string_value", &GraphArg::string_value)
      .def_readwrite("ints", &GraphArg::ints)
      .def_readwrite("value_ids", &GraphArg::value_ids)
      .def(py::pickle(
          [](const GraphArg& a) {
            return py::make_tuple(a.name, static_cast<int>(a.kind), a.int_value, a.double_value, a.string_value,
                                  a.ints, a.value_ids);
          },
          [](const py::tuple& s) {
            return GraphArg{s[0].cast<std::string>(), static_cast<ArgKind>(s[1].cast<int>()), s[2].cast<int64_t>(),
                            s[3].cast<double>(), s[4].cast<std::string>(), s[5].cast<std::vector<int64_t>>(),
                            s[6].cast<std::vector<int64_t>>()};
          }));
  py::class_<GraphNode>(m, "GraphNode")
      .def(py::init([](std::string op, std::string overload, std::vector<GraphArg> args, std::vector<int64_t> out_ids,
                       std::vector<TensorType> out_types) {
             return GraphNode{std::move(op), std::move(overload), std::move(args), std::move(out_ids),
                              std::move(out_types)};
           }),
           py::arg("op"), py::arg("overload"), py::arg("args"), py::arg("out_ids"), py::arg("out_types"))
      .def_readwrite("op", &GraphNode::op)
      .def_readwrite("overload", &GraphNode::overload)
      .def_readwrite("args", &GraphNode::args)
      .def_readwrite("out_ids", &GraphNode::out_ids)
      .def_readwrite("out_types", &GraphNode::out_types)
      .def(py::pickle(
          [](const GraphNode& n) { return py::make_tuple(n.op, n.overload, n.args, n.out_ids, n.out_types); },
          [](const py::tuple& s) {
            return GraphNode{s[0].cast<std::string>(), s[1].cast<std::string>(), s[2].cast<std::vector<GraphArg>>(),
                             s[3].cast<std::vector<int64_t>>(), s[4].cast<std::vector<TensorType>>()};
          }));
}

// desc: {"name", "inputs": [TensorType], "nodes": [GraphNode], "outputs": [value id],
//        "output_types": [TensorType with strides], "mutations": [(input, id)], "rng": [(input, counters)],
//        optional "compile_options", "plain_outputs", "precision"}: the fields of GraphDesc.
tpu::aten::GraphDesc graph_desc(const py::dict& d) {
  tpu::aten::GraphDesc g;
  g.name = d["name"].cast<std::string>();
  g.inputs = d["inputs"].cast<std::vector<TensorType>>();
  g.nodes = d["nodes"].cast<std::vector<GraphNode>>();
  g.outputs = d["outputs"].cast<std::vector<int64_t>>();
  g.output_types = d["output_types"].cast<std::vector<TensorType>>();
  g.mutations = d["mutations"].cast<std::vector<std::pair<int64_t, int64_t>>>();
  if (d.contains("rng")) g.rng = d["rng"].cast<std::vector<std::pair<int64_t, int64_t>>>();
  if (d.contains("compile_options")) g.compile_options = d["compile_options"].cast<std::string>();
  if (d.contains("plain_outputs")) g.plain_outputs = d["plain_outputs"].cast<bool>();
  if (d.contains("precision")) g.precision = d["precision"].cast<int>();
  return g;
}

tpu::aten::TpuGenerator* gen(int device) {
  return tpu::aten::default_generator(static_cast<c10::DeviceIndex>(device)).get<tpu::aten::TpuGenerator>();
}

}  // namespace

namespace {
// Launch sites of device-checked ops: the innermost Python frame outside torch / torch_tpu,
// kept as (code object, instruction offset) and formatted as "file.py:12" only when a check
// fails. Code objects met here are interned (one strong reference each) with whether they are
// internal, so a capture is a short frame walk with one hash lookup per frame. Called only for
// checked ops; takes the GIL (ops run with it released).
std::unordered_map<PyCodeObject*, bool>& site_codes() {  // under the GIL
  static auto* m = std::make_unique<std::unordered_map<PyCodeObject*, bool>>().release();
  return *m;
}
constexpr size_t kMaxSiteCodes = 1 << 16;

std::string code_file(PyCodeObject* code) {
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  if (!file) PyErr_Clear();
  return file ? file : "";
}

tpu::runtime::LaunchSite capture_python_site() {
  if (!Py_IsInitialized()) return {};
  PyGILState_STATE g = PyGILState_Ensure();
  tpu::runtime::LaunchSite site;
  auto& codes = site_codes();
  PyFrameObject* f = PyThreadState_GetFrame(PyThreadState_Get());  // new reference
  for (int depth = 0; f && depth < 64; ++depth) {
    PyCodeObject* code = PyFrame_GetCode(f);  // new reference
    auto it = codes.find(code);
    bool internal;
    if (it != codes.end()) {
      internal = it->second;
    } else {
      std::string fs = code_file(code);
      internal = fs.empty() || fs.find("/torch/") != std::string::npos ||
                 fs.find("/torch_tpu/") != std::string::npos || fs.find("<frozen") != std::string::npos;
      if (codes.size() < kMaxSiteCodes) {
        Py_INCREF(code);  // interned: `site.code` stays valid
        it = codes.emplace(code, internal).first;
      }
    }
    if (!internal) {
      if (it != codes.end()) {
        site.code = code;
#if PY_VERSION_HEX >= 0x030B0000
        site.lasti = PyFrame_GetLasti(f);
#else
        site.line = PyFrame_GetLineNumber(f);
#endif
      }
      Py_DECREF(code);
      break;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  if (PyErr_Occurred()) PyErr_Clear();
  PyGILState_Release(g);
  return site;
}

std::string format_python_site(const tpu::runtime::LaunchSite& s) {
  if (!Py_IsInitialized() || !s.code) return {};
  PyGILState_STATE g = PyGILState_Ensure();
  auto* code = static_cast<PyCodeObject*>(const_cast<void*>(s.code));
  int line = s.lasti >= 0 ? PyCode_Addr2Line(code, s.lasti) : s.line;
  std::string out = code_file(code) + ":" + std::to_string(line);
  if (PyErr_Occurred()) PyErr_Clear();
  PyGILState_Release(g);
  return out;
}

[[noreturn]] void rethrow_check(const tpu::runtime::DeviceCheckError& e) {
  if (e.kind == 1) throw py::index_error(e.what());
  throw std::runtime_error(e.what());
}
}  // namespace

// What eager dispatch decided, for compiled graphs and tests: the RNG rule, dispatch cache hits.
void bind_dispatch_queries(py::module_& m) {
  // Philox counters a compiled call consumes, by the rule eager follows (lowering::rng_counters);
  // None when the op has no lowering.
  m.def("_rng_counters", [](const std::string& op, const std::unordered_map<std::string, double>& constants,
                            int64_t largest_numel) -> std::optional<int64_t> {
    const tpu::lowering::OpEntry* entry = tpu::lowering::find_op(op);
    if (!entry) return std::nullopt;
    return tpu::lowering::rng_counters(*entry, [&](const std::string& name) -> std::optional<double> {
      auto it = constants.find(name);
      return it == constants.end() ? std::nullopt : std::optional<double>(it->second);
    }, largest_numel);
  });
  m.def("_set_dispatch_cache_enabled", &tpu::aten::set_dispatch_cache_enabled);
  m.def("_dispatch_cache_stats", [] {
    auto s = tpu::aten::dispatch_cache_stats();
    return std::unordered_map<std::string, int64_t>{{"hits", s.hits}, {"remembered", s.remembered}, {"entries", s.entries}};
  });
}

PYBIND11_MODULE(_C, m) {
  bind_graph_schema(m);
  bind_dispatch_queries(m);
  tpu::runtime::set_site_provider({&capture_python_site, &format_python_site});
  m.def("_set_device_checks", [](bool on) { tpu::runtime::set_device_checks(on); });
  m.def("_device_checks", [] { return tpu::runtime::device_checks(); });
  m.def("_device_check_stats", [] {
    auto s = tpu::runtime::device_check_stats();
    py::dict d;
    d["checked_launches"] = s.checked_launches;
    d["status_reads"] = s.status_reads;
    return d;
  });
  m.def("_check_device_errors", [] {
    py::gil_scoped_release nogil;
    try {
      tpu::runtime::check_device_errors();
    } catch (const tpu::runtime::DeviceCheckError& e) {
      rethrow_check(e);
    }
  });
  m.doc() = "torch_tpu native runtime";
  m.def("_register", &tpu::aten::register_hooks);
  m.def("_configure", [](const std::string& path, int64_t n) { Context::get().configure(path, n); });
  m.def("_initialized", [] { return Context::get().initialized(); });
  m.def("_init", [] { Context::get().client(); });
  m.def("_device_count", [] { return Context::get().device_count(); });
  m.def("_platform", [] {
    auto& c = Context::get().client();
    py::dict d;
    d["platform_name"] = c.platform_name();
    d["platform_version"] = c.platform_version();
    d["pjrt_api_version"] = c.api().version_string();
    d["plugin_path"] = Context::get().plugin_path();
    return d;
  });
  m.def("_device_info", [](int i) {
    auto& devs = Context::get().client().devices();
    if (i < 0 || i >= static_cast<int>(devs.size())) throw py::index_error("tpu device index out of range");
    py::dict d;
    d["id"] = devs[i].id;
    d["kind"] = devs[i].kind;
    d["debug_string"] = devs[i].debug_string;
    return d;
  });
  m.def("_fused_flush", [] { tpu::aten::fused_flush(); });
  // Pending fused programs launched so far, by reason (runtime/executor.h FlushReason).
  m.def("_fused_flush_stats", [] {
    py::dict d;
    auto counts = tpu::runtime::fused_flush_counts();
    for (size_t i = 0; i < counts.size(); ++i)
      d[tpu::runtime::flush_reason_name(static_cast<tpu::runtime::FlushReason>(i))] = counts[i];
    return d;
  });
  m.def("_set_fused_program_options", [](const py::bytes& options) {
    tpu::runtime::set_fused_program_options(options);
  }, py::arg("options"));
  m.def("_synchronize", [] {
    py::gil_scoped_release nogil;
    tpu::aten::fused_flush(tpu::runtime::FlushReason::Synchronize);
    tpu::runtime::Executor::get().synchronize();
    try {
      tpu::runtime::check_device_errors();
    } catch (const tpu::runtime::DeviceCheckError& e) {
      rethrow_check(e);
    }
  });
  m.def("_set_eager_mode", [](int mode) {
    tpu::aten::fused_flush(tpu::runtime::FlushReason::Synchronize);  // leaving/entering fused mode
    Context::get().set_mode(static_cast<tpu::runtime::EagerMode>(mode));
  });
  m.def("_get_eager_mode", [] { return static_cast<int>(Context::get().mode()); });
  m.def("_cache_stats", [] {
    auto s = tpu::runtime::CompileCache::get().stats();
    py::dict d;
    d["op_hits"] = s.op_hits;
    d["memory_hits"] = s.memory_hits;
    d["disk_hits"] = s.disk_hits;
    d["misses"] = s.misses;
    d["compile_ms"] = s.compile_ms;
    d["disk_load_ms"] = s.disk_load_ms;
    d["disk_errors"] = s.disk_errors;
    d["evictions"] = s.evictions;
    d["programs"] = s.programs;
    d["program_bytes"] = s.program_bytes;
    d["max_programs"] = s.max_programs;
    d["max_bytes"] = s.max_bytes;
    d["cache_dir"] = tpu::runtime::CompileCache::get().cache_dir();
    return d;
  });
  m.def("_raw_launch_floor_us", [](int iters) {
    py::gil_scoped_release nogil;
    return tpu::runtime::raw_launch_floor_us(iters);
  });
  m.def("_set_cache_limits", [](int64_t max_programs, int64_t max_bytes) {
    tpu::runtime::CompileCache::get().set_limits(max_programs, max_bytes);
  });
  m.def("_reset_cache_stats", [] { tpu::runtime::CompileCache::get().reset_stats(); });
  m.def("_compile_events", [] {
    py::list out;
    for (const auto& e : tpu::runtime::CompileCache::get().events())
      out.append(py::make_tuple(e.op, e.reason, e.source, e.ms));
    return out;
  });
  m.def("_fallback_stats", [] { return tpu::aten::fallback_stats(); });
  m.def("_fallback_reasons", [] { return tpu::aten::fallback_why(); });
  m.def("_reset_fallback_stats", [] { tpu::aten::reset_fallback_stats(); });
  m.def("_dispatch_stats", [] {
    auto& s = tpu::aten::dispatch_stats();
    py::dict d;
    d["ops"] = s.ops;
    d["host_syncs"] = s.host_syncs;
    d["launches"] = tpu::runtime::Executor::get().launches();
    return d;
  });
  // Compiles raw StableHLO text through the cache (tests and custom-kernel plumbing).
  m.def("_compile_mlir", [](const std::string& text, const std::string& what, const py::bytes& options) {
    tpu::runtime::CompileCache::get().get_or_compile(text, what, "explicit", options);
  }, py::arg("text"), py::arg("what"), py::arg("options") = py::bytes());
  // Foreign (JAX-exported) modules for the jax_call lowering: types are (mlir element name, shape).
  m.def("_jax_register", [](const std::string& key, const std::string& op, const std::string& text,
                            const std::string& callee,
                            const std::vector<std::pair<std::string, std::vector<int64_t>>>& in_types,
                            const std::vector<std::pair<std::string, std::vector<int64_t>>>& out_types) {
    tpu::lowering::ForeignModule fm{key, op, text, callee, {}, {}};
    for (const auto& [e, s] : in_types) fm.in_types.push_back({tpu::lowering::elem_from_mlir_name(e), s});
    for (const auto& [e, s] : out_types) fm.out_types.push_back({tpu::lowering::elem_from_mlir_name(e), s});
    tpu::lowering::register_foreign_module(std::move(fm));
  });
  m.def("_jax_registered", [](const std::string& key) { return tpu::lowering::has_foreign_module(key); });
  m.def("_graph_build", [](const py::dict& d) { return tpu::aten::build_graph(graph_desc(d)); });
  m.def("_matmul_precision", [] { return static_cast<int>(tpu::aten::matmul_precision()); });
  m.def("_set_precision_override", &tpu::aten::set_precision_override);
  m.def("_precision_override", &tpu::aten::precision_override);
  m.def("_graph_text", [](const py::dict& d) { return tpu::aten::graph_text(graph_desc(d)); });
  m.def("_graph_unsupported", [](const py::dict& d) { return tpu::aten::unsupported_ops(graph_desc(d)); });
  m.def("_lowered_ops", [] { return tpu::lowering::registered_ops(); });
  m.def("_mem_get_info", [](int device) {
    return tpu::aten::TpuAllocator::get().getMemoryInfo(static_cast<c10::DeviceIndex>(device));
  });
  m.def("_manual_seed", [](int device, uint64_t seed) {
    auto g = tpu::aten::default_generator(static_cast<c10::DeviceIndex>(device));
    std::lock_guard<std::mutex> lock(g.mutex());
    gen(device)->set_current_seed(seed);
  });
  m.def("_seed", [](int device) {
    auto g = tpu::aten::default_generator(static_cast<c10::DeviceIndex>(device));
    std::lock_guard<std::mutex> lock(g.mutex());
    return gen(device)->seed();
  });
  m.def("_initial_seed", [](int device) { return gen(device)->current_seed(); });
  m.def("_get_rng_state", [](int device) {
    auto* g = gen(device);
    uint64_t s = g->current_seed(), o = g->get_offset();
    std::string bytes(16, '\0');
    std::memcpy(bytes.data(), &s, 8);
    std::memcpy(bytes.data() + 8, &o, 8);
    return py::bytes(bytes);
  });
  m.def("_set_rng_state", [](int device, const std::string& bytes) {
    if (bytes.size() != 16) throw py::value_error("tpu RNG state must be 16 bytes (seed, offset)");
    uint64_t s, o;
    std::memcpy(&s, bytes.data(), 8);
    std::memcpy(&o, bytes.data() + 8, 8);
    auto* g = gen(device);
    g->set_current_seed(s);
    g->set_offset(o);
  });
}
