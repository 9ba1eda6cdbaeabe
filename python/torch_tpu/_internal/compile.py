"""`torch.compile(backend="tpu")`: AOTAutograd graphs -> one StableHLO program each.

Each FX graph (forward, and backward when training) is described with plain values and lowered
in C++ through the same lowering table eager uses, compiled once (memory + disk cache), and run
by the `torch_tpu::run_graph` op. Input mutations (aot's trailing `copy_`) are written back
through the storage write path with donation. Random ops read the device generator's state
from extra inputs that run_graph fills per run (advanced as eager advances it).

AOTAutograd decomposes only ops WITHOUT a lowering (`decompositions()`), so a compiled graph runs
the same lowerings as eager. A graph with nodes no program can hold (no lowering, or a lowering
that refuses the arguments) is split: the rest runs as compiled pieces, those nodes in eager.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from torch_tpu import _C
from torch_tpu._internal import compile_meta, graph_passes, xla_options

_DTYPE_INDEX = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15, torch.uint16: 27,
    torch.uint32: 28, torch.uint64: 29, torch.complex64: 9, torch.complex128: 10,
}

# The graph description's value types are defined once, in C++ (csrc/aten/graph.h), and bound.
ArgKind = _C.ArgKind
GraphArg = _C.GraphArg
GraphNode = _C.GraphNode
TensorType = _C.TensorType


class Unsupported(Exception):
    """A graph (or one node of it, `node`) that cannot become part of a program."""

    def __init__(self, msg: str, node: torch.fx.Node | None = None) -> None:
        super().__init__(msg)
        self.node = node


def _dtype(d: torch.dtype) -> int:
    if d not in _DTYPE_INDEX:
        raise Unsupported(f"dtype {d}")
    return _DTYPE_INDEX[d]


def _tensor_type(v: Any, with_strides: bool = False) -> TensorType:
    if not isinstance(v, torch.Tensor):
        raise Unsupported(f"non-tensor value {type(v).__name__}")
    strides = [int(s) for s in v.stride()] if with_strides else []
    return TensorType(_dtype(v.dtype), [int(s) for s in v.shape], strides)


def _is_number_type(arg: torch._C.Argument) -> bool:
    t = arg.type
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.NumberType)


_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _rng_counters(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any],
                  largest_numel: int = 1) -> int | None:
    """Philox counters a call consumes, by the one rule eager follows (lowering::rng_counters in
    C++: 0 when it draws nothing, e.g. attention with dropout_p == 0); None without a lowering."""
    constants = {a.name: float(v) for a, v in _bind(op, args, kwargs) if isinstance(v, (int, float, bool))}
    base = op._schema.name.partition("::")[2]
    if base.endswith("_") and not base.startswith("__"):
        base = base[:-1]  # in-place and functional variants share one lowering
    return _C._rng_counters(base, constants, largest_numel)


def _draws_random(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call of an op tagged random consumes random numbers (ops without a lowering:
    as their tag says)."""
    counters = _rng_counters(op, args, kwargs)
    return counters is None or counters > 0


def _largest_numel(n: torch.fx.Node) -> int:
    """The largest element count among a node's outputs and tensor inputs."""
    numel = 1
    vals: list[Any] = [n.meta.get("val")]
    vals += [a.meta.get("val") for a in n.all_input_nodes]
    while vals:
        v = vals.pop()
        if isinstance(v, (list, tuple)):
            vals.extend(v)
        elif isinstance(v, torch.Tensor):
            numel = max(numel, int(v.numel()))
    return numel


def _bind(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[torch._C.Argument, Any]]:
    out = []
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out.append((a, args[i]))
        elif a.name in kwargs:
            out.append((a, kwargs[a.name]))
        elif a.has_default_value():
            out.append((a, a.default_value))
        else:
            out.append((a, None))
    return out


def _jax_op_of(op: torch._ops.OpOverload) -> Any:
    """The jax_op behind a custom op, if torch_tpu.pallas registered it (never imports JAX)."""
    mod = sys.modules.get("torch_tpu.pallas._jax_op")
    return None if mod is None else mod.REGISTRY.get(op._schema.name)


class _Describer:
    def __init__(self, gm: torch.fx.GraphModule, name: str) -> None:
        self.gm = gm
        self.name = name
        self.ids: dict[torch.fx.Node, Any] = {}
        self.next_id = 0
        self.placeholders: list[torch.fx.Node] = []
        self.constants: list[torch.Tensor] = []
        self.sym: dict[torch.fx.Node, Any] = {}  # size arithmetic, specialized to its value
        self.rng: dict[torch.fx.Node, int] = {}  # random op -> its generator-state input
        self.node_of: list[torch.fx.Node] = []  # FX node of each program node (error reports)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def ref(self, v: Any) -> int:
        if not isinstance(v, torch.fx.Node) or not isinstance(self.ids.get(v), int):
            raise Unsupported(f"argument {v!r} is not a tensor value")
        return self.ids[v]

    def _concrete(self, v: Any) -> Any:
        """Replaces size-arithmetic nodes (and SymInts) by their values: the program is compiled
        for these concrete shapes (Dynamo guards on them, so a new shape compiles a new program)."""
        if isinstance(v, torch.fx.Node) and v in self.sym:
            return self.sym[v]
        if isinstance(v, (list, tuple)):
            return type(v)(self._concrete(e) for e in v)
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(v)](v)
        return v

    def arg(self, schema_arg: torch._C.Argument, v: Any) -> GraphArg:
        name = schema_arg.name
        v = self._concrete(v)
        number = _is_number_type(schema_arg)
        if isinstance(v, torch.fx.Node):
            return GraphArg(name, ArgKind.NUMBER_VALUE if number else ArgKind.TENSOR, value_ids=[self.ref(v)])
        if isinstance(v, (list, tuple)) and any(isinstance(e, torch.fx.Node) for e in v) or (
            isinstance(v, (list, tuple)) and "Tensor" in str(schema_arg.type)
        ):
            opt = "Optional[Tensor]" in str(schema_arg.type) or "Tensor?" in str(schema_arg.type)
            return GraphArg(name, ArgKind.OPTIONAL_TENSOR_LIST if opt else ArgKind.TENSOR_LIST,
                            value_ids=[-1 if e is None else self.ref(e) for e in v])
        if v is None or isinstance(v, (torch.device, torch.layout, torch.memory_format)):
            return GraphArg(name, ArgKind.NONE)
        if isinstance(v, bool):
            return GraphArg(name, ArgKind.BOOL_SCALAR if number else ArgKind.BOOL, int_value=int(v))
        if isinstance(v, int):
            return GraphArg(name, ArgKind.INT_SCALAR if number else ArgKind.INT, int_value=v)
        if isinstance(v, float):
            return GraphArg(name, ArgKind.FLOAT_SCALAR if number else ArgKind.DOUBLE, double_value=v)
        if isinstance(v, torch.dtype):
            return GraphArg(name, ArgKind.DTYPE, int_value=_dtype(v))
        if isinstance(v, str):
            return GraphArg(name, ArgKind.STRING, string_value=v)
        if isinstance(v, (list, tuple)) and all(isinstance(e, (int, bool)) for e in v):
            return GraphArg(name, ArgKind.INT_LIST, ints=[int(e) for e in v])
        raise Unsupported(f"argument {name}={v!r}")

    def jax_node(self, n: torch.fx.Node, op: torch._ops.OpOverload, jop: Any) -> GraphNode:
        """A jax_op call: the same registered module eager runs, spliced into this program."""
        bound = _bind(op, n.args, n.kwargs)
        refs, metas, statics = [], [], []
        for p, (_a, v) in zip(jop.params, bound, strict=True):
            if p.tensor:
                val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
                if not isinstance(val, torch.Tensor):
                    raise Unsupported(f"{op}: argument {p.name} is not a tensor value")
                refs.append(self.ref(v))
                metas.append((val.dtype, tuple(int(s) for s in val.shape)))
            else:
                c = self._concrete(v)
                statics.append((p.name, tuple(c) if isinstance(c, list) else c))
        kernel = jop.kernel(metas, tuple(statics))
        val = n.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        out_ids = [self.new_id() for _ in vals]
        self.ids[n] = out_ids if isinstance(val, (list, tuple)) else out_ids[0]
        args = [GraphArg("args", ArgKind.TENSOR_LIST, value_ids=refs),
                GraphArg("kernel", ArgKind.STRING, string_value=kernel.key)]
        return GraphNode("jax_call", "", args, out_ids, [_tensor_type(v) for v in vals])

    def describe(self) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
        inputs = []
        nodes = []
        mutations = []
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor):
                    inputs.append(_tensor_type(v))
                elif isinstance(v, (float, torch.SymFloat)):
                    inputs.append(TensorType(_dtype(torch.float64), []))
                elif isinstance(v, (bool, int, torch.SymInt, torch.SymBool)):
                    inputs.append(TensorType(_dtype(torch.int64), []))
                    self.sym[n] = self._concrete(v)  # sizes: specialized (floats stay operands)
                else:
                    raise Unsupported(f"graph input of type {type(v).__name__}")
                self.ids[n] = self.new_id()
                self.placeholders.append(n)
        # Tensor constants (get_attr) become extra program inputs after the placeholders.
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                t = getattr(self.gm, n.target)
                if isinstance(t, FakeTensor):  # made while tracing: its value, if fake mode kept it
                    t = t.constant
                if not isinstance(t, torch.Tensor):
                    raise Unsupported(f"graph attribute {n.target} is not a tensor with a value")
                inputs.append(_tensor_type(t))
                self.ids[n] = self.new_id()
                self.constants.append(t)
        # Random ops read the device generator's state (u64[2]) from inputs after those, which
        # run_graph fills at each run, advancing the generator by what eager would consume.
        rng = []
        for n in self.gm.graph.nodes:
            if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
                continue
            counters = _rng_counters(n.target, n.args, n.kwargs, _largest_numel(n))
            if counters:
                self.rng[n] = self.new_id()
                inputs.append(TensorType(_dtype(torch.uint64), [2]))
                rng.append((self.rng[n], counters))
        for n in self.gm.graph.nodes:
            if n.op != "call_function":
                continue
            try:
                self._node(n, nodes, mutations)
            except Unsupported as e:
                e.node = e.node or n
                raise
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
        outputs, output_types, spec = [], [], []
        for o in outs:
            if isinstance(o, torch.fx.Node) and o in self.placeholders:
                spec.append(("input", self.placeholders.index(o)))
            elif isinstance(o, torch.fx.Node) and o in self.sym:
                spec.append(("const", self.sym[o]))  # a size (specialized), e.g. saved for backward
            elif isinstance(o, torch.fx.Node):
                v = o.meta.get("val")
                if not isinstance(v, torch.Tensor):
                    raise Unsupported(f"non-tensor graph output {v!r}")
                spec.append(("out", len(outputs)))
                outputs.append(self.ref(o))
                output_types.append(_tensor_type(v, with_strides=True))
            else:
                spec.append(("const", o))
        desc = {"name": self.name, "inputs": inputs, "nodes": nodes, "outputs": outputs,
                "output_types": output_types, "mutations": mutations, "rng": rng}
        return desc, spec, self.constants

    def _node(self, n: torch.fx.Node, nodes: list[GraphNode], mutations: list[tuple[int, int]]) -> None:
        val = n.meta.get("val")
        if isinstance(val, _NUMBERS):
            # sym_size, operator.mul on sizes, ..., and int returns of ops (SDPA's max_q)
            self.sym[n] = self._concrete(val)
            return
        if n.target is operator.getitem and n.args[0] not in self.sym:
            self.ids[n] = self.ids[n.args[0]][n.args[1]]
            return
        op = n.target
        if not isinstance(op, torch._ops.OpOverload):
            raise Unsupported(f"call to {op}")
        if op is torch.ops.aten.copy_.default and n.args[0] in self.placeholders:
            mutations.append((self.placeholders.index(n.args[0]), self.ref(n.args[1])))
            self.ids[n] = self.ref(n.args[1])
            return
        if op is torch.ops.prims.convert_element_type.default:
            # A dtype conversion: the runtime converts every lowering result to its out dtype.
            out_id = self.new_id()
            self.ids[n] = out_id
            self.node_of.append(n)
            nodes.append(GraphNode("_to_copy", "", [GraphArg("self", ArgKind.TENSOR, value_ids=[self.ref(n.args[0])])],
                                   [out_id], [_tensor_type(n.meta["val"])]))
            return
        jop = _jax_op_of(op)
        if jop is not None:
            self.node_of.append(n)
            nodes.append(self.jax_node(n, op, jop))
            return
        ns, _, base = op._schema.name.partition("::")
        if ns not in ("aten", "torch_tpu"):  # torch_tpu:: ops (ragged_dot) are lowered too
            raise Unsupported(f"non-aten op {op}")
        if base.endswith("_") and not base.startswith("__"):
            raise Unsupported(f"in-place op {op} in a functional graph")
        bound = _bind(op, n.args, n.kwargs)
        if n in self.rng:
            if any(a.name == "generator" and v is not None for a, v in bound):
                raise Unsupported(f"random op {op} with an explicit generator")
            bound = [(a, v) for a, v in bound if a.name != "generator"]
        args = [self.arg(a, v) for a, v in bound]
        if n in self.rng:
            args.append(GraphArg("generator", ArgKind.TENSOR, value_ids=[self.rng[n]]))
        val = n.meta.get("val")
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        out_ids, out_types = [], []
        nested: list[Any] = []  # ids as the value nests them (functional _fused_adamw: lists of lists)
        for v in vals:
            if isinstance(v, _NUMBERS):
                # An int/SymInt return (SDPA's max_q/max_k): lowerings return tensors only
                # (as in eager); uses read the value from the meta (getitem above).
                nested.append(None)
                continue
            group = list(v) if isinstance(v, (list, tuple)) else [v]
            ids = []
            for e in group:
                ids.append(self.new_id() if isinstance(e, torch.Tensor) else -1)
                out_types.append(_tensor_type(e) if isinstance(e, torch.Tensor) else TensorType(-1, []))
            out_ids.extend(ids)
            nested.append(ids if isinstance(v, (list, tuple)) else ids[0])
        self.ids[n] = out_ids[0] if not isinstance(val, (list, tuple)) else nested
        self.node_of.append(n)
        nodes.append(GraphNode(base, op._overloadname if op._overloadname != "default" else "", args, out_ids, out_types))


_graph_counter = [0]

# What the backend did with each FX graph it was given (tests and compile_stats() read these).
STATS = {"graphs": 0, "programs": 0, "partitioned_graphs": 0, "eager_nodes": 0, "eager_graphs": 0,
         "aot_cache_hits": 0, "ungrouped_kv": 0, "cache_writes_at_offset": 0}
# One entry per program built: {"graph", "aot": "traced" | "aot_cache" | "reused" (another
# precision's program of a graph already here), "xla": "xla_compiled" | "xla_disk" |
# "xla_memory"}: which tier of each cache served it.
GRAPH_TIERS: list[dict[str, str]] = []
_AOT_TIER = ["traced"]  # "aot_cache" while a cached AOTAutograd entry rebuilds its programs

_NODE_ERROR = re.compile(r"graph node (\d+) unsupported")


def _build(desc: dict[str, Any]) -> int:
    """Builds a described graph (XLA compile, or the runtime's memory/disk cache) and records
    which tier of each cache served it in GRAPH_TIERS."""
    before = _C._cache_stats()
    gid = _C._graph_build(desc)
    after = _C._cache_stats()
    tier = next((t for t, k in (("xla_disk", "disk_hits"), ("xla_compiled", "misses"))
                 if after[k] > before[k]), "xla_memory")
    GRAPH_TIERS.append({"graph": desc["name"], "aot": _AOT_TIER[0], "xla": tier})
    STATS["programs"] += 1
    return gid


def _tpu_device(example_inputs: Sequence[Any]) -> torch.device:
    return next((a.device for a in example_inputs if isinstance(a, torch.Tensor) and a.device.type == "tpu"),
                torch.device("tpu"))


class _Program:
    """One FX graph built as one program: call(args) -> outputs in the graph's output order."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], xla: bytes = b"",
                 name: str | None = None) -> None:
        _graph_counter[0] += 1
        describer = _Describer(gm, name or f"graph{_graph_counter[0]}")
        desc, self.spec, constants = describer.describe()
        desc["compile_options"] = xla
        desc["precision"] = _C._matmul_precision()
        for i, node in enumerate(desc["nodes"]):
            if not _has_lowering(node.op):
                raise Unsupported(f"no lowering for aten::{node.op}", describer.node_of[i])
        try:
            self.gid = _build(desc)
        except RuntimeError as e:
            m = _NODE_ERROR.search(str(e))
            if m is None:
                raise
            raise Unsupported(str(e), describer.node_of[int(m.group(1))]) from None
        # What a warm start needs to rebuild this program in another process (TpuOutputCode).
        self.desc, self.cpu_consts = desc, constants
        self.consts = _on_device(constants, _tpu_device(example_inputs))
        self.gids = {desc["precision"]: self.gid}

    @classmethod
    def rebuild(cls, desc: dict[str, Any], spec: list, constants: list[torch.Tensor],
                device: torch.device) -> _Program:
        """The program a cached description stands for (its XLA executable comes from the
        runtime's compile cache when TORCH_TPU_CACHE_DIR holds it)."""
        self = cls.__new__(cls)
        desc = {**desc, "precision": _C._matmul_precision()}
        self.gid = _build(desc)
        self.gids = {desc["precision"]: self.gid}
        self.spec, self.desc, self.cpu_consts = spec, desc, constants
        self.consts = _on_device(constants, device)
        return self

    def _program_for(self, precision: int) -> int:
        """The program for another contraction precision (torch.tpu.precision changed since the
        build): built on first use, then kept."""
        if precision not in self.gids:
            _AOT_TIER[0] = "reused"  # the same traced graph, built for another precision
            try:
                self.gids[precision] = _build({**self.desc, "precision": precision})
            finally:
                _AOT_TIER[0] = "traced"
        return self.gids[precision]

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        precision = _C._matmul_precision()
        gid = self.gid if precision == self.desc["precision"] else self._program_for(precision)
        tensors = [a if isinstance(a, torch.Tensor) else torch.tensor(
            a, dtype=torch.float64 if isinstance(a, float) else torch.int64) for a in args]
        tensors.extend(self.consts)
        outs = torch.ops.torch_tpu.run_graph(gid, tensors)
        result = []
        for kind, v in self.spec:
            if kind == "out":
                result.append(outs[v])
            elif kind == "input":
                result.append(args[v])
            else:
                result.append(v)
        return result


def _on_device(constants: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Real device copies of a graph's constants. Dynamo calls the backend with its fake mode
    active, where a copy would be a FakeTensor that the first real run rejects."""
    with unset_fake_temporarily():
        return [c.to(device) for c in constants]


class _Piece(torch.nn.Module):
    """A compiled partition inside a split graph (called like the submodule it replaces)."""

    def __init__(self, program: _Program, single: bool) -> None:
        super().__init__()
        self.program = program
        self.single = single

    def forward(self, *args: Any) -> Any:
        out = self.program(args)
        return out[0] if self.single else tuple(out)


def _lowered_names() -> frozenset[str]:
    if not _LOWERED:
        _LOWERED.append(frozenset(_C._lowered_ops()))
    return _LOWERED[0]


_LOWERED: list[frozenset[str]] = []


def _has_lowering(base: str) -> bool:
    return base in _lowered_names()


def _on_host(v: Any) -> bool:
    """A CPU tensor with elements (0-d CPU tensors are host scalars that programs take as operands)."""
    if isinstance(v, (list, tuple)):
        return any(_on_host(x) for x in v)
    return isinstance(v, torch.Tensor) and v.device.type != "tpu" and v.dim() > 0


def _touches_host(n: torch.fx.Node) -> bool:
    """A node computing on, producing or moving CPU tensors (`b_cpu.to(a.device)`, `x.cpu()`):
    it runs in eager between the compiled pieces, as the graph asked, on the CPU."""
    return _on_host(n.meta.get("val")) or any(_on_host(a.meta.get("val")) for a in n.all_input_nodes)


def _node_supported(n: torch.fx.Node, bad: set[str]) -> bool:
    """Whether a node can go into a compiled piece (a static guess; lowerings that refuse an
    argument combination are found when building and added to `bad`)."""
    if n.op != "call_function" or n.name in bad or _touches_host(n):
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, torch.fx.Node) and _node_supported(src, bad)
    if isinstance(n.meta.get("val"), _NUMBERS):
        return True  # size arithmetic
    op = n.target
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if op is torch.ops.prims.convert_element_type.default:
        return True
    if op is torch.ops.aten.copy_.default:
        return isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"
    name = op._schema.name
    if not name.startswith("aten::"):
        return False
    base = name[len("aten::"):]
    return _has_lowering(base) and not (base.endswith("_") and not base.startswith("__"))


def _split(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], first: Unsupported, xla: bytes) -> Callable:
    """Runs `gm` as compiled pieces around the nodes no program can hold (those run op by op in
    eager, between the pieces)."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    bad: set[str] = {first.node.name} if first.node is not None else set()
    reasons = {first.node.name: str(first)} if first.node is not None else {}

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
            return _node_supported(node, bad)

    for _ in range(len(gm.graph.nodes) + 1):
        graph = torch.fx.Graph()
        out = graph.graph_copy(gm.graph, {})
        graph.output(out)
        split = torch.fx.GraphModule(gm, graph)
        split = CapabilityBasedPartitioner(split, Support(), allows_single_node_partition=True).partition_and_fuse()
        try:
            for n in list(split.graph.nodes):
                if n.op != "call_module":
                    continue
                sub = getattr(split, n.target)
                out_node = next(o for o in sub.graph.nodes if o.op == "output")
                args = [a.meta.get("val") for a in n.args]
                program = _Program(sub, args, xla)
                setattr(split, n.target, _Piece(program, not isinstance(out_node.args[0], (list, tuple))))
        except Unsupported as e:
            if e.node is None or e.node.name in bad:
                raise
            bad.add(e.node.name)
            reasons[e.node.name] = str(e)
            continue
        eager = [n for n in split.graph.nodes if n.op == "call_function" and not (
            n.target is operator.getitem and n.args[0].op == "call_module")]
        STATS["partitioned_graphs"] += 1
        STATS["eager_nodes"] += len(eager)
        surprising = [n for n in eager if not _touches_host(n)]  # CPU work the graph asked for is not
        if surprising:
            names = sorted({str(n.target) for n in surprising})
            warnings.warn(f"torch_tpu: compiled graph runs as compiled pieces around {len(surprising)} eager "
                          "op(s): " + ", ".join(names[:8]), stacklevel=3)
        return split.forward
    raise Unsupported("could not split the graph")


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  options: dict[str, Any] | None = None) -> Callable:
    """An AOTAutograd compiler: returns a boxed callable running `gm` as one program, or (when
    some node cannot be lowered) as compiled pieces around that node. `options`: XLA options
    (custom_compiler_options() blocks add theirs)."""
    from torch._functorch.aot_autograd import make_boxed_func

    from torch_tpu._internal.compile_cache import TpuOutputCode
    from torch_tpu.distributed import _compile as dist_compile

    if dist_compile.has_collectives(gm):  # split at collectives (torch_tpu/distributed/_compile.py)
        return TpuOutputCode(dist_compile.split_at_collectives(
            gm, lambda g, inputs: compile_graph(g, inputs, options)))

    STATS["graphs"] += 1
    if graph_passes.ENABLED[0]:
        for k, v in graph_passes.run(gm).items():
            STATS[k] += v
    xla = xla_options.encode({**graph_defaults(), **(options or {}), **xla_options.current()})
    host = next((n for n in gm.graph.nodes if n.op == "call_function" and _touches_host(n)), None)
    # Imported here: it pulls in sympy (~1.4 s) that `import torch` (autoloading torch_tpu) must not pay.
    from torch_tpu._internal import dynamic_shapes

    if dynamic_shapes.is_dynamic(gm) and host is not None:  # buckets cannot pad CPU work: correct, op by op
        STATS["eager_graphs"] += 1
        warnings.warn(f"torch_tpu: dynamic graph with CPU tensors ({host.target}) runs op by op in eager mode",
                      stacklevel=2)
        return TpuOutputCode(make_boxed_func(gm.forward))
    if dynamic_shapes.is_dynamic(gm):  # symbolic sizes: bucketed programs (dynamic_shapes.py)
        _graph_counter[0] += 1
        return TpuOutputCode(dynamic_shapes.DynamicGraph(
            gm, example_inputs, lambda g, ins, name: _Program(g, ins, xla, name), f"graph{_graph_counter[0]}", xla))
    try:
        if host is not None:  # CPU tensors in the graph: tpu pieces around the CPU work
            raise Unsupported(f"{host.target} works on CPU tensors", host)
        program = _Program(gm, example_inputs, xla)
    except Unsupported as e:
        try:
            return TpuOutputCode(make_boxed_func(_split(gm, example_inputs, e, xla)))
        except Unsupported as e2:
            STATS["eager_graphs"] += 1
            warnings.warn(f"torch_tpu: compiled graph runs op by op in eager mode ({e2})", stacklevel=2)
            return TpuOutputCode(make_boxed_func(gm.forward))
    return TpuOutputCode(program)


# Python kernels PyTorch installs on these ops' CompositeImplicitAutograd/Autograd keys decompose
# them during tracing whatever the decomposition table says; native_batch_norm's is kept because
# functionalization relies on it.
_KEEP_PY_KERNELS = frozenset({"native_batch_norm", "empty"})


@contextlib.contextmanager
def lowered_ops_stay_whole() -> Iterator[None]:
    """While AOTAutograd traces: ops with a lowering reach the graph whole (their C++ composite
    or autograd kernel runs, as in eager) instead of being decomposed by a Python kernel."""
    from torch._C import DispatchKey

    saved = []
    if not _PY_KERNEL_OPS:
        lowered = _lowered_names()
        for name in lowered - _KEEP_PY_KERNELS:
            packet = getattr(torch.ops.aten, name, None)
            for overload in packet.overloads() if packet is not None else []:
                op = getattr(packet, overload)
                for key in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd):
                    if key in op.py_kernels:
                        _PY_KERNEL_OPS.append((op, key))
    for op, key in _PY_KERNEL_OPS:
        if key in op.py_kernels:
            saved.append((op, key, op.py_kernels.pop(key)))
            op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, key, fn in saved:
            op.py_kernels[key] = fn
            op._dispatch_cache.clear()


_PY_KERNEL_OPS: list[tuple[torch._ops.OpOverload, Any]] = []


def decompositions() -> dict[Any, Callable]:
    """Core-ATen decompositions minus every op that has its own lowering: compiled graphs run the
    same lowering (the same math) as eager for those ops."""
    from torch._decomp import core_aten_decompositions

    table = core_aten_decompositions()
    lowered = _lowered_names()
    return {**{op: fn for op, fn in table.items()
               if not (isinstance(op, torch._ops.OpOverload) and op._schema.name.startswith("aten::")
                       and op._schema.name[len("aten::"):] in lowered)}, **_random_factories()}


def _random_factories() -> dict[Any, Callable]:
    """rand/randn/randint(_like) as eager runs them (empty + uniform_/normal_/random_, in functional
    form): one lowering and one draw rule, so compiled draws equal eager ones and the factories
    stay inside the program."""
    aten = torch.ops.aten
    random_from = getattr(aten.random, "from")  # a Python keyword

    def empty(size: Any, dtype: Any, device: Any) -> torch.Tensor:
        return aten.empty.memory_format(size, dtype=dtype, device=device)

    def like(x: torch.Tensor, dtype: Any, device: Any) -> tuple[Any, Any]:
        return x.shape, dtype or x.dtype, device or x.device

    def randn(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
              pin_memory: Any = None) -> torch.Tensor:
        return aten.normal.float_float(0.0, 1.0, size, dtype=dtype or torch.get_default_dtype(), device=device)

    def rand(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
             pin_memory: Any = None) -> torch.Tensor:
        return aten.uniform.default(empty(size, dtype or torch.get_default_dtype(), device), 0.0, 1.0)

    def randint_low(low: int, high: int, size: Any, *, dtype: Any = None, layout: Any = None,
                    device: Any = None, pin_memory: Any = None) -> torch.Tensor:
        return random_from(empty(size, dtype or torch.int64, device), low, high)

    def randint(high: int, size: Any, **kw: Any) -> torch.Tensor:
        return randint_low(0, high, size, **kw)

    def randn_like(x: torch.Tensor, *, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
        size, dt, dev = like(x, dtype, device)
        return aten.normal.float_float(0.0, 1.0, size, dtype=dt, device=dev)

    def rand_like(x: torch.Tensor, *, dtype: Any = None, layout: Any = None, device: Any = None,
                  pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
        return aten.uniform.default(empty(*like(x, dtype, device)), 0.0, 1.0)

    def randint_like_low(x: torch.Tensor, low: int, high: int, *, dtype: Any = None, layout: Any = None,
                         device: Any = None, pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
        return random_from(empty(*like(x, dtype, device)), low, high)

    def randint_like(x: torch.Tensor, high: int, **kw: Any) -> torch.Tensor:
        return randint_like_low(x, 0, high, **kw)

    return {aten.randn.default: randn, aten.rand.default: rand, aten.randint.default: randint,
            aten.randint.low: randint_low, aten.randn_like.default: randn_like, aten.rand_like.default: rand_like,
            aten.randint_like.default: randint_like, aten.randint_like.low_dtype: randint_like_low}


_SUPPORTED_DTYPES = frozenset(_DTYPE_INDEX)


def register_device_interface() -> None:
    """Replaces Dynamo's built-in "tpu" device interface (which marks float16/float64 unsupported
    and knows nothing of torch.tpu) with one backed by torch.tpu. Dynamo re-registers its own on
    first use, so this runs after forcing that initialisation."""
    from torch._dynamo import device_interface as di

    di.get_interface_for_device("cpu")  # Dynamo's registrations first

    class TpuDeviceInterface(di.TpuInterface):
        @staticmethod
        def is_available() -> bool:
            return torch.tpu.is_available()  # type: ignore[attr-defined]

        @staticmethod
        def current_device() -> int:
            return torch.tpu.current_device()  # type: ignore[attr-defined]

        @staticmethod
        def device_count() -> int:
            return torch.tpu.device_count()  # type: ignore[attr-defined]

        @staticmethod
        def synchronize(device: Any = None) -> None:
            torch.tpu.synchronize()  # type: ignore[attr-defined]

        @classmethod
        def is_dtype_supported(cls, dtype: torch.dtype, including_emulation: bool = False) -> bool:
            return dtype in _SUPPORTED_DTYPES

    di.register_interface_for_device("tpu", TpuDeviceInterface)


# torch.compile modes (docs/compile.md): a compiled graph is already one launch per call (what
# "reduce-overhead" buys with CUDA graphs elsewhere); "max-autotune" asks XLA for its highest
# optimization effort (O3) unless options set a level.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@functools.cache
def graph_defaults() -> dict[str, Any]:
    """XLA options every compiled graph gets unless the caller sets them (docs/compile.md).

    On AVX-512 hosts, 512-bit vectors for XLA's generated loops (XLA:CPU prefers 256): measured
    on whole programs, alternated in one process (process CPU per call), it was faster or equal
    on every benchmark model: Llama decode -26 %, prefill -2 %, SD3 -6..-10 %, UNet -8 %,
    Flux/AutoencoderKL within noise."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return {"xla_cpu_prefer_vector_width": 512}
    return {}


def _mode_options(mode: str | None) -> dict[str, Any]:
    if mode not in MODES:
        raise ValueError(f"torch_tpu: unknown torch.compile mode {mode!r}; expected one of "
                         + ", ".join(repr(m) for m in MODES if m))
    return {"xla_optimization_level": "O3"} if mode in ("max-autotune", "max-autotune-no-cudagraphs") else {}


class TpuBackend:
    """The Dynamo backend `"tpu"` (also usable as `torch.compile(m, backend=TpuBackend(options))`).

    `options`: XLA options (see xla_options.py), as `torch.compile(..., options=...)` gives them."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        register_device_interface()
        compile_meta.install()
        self.options = xla_options.validate(options)
        self._aots: dict[tuple, Callable] = {}

    def _aot(self, options: dict[str, Any]) -> Callable:
        from torch._dynamo.backends.common import aot_autograd

        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        if key not in self._aots:
            from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

            from torch_tpu._internal.compile_cache import TpuOutputCode

            # Compilers returning an OutputCode (SerializableAOTDispatchCompiler) are what make
            # AOTAutograd consult its cache (torch._functorch._aot_autograd.autograd_cache).
            def serializable() -> Callable:
                return SerializableAOTDispatchCompiler(TpuOutputCode, functools.partial(compile_graph, options=options))

            self._aots[key] = aot_autograd(fw_compiler=serializable(), bw_compiler=serializable(),
                                           decompositions=decompositions(), keep_inference_input_mutations=True)
        return self._aots[key]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                 options: dict[str, Any] | None = None, **kwargs: Any) -> Callable:
        from torch_tpu._internal.compile_cache import aot_cache

        opts = {**_mode_options(mode), **self.options, **xla_options.validate(options)}
        with lowered_ops_stay_whole(), aot_cache(xla_options.encode({**graph_defaults(), **opts,
                                                                     **xla_options.current()})):
            return self._aot(opts)(gm, example_inputs, **kwargs)


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
    """Entry point for the `torch_dynamo_backends` group (Dynamo loads it lazily by name)."""
    return _backend()(gm, example_inputs, **kwargs)


_instance: list[TpuBackend] = []


def _backend() -> TpuBackend:
    if not _instance:
        _instance.append(TpuBackend())
    return _instance[0]


def _has_tpu_tensor(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "tpu" for t in example_inputs)


class _DefaultBackend:
    """What `torch.compile(model)` (backend="inductor", the default) uses once torch_tpu is loaded:
    graphs whose inputs live on tpu go to the "tpu" backend; everything else to Inductor,
    unchanged. Inductor's own tpu path would need Pallas kernels via JAX; routing keeps the
    default working without JAX and with the same programs as backend="tpu"."""

    def __init__(self, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> None:
        register_device_interface()
        # xla_* options are for tpu graphs; the rest are Inductor's (it validates them).
        self._mode = mode
        self._xla = {k: v for k, v in (options or {}).items() if k.startswith("xla_")}
        rest = {k: v for k, v in (options or {}).items() if not k.startswith("xla_")}
        self._inductor = torch._TorchCompileInductorWrapper(mode, rest or None, dynamic)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        if _has_tpu_tensor(example_inputs):
            return _backend()(gm, example_inputs, mode=self._mode, options=self._xla)
        return self._inductor(gm, example_inputs, **kwargs)

    def __eq__(self, other: object) -> bool:  # Dynamo compares backends to reuse caches
        return (isinstance(other, _DefaultBackend) and self._inductor == other._inductor
                and self._xla == other._xla and self._mode == other._mode)

    def __hash__(self) -> int:
        return hash(type(self))


def install_default_backend_routing() -> None:
    """Wraps torch.compile so its default backend routes tpu graphs to the tpu backend."""
    original = torch.compile
    if getattr(original, "_torch_tpu_routing", False):
        return

    def compile(model: Any = None, *, backend: Any = "inductor", mode: str | None = None,  # noqa: A001
                options: dict[str, Any] | None = None, dynamic: bool | None = None, **kwargs: Any) -> Any:
        compile_meta.install()  # before Dynamo runs the first fake kernels
        if isinstance(backend, str) and backend == "inductor":
            backend = _DefaultBackend(mode, options, dynamic)
            mode = options = None
        return original(model, backend=backend, mode=mode, options=options, dynamic=dynamic, **kwargs)

    compile.__doc__ = original.__doc__
    compile.__wrapped__ = original  # type: ignore[attr-defined]
    compile._torch_tpu_routing = True  # type: ignore[attr-defined]
    torch.compile = compile  # type: ignore[assignment]
