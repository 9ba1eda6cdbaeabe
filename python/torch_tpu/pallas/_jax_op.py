"""`jax_op`: a JAX (or Pallas) function registered as a torch custom op that runs on tpu tensors.

The op's schema comes from the function's annotations (`jax.Array` parameters are tensors, the
others static); its fake kernel from JAX's abstract evaluation; its tpu kernel lowers the
function once per shape signature (`jax.jit(...).trace(...).lower(...)`, Pallas in interpret
mode off TPU) and runs it through `torch_tpu::jax_call`, which splices the module into the
program being built (strict eager, fused eager, a compiled graph) on the argument buffers
already on the device. Backward: `register_autograd` as for any custom op, else one derived
with `jax.vjp` (itself a jax_op, so it runs on tpu and inside compiled graphs too).
"""

from __future__ import annotations

import inspect
import threading
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu.pallas import _foreign

_STATIC_SCHEMA = {int: "SymInt", float: "float", bool: "bool", str: "str"}
_lock = threading.Lock()
# qualname -> JaxOp, for the torch.compile backend (compiled graphs splice the same module)
REGISTRY: dict[str, JaxOp] = {}


@dataclass
class _Param:
    name: str
    tensor: bool
    schema: str
    default: Any = inspect.Parameter.empty


def _is_jax_array(ann: Any, jax: Any) -> bool:
    return ann is jax.Array or (isinstance(ann, type) and issubclass(ann, jax.Array))


def _static_schema(op: str, name: str, ann: Any) -> str:
    if ann in _STATIC_SCHEMA:
        return _STATIC_SCHEMA[ann]
    origin = typing.get_origin(ann)
    if origin in (list, tuple, Sequence) and typing.get_args(ann):
        elem = typing.get_args(ann)[0]
        if elem in (int, float, bool):
            return {int: "SymInt[]", float: "float[]", bool: "bool[]"}[elem]
    raise TypeError(f"jax_op {op}: parameter '{name}' is annotated {ann!r}; use jax.Array for tensors or "
                    "int, float, bool, str, list[int], list[float] for static arguments")


def _default_literal(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, str):
        return '"' + v.replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_default_literal(e) for e in v) + "]"
    return repr(v)


def _n_outputs(op: str, ann: Any, jax: Any) -> int | None:
    """Output count from the return annotation (None: a single array, the default)."""
    if ann is inspect.Signature.empty or _is_jax_array(ann, jax):
        return None
    if typing.get_origin(ann) is tuple:
        args = typing.get_args(ann)
        if args and all(_is_jax_array(a, jax) for a in args):
            return len(args)
    raise TypeError(f"jax_op {op}: return annotation {ann!r} is not supported; use jax.Array or "
                    "tuple[jax.Array, ...]")


class JaxOp:
    def __init__(self, name: str, fn: Callable[..., Any], donate_argnums: Sequence[int], mesh: Any = None,
                 input_partition_specs: Any = None, output_partition_specs: Any = None) -> None:
        jax = _foreign.require_jax(f"jax_op {name}")
        if "::" not in name:
            raise ValueError(f"jax_op: name {name!r} must be 'namespace::name'")
        self.name = name
        self.fn = fn
        try:
            # string annotations (from __future__ import annotations) may name a jax imported locally
            sig = inspect.signature(fn, eval_str=True, locals={"jax": jax, "typing": typing})
        except (NameError, TypeError) as e:
            raise TypeError(f"jax_op {name}: cannot read the annotations of {fn!r}: {e}") from e
        self.params: list[_Param] = []
        for p in sig.parameters.values():
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise TypeError(f"jax_op {name}: *args/**kwargs parameter '{p.name}' is not supported")
            if p.annotation is inspect.Parameter.empty:
                raise TypeError(f"jax_op {name}: parameter '{p.name}' has no annotation; annotate tensors as "
                                "jax.Array and static arguments as int, float, bool, str or list[int]")
            if _is_jax_array(p.annotation, jax):
                self.params.append(_Param(p.name, True, "Tensor"))
            else:
                self.params.append(_Param(p.name, False, _static_schema(name, p.name, p.annotation), p.default))
        self.n_out = _n_outputs(name, sig.return_annotation, jax)
        n_params = len(self.params)
        self.donate = tuple(int(i) for i in donate_argnums)
        for i in self.donate:
            if not -n_params <= i < n_params:
                raise ValueError(f"jax_op {name}: donate_argnums entry {i} is out of range for {n_params} parameters")
            if not self.params[i].tensor:
                raise ValueError(f"jax_op {name}: donate_argnums entry {i} names '{self.params[i].name}', "
                                 "which is not a jax.Array parameter")
        self.donate = tuple(sorted({i % n_params for i in self.donate}))
        args = []
        for p in self.params:
            d = "" if p.default is inspect.Parameter.empty else "=" + _default_literal(p.default)
            args.append(f"{p.schema} {p.name}{d}")
        rets = "Tensor" if self.n_out is None else "(" + ", ".join(["Tensor"] * self.n_out) + ")"
        self.schema = f"({', '.join(args)}) -> {rets}"
        self.sharding: Any = None
        if mesh is not None or input_partition_specs is not None or output_partition_specs is not None:
            from torch_tpu.pallas._sharded import Sharding

            self.sharding = Sharding(name, mesh, input_partition_specs, output_partition_specs,
                                     sum(p.tensor for p in self.params), self.n_out)
            self.sharding.coords()  # a mesh over several chips without the process group fails here
        self._kernels: dict[Any, _foreign.Kernel] = {}
        self._platform: str | None = None
        self.op = torch.library.custom_op(name, self._impl, mutates_args=(), device_types="tpu",
                                          schema=self.schema)
        self.op.register_fake(self._fake)
        self._setup_default_autograd()  # register_autograd on the op replaces it
        self.op.jax_op = self  # type: ignore[attr-defined]
        with _lock:
            REGISTRY[self.op._qualname] = self

    # ---- lowering, one kernel per shape signature
    def _bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        full = list(args)
        for p in self.params[len(args):]:
            if p.name in kwargs:
                full.append(kwargs[p.name])
            elif p.default is not inspect.Parameter.empty:
                full.append(p.default)
            else:
                raise TypeError(f"{self.name}: missing argument '{p.name}'")
        return full

    def _split(self, args: Sequence[Any]) -> tuple[list[torch.Tensor], tuple[tuple[str, Any], ...]]:
        tensors, statics = [], []
        for p, a in zip(self.params, args, strict=True):
            if p.tensor:
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"{self.name}: argument '{p.name}' must be a tensor, got {type(a).__name__}")
                tensors.append(a)
            else:
                statics.append((p.name, tuple(a) if isinstance(a, list) else a))
        return tensors, tuple(statics)

    def platform(self) -> str:
        if self._platform is None:
            self._platform = _foreign.device_platform()
        return self._platform

    def kernel(self, metas: Sequence[tuple[torch.dtype, tuple[int, ...]]],
               statics: tuple[tuple[str, Any], ...]) -> _foreign.Kernel:
        key = (tuple(metas), statics)
        k = self._kernels.get(key)
        if k is None:
            k = self._lower(metas, statics)
            self._kernels[key] = k
        return k

    def _lower(self, metas: Sequence[tuple[torch.dtype, tuple[int, ...]]],
               statics: tuple[tuple[str, Any], ...]) -> _foreign.Kernel:
        jax = _foreign.require_jax(f"jax_op {self.name}")
        import numpy as np

        avals = []
        for (dtype, shape), p in zip(metas, [p for p in self.params if p.tensor], strict=True):
            elem = _foreign.mlir_elem(dtype, self.name, f"argument '{p.name}'")
            if elem in ("i64", "ui64", "f64") and not jax.config.jax_enable_x64:
                raise TypeError(f"{self.name}: argument '{p.name}' is {dtype}, but JAX runs with "
                                "jax_enable_x64=False and would treat it as 32-bit; convert the tensor "
                                "or enable x64 (jax.config.update('jax_enable_x64', True))")
            jd = jax.numpy.bfloat16 if dtype == torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch."))
            avals.append(jax.ShapeDtypeStruct(tuple(shape), jd))
        static_vals = dict(statics)
        params = self.params
        fn = self.fn
        n_out = self.n_out

        def flat(*arrays: Any) -> Any:
            it = iter(arrays)
            kwargs = {p.name: (next(it) if p.tensor else static_vals[p.name]) for p in params}
            out = fn(**kwargs)
            if n_out is None and isinstance(out, (tuple, list)):
                raise TypeError(f"{self.name}: the JAX function returned {len(out)} values; annotate its return "
                                f"type as tuple[{', '.join(['jax.Array'] * len(out))}]")
            return out

        platform = self.platform()
        try:
            if self.sharding is not None:  # this rank's computation on its shards
                flat = self.sharding.local_fn(jax, flat, avals, n_out is None)
            lowered = _lower_for(jax, flat, avals, platform)
        except (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError,
                jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError) as e:
            raise ValueError(f"{self.name}: the JAX function's output shape or control flow depends on the "
                             f"values of its inputs, which a compiled kernel cannot do ({type(e).__name__}); "
                             "use static arguments, jnp.where or fixed-size outputs") from e
        outs = jax.tree_util.tree_leaves(lowered.out_info)
        if n_out is not None and len(outs) != n_out:
            raise TypeError(f"{self.name}: the JAX function returned {len(outs)} arrays, its annotation says {n_out}")
        return _foreign.register_module(self.name, lowered.as_text(debug_info=False), platform)

    # ---- kernels
    def _impl(self, *args: Any, **kwargs: Any) -> Any:
        tensors, statics = self._split(self._bind(args, kwargs))
        for p, t in zip([p for p in self.params if p.tensor], tensors, strict=True):
            if t.device.type != "tpu":
                raise ValueError(f"{self.name}: argument '{p.name}' is on {t.device}; jax_op kernels run on tpu "
                                 "tensors")
        k = self.kernel([(t.dtype, tuple(t.shape)) for t in tensors], statics)
        if self.donate:
            outs = _call_donating(self, tensors, k)
        else:
            outs = torch.ops.torch_tpu.jax_call(tensors, k.key)
        return outs[0] if self.n_out is None else tuple(outs)

    def _fake(self, *args: Any, **kwargs: Any) -> Any:
        tensors, statics = self._split(self._bind(args, kwargs))
        try:
            metas = [(t.dtype, tuple(int(s) for s in t.shape)) for t in tensors]
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"{self.name}: jax_op kernels need static shapes (got symbolic sizes)") from e
        k = self.kernel(metas, statics)
        dev = tensors[0].device if tensors else torch.device("tpu")
        outs = [torch.empty(shape, dtype=d, device=dev) for (_, shape), d in zip(k.out_types, k.out_dtypes(),
                                                                                  strict=True)]
        return outs[0] if self.n_out is None else tuple(outs)

    # ---- autograd
    def _setup_default_autograd(self) -> None:
        """Backward from jax.vjp: a second jax_op taking (inputs..., cotangents...) and returning one
        gradient per float tensor input. Integer inputs get no gradient."""
        holder: dict[str, Any] = {}

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            inputs = tuple(self._bind(inputs, {}))
            ctx.save_for_backward(*[a for p, a in zip(self.params, inputs, strict=True) if p.tensor])
            ctx.statics = [a for p, a in zip(self.params, inputs, strict=True) if not p.tensor]

        def backward(ctx: Any, *grads: Any) -> Any:
            if "op" not in holder:
                holder["op"] = _vjp_op(self)
            saved = ctx.saved_tensors
            cts = [g if g is not None else torch.zeros(s, dtype=d, device=saved[0].device)
                   for g, (s, d) in zip(grads, _out_meta(self, saved, ctx.statics), strict=True)]
            res = holder["op"](*saved, *cts, *ctx.statics)
            res = [res] if isinstance(res, torch.Tensor) else list(res)
            it = iter(res)
            out = []
            for p, t in zip(self.params, _interleave(self.params, saved, ctx.statics), strict=True):
                if p.tensor and t.is_floating_point():
                    out.append(next(it))
                else:
                    out.append(None)
            return tuple(out)

        self.op.register_autograd(backward, setup_context=setup_context)

    def __repr__(self) -> str:
        return f"<jax_op {self.name}{self.schema}>"


def _interleave(params: list[_Param], tensors: Sequence[Any], statics: Sequence[Any]) -> list[Any]:
    ti, si = iter(tensors), iter(statics)
    return [next(ti) if p.tensor else next(si) for p in params]


def _out_meta(op: JaxOp, saved: Sequence[torch.Tensor], statics: Sequence[Any]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    st = tuple((p.name, tuple(a) if isinstance(a, list) else a)
               for p, a in zip([p for p in op.params if not p.tensor], statics, strict=True))
    k = op.kernel([(t.dtype, tuple(int(s) for s in t.shape)) for t in saved], st)
    return [(shape, d) for (_, shape), d in zip(k.out_types, k.out_dtypes(), strict=True)]


def _vjp_op(op: JaxOp) -> Any:
    """The backward jax_op of `op`: (primal tensors..., cotangents..., statics...) -> input grads."""
    jax = _foreign.require_jax(f"jax_op {op.name}")
    tensor_params = [p for p in op.params if p.tensor]
    static_params = [p for p in op.params if not p.tensor]
    n_in = len(tensor_params)
    n_out = 1 if op.n_out is None else op.n_out
    fn = op.fn

    def bwd(*args: Any, **statics: Any) -> Any:
        primals, cts = args[:n_in], args[n_in:n_in + n_out]
        float_idx = [i for i, x in enumerate(primals) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]

        def f(*fl: Any) -> Any:
            full = list(primals)
            for i, x in zip(float_idx, fl, strict=True):
                full[i] = x
            it = iter(full)
            return fn(**{p.name: (next(it) if p.tensor else statics[p.name]) for p in op.params})

        _, pullback = jax.vjp(f, *[primals[i] for i in float_idx])
        grads = pullback(cts[0] if op.n_out is None else tuple(cts))
        return grads[0] if len(grads) == 1 else tuple(grads)

    names = [f"p_{p.name}" for p in tensor_params] + [f"ct{i}" for i in range(n_out)]
    sig_params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=jax.Array) for n in names]
    static_anns = {p.name: _ann_of_schema(p.schema) for p in static_params}
    sig_params += [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=static_anns[p.name])
                   for p in static_params]

    def wrapper(**kw: Any) -> Any:
        arrays = [kw[n] for n in names]
        return bwd(*arrays, **{p.name: kw[p.name] for p in static_params})

    # The gradient count (the op's return arity) depends on which inputs are floating point:
    # _VjpCaller creates one backward op per count, at the first backward.
    ns, base = op.name.split("::")
    return _VjpCaller(ns, f"{base}_vjp", wrapper, sig_params, jax, op.sharding)


class _VjpCaller:
    """Creates the backward op lazily per number of float inputs (its return arity)."""

    def __init__(self, ns: str, base: str, wrapper: Callable[..., Any], params: list[inspect.Parameter],
                 jax: Any, sharding: Any = None) -> None:
        self.ns, self.base, self.wrapper, self.params, self.jax = ns, base, wrapper, params, jax
        self.sharding = sharding
        self.ops: dict[int, Any] = {}

    def __call__(self, *args: Any) -> Any:
        n_float = sum(1 for a, p in zip(args, self.params, strict=False)
                      if isinstance(a, torch.Tensor) and a.is_floating_point() and p.name.startswith("p_"))
        if n_float not in self.ops:
            wrapper = self.wrapper

            def w(**kw: Any) -> Any:
                return wrapper(**kw)

            ret = self.jax.Array if n_float == 1 else tuple[(self.jax.Array,) * n_float]  # type: ignore[misc]
            w.__signature__ = inspect.Signature(self.params, return_annotation=ret)  # type: ignore[attr-defined]
            kw: dict[str, Any] = {}
            sh = self.sharding
            if sh is not None:  # per-shard gradients: primals and cotangents sharded like the forward's
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                n_in = len(sh.in_specs)
                floats = [sh.in_specs[i] for i in range(n_in) if tensors[i].is_floating_point()]
                kw = dict(mesh=sh.mesh, input_partition_specs=sh.in_specs + sh.out_specs,
                          output_partition_specs=floats[0] if n_float == 1 else tuple(floats))
            self.ops[n_float] = jax_op(f"{self.ns}::{self.base}{n_float}", w, **kw)
        return self.ops[n_float](*args)


def _ann_of_schema(schema: str) -> Any:
    return {"SymInt": int, "float": float, "bool": bool, "str": str, "SymInt[]": list[int],
            "float[]": list[float], "bool[]": list[bool]}[schema]


def _covers_storage(t: torch.Tensor) -> bool:
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def _call_donating(op: JaxOp, tensors: list[torch.Tensor], k: _foreign.Kernel) -> list[torch.Tensor]:
    """Donation as JAX does it: each donated input is paired with the first unpaired output of its
    shape and dtype; the kernel writes that output into the input's own buffer (the program
    aliases it, so XLA reuses the memory), and a fresh output tensor takes the buffer over. The
    donated input is left without device memory (reads give zeros), like a deleted jax.Array."""
    tensor_pos = [i for i, p in enumerate(op.params) if p.tensor]
    donated = [tensors[tensor_pos.index(i)] for i in op.donate]
    dev = tensors[0].device
    outs: list[torch.Tensor] = [torch.empty(shape, dtype=d, device=dev)
                                for (_, shape), d in zip(k.out_types, k.out_dtypes(), strict=True)]
    moved: list[tuple[torch.Tensor, int]] = []
    for t in donated:
        j = next((j for j, o in enumerate(outs) if all(j != m for _, m in moved)
                  and tuple(o.shape) == tuple(t.shape) and o.dtype == t.dtype), None)
        if j is not None and _covers_storage(t) and all(t is not m for m, _ in moved):
            outs[j] = t
            moved.append((t, j))
    torch.ops.torch_tpu.jax_call_out(tensors, k.key, outs)
    for t, j in moved:
        fresh = torch.empty_like(t)
        torch.ops.torch_tpu._move_buffer(t, fresh)
        outs[j] = fresh
    for t in donated:  # donated without a matching output: its memory is released all the same
        if all(t is not m for m, _ in moved):
            torch.ops.torch_tpu._release_buffer(t)
    return outs


# Off TPU, Pallas TPU kernels are traced as for this chip: kernels that size their tiles from
# pltpu.get_tpu_info() (Tokamax's) read it from the abstract device instead of failing on "cpu".
_INTERPRET_AS_TPU = "TPU v5 lite"


def _lower_for(jax: Any, fn: Callable[..., Any], avals: Sequence[Any], platform: str) -> Any:
    """Lowers for the device's platform; off TPU, Pallas kernels are traced in interpret mode
    (plain StableHLO) - the flag is read when pallas_call is traced."""
    if platform == "tpu":
        return jax.jit(fn, keep_unused=True).trace(*avals).lower(lowering_platforms=("tpu",))
    from jax._src import config
    from jax._src.mesh import AbstractDevice

    tpu = AbstractDevice(device_kind=_INTERPRET_AS_TPU, num_cores=1, platform="tpu")
    prev = config.pallas_tpu_interpret_mode_context_manager.swap_local(True)
    try:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("_tpu",), abstract_device=tpu)):
            traced = jax.jit(fn, keep_unused=True).trace(*avals)
        return traced.lower(lowering_platforms=("cpu",))
    finally:
        config.pallas_tpu_interpret_mode_context_manager.set_local(prev)


def jax_op(name: str, fn: Callable[..., Any] | None = None, /, *, donate_argnums: Sequence[int] = (),
           mesh: Any = None, input_partition_specs: Any = None, output_partition_specs: Any = None) -> Any:
    """Registers JAX function `fn` as torch custom op `name` ("namespace::name") running on tpu.

    Usable as a decorator (`@jax_op("mylib::add")`). Parameters annotated `jax.Array` are tensors;
    the others (int, float, bool, str, list[int], ...) are static: each value lowers its own kernel.
    Returns the `torch.library.custom_op` (call it like a function; `register_autograd` overrides
    the default backward, which is derived with `jax.vjp`). With `mesh=` (get_pallas_mesh) and
    partition specs, each rank of the process group runs `fn` on its own shards, as the body of a
    jax.shard_map (see torch_tpu/pallas/_sharded.py)."""
    if fn is None:
        return lambda f: jax_op(name, f, donate_argnums=donate_argnums, mesh=mesh,
                                input_partition_specs=input_partition_specs,
                                output_partition_specs=output_partition_specs)
    return JaxOp(name, fn, donate_argnums, mesh, input_partition_specs, output_partition_specs).op
