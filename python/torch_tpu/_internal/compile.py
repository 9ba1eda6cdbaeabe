"""`torch.compile(backend="tpu")`: AOTAutograd graphs -> one StableHLO program each.

Each FX graph (forward, and backward when training) is described with plain values and lowered
in C++ through the same lowering table eager uses, compiled once (memory + disk cache), and run
by the `torch_tpu::run_graph` op. Input mutations (aot's trailing `copy_`) are written back
through the storage write path with donation. Random ops read the device generator's state
from extra inputs that run_graph fills per run (advanced as eager advances it). Graphs with ops
that have no lowering run op by op in eager mode instead (correct, warned once).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch_tpu import _C

_DTYPE_INDEX = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15, torch.uint16: 27,
    torch.uint32: 28, torch.uint64: 29,
}

# GArg::Kind in csrc/aten/graph.h
K_NONE, K_REF, K_REFLIST, K_OPTREFLIST, K_SCALARREF, K_INT, K_INTLIST, K_DOUBLE, K_BOOL, K_STR, K_DTYPE, \
    K_SCALARF, K_SCALARI, K_SCALARB = range(14)


class Unsupported(Exception):
    pass


def _dtype(d: torch.dtype) -> int:
    if d not in _DTYPE_INDEX:
        raise Unsupported(f"dtype {d}")
    return _DTYPE_INDEX[d]


def _tensor_type(v: Any, with_strides: bool = False) -> tuple:
    if not isinstance(v, torch.Tensor):
        raise Unsupported(f"non-tensor value {type(v).__name__}")
    t: tuple = (_dtype(v.dtype), [int(s) for s in v.shape])
    if with_strides:
        t = t + ([int(s) for s in v.stride()],)
    return t


def _is_number_type(arg: torch._C.Argument) -> bool:
    t = arg.type
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.NumberType)


_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _draws_random(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call of an op tagged random consumes random numbers: attention with dropout_p == 0
    is deterministic (its lowering reads no generator state)."""
    bound = {a.name: v for a, v in _bind(op, args, kwargs)}
    if op._schema.name.startswith("aten::_scaled_dot_product_") and "dropout_p" in bound:
        p = bound["dropout_p"]
        return not (isinstance(p, (int, float)) and float(p) == 0.0)
    return True


def _rng_increment(n: torch.fx.Node) -> int:
    """Philox counters a random op consumes, as eager counts them (csrc/aten/execute.cc): the
    largest element count of its outputs and tensor inputs, plus one."""
    numel = 1
    vals: list[Any] = [n.meta.get("val")]
    vals += [a.meta.get("val") for a in n.all_input_nodes]
    while vals:
        v = vals.pop()
        if isinstance(v, (list, tuple)):
            vals.extend(v)
        elif isinstance(v, torch.Tensor):
            numel = max(numel, int(v.numel()))
    return numel + 1


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

    def arg(self, schema_arg: torch._C.Argument, v: Any) -> tuple:
        name = schema_arg.name
        v = self._concrete(v)
        number = _is_number_type(schema_arg)
        if isinstance(v, torch.fx.Node):
            return (name, K_SCALARREF if number else K_REF, 0, 0.0, "", [self.ref(v)])
        if isinstance(v, (list, tuple)) and any(isinstance(e, torch.fx.Node) for e in v) or (
            isinstance(v, (list, tuple)) and "Tensor" in str(schema_arg.type)
        ):
            opt = "Optional[Tensor]" in str(schema_arg.type) or "Tensor?" in str(schema_arg.type)
            return (name, K_OPTREFLIST if opt else K_REFLIST, 0, 0.0, "", [-1 if e is None else self.ref(e) for e in v])
        if v is None or isinstance(v, (torch.device, torch.layout, torch.memory_format)):
            return (name, K_NONE, 0, 0.0, "", [])
        if isinstance(v, bool):
            return (name, K_SCALARB if number else K_BOOL, int(v), 0.0, "", [])
        if isinstance(v, int):
            return (name, K_SCALARI if number else K_INT, v, 0.0, "", [])
        if isinstance(v, float):
            return (name, K_SCALARF if number else K_DOUBLE, 0, v, "", [])
        if isinstance(v, torch.dtype):
            return (name, K_DTYPE, _dtype(v), 0.0, "", [])
        if isinstance(v, str):
            return (name, K_STR, 0, 0.0, v, [])
        if isinstance(v, (list, tuple)) and all(isinstance(e, (int, bool)) for e in v):
            return (name, K_INTLIST, 0, 0.0, "", [int(e) for e in v])
        raise Unsupported(f"argument {name}={v!r}")

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
                    inputs.append((_dtype(torch.float64), []))
                elif isinstance(v, (bool, int, torch.SymInt, torch.SymBool)):
                    inputs.append((_dtype(torch.int64), []))
                    self.sym[n] = self._concrete(v)  # sizes: specialized (floats stay operands)
                else:
                    raise Unsupported(f"graph input of type {type(v).__name__}")
                self.ids[n] = self.new_id()
                self.placeholders.append(n)
        # Tensor constants (get_attr) become extra program inputs after the placeholders.
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                t = getattr(self.gm, n.target)
                if not isinstance(t, torch.Tensor):
                    raise Unsupported(f"graph attribute {n.target} is not a tensor")
                inputs.append(_tensor_type(t))
                self.ids[n] = self.new_id()
                self.constants.append(t)
        # Random ops read the device generator's state (u64[2]) from inputs after those, which
        # run_graph fills at each run, advancing the generator by what eager would consume.
        rng = []
        for n in self.gm.graph.nodes:
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
                    torch.Tag.nondeterministic_seeded in n.target.tags and _draws_random(n.target, n.args, n.kwargs):
                self.rng[n] = self.new_id()
                inputs.append((_dtype(torch.uint64), [2]))
                rng.append((self.rng[n], _rng_increment(n)))
        for n in self.gm.graph.nodes:
            if n.op != "call_function":
                continue
            val = n.meta.get("val")
            if isinstance(val, _NUMBERS):
                # sym_size, operator.mul on sizes, ..., and int returns of ops (SDPA's max_q)
                self.sym[n] = self._concrete(val)
                continue
            if n.target is operator.getitem and n.args[0] not in self.sym:
                self.ids[n] = self.ids[n.args[0]][n.args[1]]
                continue
            op = n.target
            if not isinstance(op, torch._ops.OpOverload):
                raise Unsupported(f"call to {op}")
            if op is torch.ops.aten.copy_.default and n.args[0] in self.placeholders:
                mutations.append((self.placeholders.index(n.args[0]), self.ref(n.args[1])))
                self.ids[n] = self.ref(n.args[1])
                continue
            if op is torch.ops.prims.convert_element_type.default:
                # A dtype conversion: the runtime converts every lowering result to its out dtype.
                out_id = self.new_id()
                self.ids[n] = out_id
                nodes.append(("_to_copy", "", [("self", K_REF, 0, 0.0, "", [self.ref(n.args[0])])], [out_id],
                              [_tensor_type(n.meta["val"])]))
                continue
            if not op._schema.name.startswith("aten::"):
                raise Unsupported(f"non-aten op {op}")
            base = op._schema.name[len("aten::"):]
            if base.endswith("_") and not base.startswith("__"):
                raise Unsupported(f"in-place op {op} in a functional graph")
            bound = _bind(op, n.args, n.kwargs)
            if n in self.rng:
                if any(a.name == "generator" and v is not None for a, v in bound):
                    raise Unsupported(f"random op {op} with an explicit generator")
                bound = [(a, v) for a, v in bound if a.name != "generator"]
            args = [self.arg(a, v) for a, v in bound]
            if n in self.rng:
                args.append(("generator", K_REF, 0, 0.0, "", [self.rng[n]]))
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
                    out_types.append(_tensor_type(e) if isinstance(e, torch.Tensor) else (-1, []))
                out_ids.extend(ids)
                nested.append(ids if isinstance(v, (list, tuple)) else ids[0])
            self.ids[n] = out_ids[0] if not isinstance(val, (list, tuple)) else nested
            nodes.append((base, op._overloadname if op._overloadname != "default" else "", args, out_ids, out_types))
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        outputs, output_types, spec = [], [], []
        for o in out_node.args[0]:
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


_graph_counter = [0]


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """An AOTAutograd compiler: returns a boxed callable running `gm` as one program."""
    from torch._functorch.aot_autograd import make_boxed_func

    from torch_tpu.distributed import _compile as dist_compile

    if dist_compile.has_collectives(gm):  # split at collectives (torch_tpu/distributed/_compile.py)
        return dist_compile.split_at_collectives(gm, compile_graph)
    _graph_counter[0] += 1
    name = f"graph{_graph_counter[0]}"
    try:
        desc, spec, constants = _Describer(gm, name).describe()
        missing = _C._graph_unsupported(desc)
        if missing:
            raise Unsupported("no lowering for " + ", ".join(sorted(set(missing))))
        gid = _C._graph_build(desc)
    except Unsupported as e:
        warnings.warn(f"torch_tpu: compiled graph runs op by op in eager mode ({e})", stacklevel=2)
        return make_boxed_func(gm.forward)

    device = next((a.device for a in example_inputs if isinstance(a, torch.Tensor) and a.device.type == "tpu"),
                  torch.device("tpu"))
    consts = [c.to(device) for c in constants]

    def run(args: list[Any]) -> list[Any]:
        tensors = [a if isinstance(a, torch.Tensor) else torch.tensor(
            a, dtype=torch.float64 if isinstance(a, float) else torch.int64) for a in args]
        tensors.extend(consts)
        outs = torch.ops.torch_tpu.run_graph(gid, tensors)
        result = []
        for kind, v in spec:
            if kind == "out":
                result.append(outs[v])
            elif kind == "input":
                result.append(args[v])
            else:
                result.append(v)
        args.clear()
        return result

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


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


class TpuBackend:
    """The Dynamo backend `"tpu"` (also usable as `torch.compile(m, backend=TpuBackend())`)."""

    def __init__(self) -> None:
        register_device_interface()
        from torch._decomp import core_aten_decompositions
        from torch._dynamo.backends.common import aot_autograd

        self._aot = aot_autograd(
            fw_compiler=compile_graph,
            bw_compiler=compile_graph,
            decompositions=core_aten_decompositions(),
            keep_inference_input_mutations=True,
        )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        return self._aot(gm, example_inputs, **kwargs)


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
        self._inductor = torch._TorchCompileInductorWrapper(mode, options, dynamic)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        if _has_tpu_tensor(example_inputs):
            return _backend()(gm, example_inputs)
        return self._inductor(gm, example_inputs, **kwargs)

    def __eq__(self, other: object) -> bool:  # Dynamo compares backends to reuse caches
        return isinstance(other, _DefaultBackend) and self._inductor == other._inductor

    def __hash__(self) -> int:
        return hash(type(self))


def install_default_backend_routing() -> None:
    """Wraps torch.compile so its default backend routes tpu graphs to the tpu backend."""
    original = torch.compile
    if getattr(original, "_torch_tpu_routing", False):
        return

    def compile(model: Any = None, *, backend: Any = "inductor", mode: str | None = None,  # noqa: A001
                options: dict[str, Any] | None = None, dynamic: bool | None = None, **kwargs: Any) -> Any:
        if isinstance(backend, str) and backend == "inductor":
            backend = _DefaultBackend(mode, options, dynamic)
            mode = options = None
        return original(model, backend=backend, mode=mode, options=options, dynamic=dynamic, **kwargs)

    compile.__doc__ = original.__doc__
    compile.__wrapped__ = original  # type: ignore[attr-defined]
    compile._torch_tpu_routing = True  # type: ignore[attr-defined]
    torch.compile = compile  # type: ignore[assignment]
