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

tpu::aten::GType gtype(const py::tuple& t) {
  tpu::aten::GType g;
  g.dtype = t[0].cast<int>();
  g.sizes = t[1].cast<std::vector<int64_t>>();
  if (t.size() > 2) g.strides = t[2].cast<std::vector<int64_t>>();
  return g;
}

// desc: {"name", "inputs": [(dtype, sizes)], "nodes": [(op, overload, args, out_ids, out_types)],
//        "outputs": [value id], "output_types": [(dtype, sizes, strides)], "mutations": [(input, id)]}
// args: [(name, kind, int, float, str, [ints])] with kind = tpu::aten::GArg::Kind as int.
tpu::aten::GraphDesc graph_desc(const py::dict& d) {
  tpu::aten::GraphDesc g;
  g.name = d["name"].cast<std::string>();
  for (auto t : d["inputs"].cast<py::list>()) g.inputs.push_back(gtype(t.cast<py::tuple>()));
  for (auto n : d["nodes"].cast<py::list>()) {
    auto nt = n.cast<py::tuple>();
    tpu::aten::GNode node;
    node.op = nt[0].cast<std::string>();
    node.overload = nt[1].cast<std::string>();
    for (auto a : nt[2].cast<py::list>()) {
      auto at = a.cast<py::tuple>();
      tpu::aten::GArg ga;
      ga.name = at[0].cast<std::string>();
      ga.kind = static_cast<tpu::aten::GArg::Kind>(at[1].cast<int>());
      ga.i = at[2].cast<int64_t>();
      ga.d = at[3].cast<double>();
      ga.s = at[4].cast<std::string>();
      ga.ints = at[5].cast<std::vector<int64_t>>();
      node.args.push_back(std::move(ga));
    }
    node.out_ids = nt[3].cast<std::vector<int64_t>>();
    for (auto t : nt[4].cast<py::list>()) node.out_types.push_back(gtype(t.cast<py::tuple>()));
    g.nodes.push_back(std::move(node));
  }
  g.outputs = d["outputs"].cast<std::vector<int64_t>>();
  for (auto t : d["output_types"].cast<py::list>()) g.output_types.push_back(gtype(t.cast<py::tuple>()));
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

PYBIND11_MODULE(_C, m) {
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
  m.def("_synchronize", [] {
    py::gil_scoped_release nogil;
    tpu::aten::fused_flush();
    tpu::runtime::Executor::get().synchronize();
    try {
      tpu::runtime::check_device_errors();
    } catch (const tpu::runtime::DeviceCheckError& e) {
      rethrow_check(e);
    }
  });
  m.def("_set_eager_mode", [](int mode) {
    tpu::aten::fused_flush();  // leaving or entering fused mode is a sync point
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
