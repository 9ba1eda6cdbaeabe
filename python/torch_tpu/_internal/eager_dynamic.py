"""Eager bounded dynamism: `torch_tpu.mark_dynamic(tensor, dim, max=None)`.

A marked tensor is re-backed by a storage padded along `dim` to a size bucket (a power of two
>= 16, at most `max`); the tensor itself is the prefix view of the real size, and the storage is
registered as dynamic (csrc/aten/eager_dynamic.cc). Every op that reads such a storage reaches
`_handle` instead of the normal eager path:

- prefix views (the marked tensor, and results of bucketed ops) are *dynamic inputs*: the op is
  traced once with a symbolic size for that dim (make_fx on fake tensors, one symbol per distinct
  real size) and run through the compiled path's bounded-dynamism machinery
  (dynamic_shapes.DynamicGraph: same padding rules and masks, one program per bucket, the real
  sizes as runtime operands). Outputs with a symbolic dim come back as prefix views of their
  bucket-sized buffers and are registered as dynamic in turn, so dynamism propagates
  (`input_ids = torch.cat([input_ids, next_token], -1)` stays dynamic).
- other views of a dynamic storage (`input_ids[:, -1:]`: the offset moves with the length) are
  first copied out by a gather whose offset is a runtime operand: one program per bucket.
- an op the padded rules cannot express (or a mutation of a dynamic storage, a random op, ...)
  declines: it runs exactly as without marking (one program per size) and `EAGER["declined"]`
  (shown by torch_tpu.explain()) says why.

Traces are cached per (op, non-tensor arguments, input types) with the shape guards the trace
recorded; a call whose sizes break a guard gets its own trace (a few per key, then the key
declines). Works in strict and fused eager (a bucketed op is a program launch, which flushes the
pending fused program first).
"""

from __future__ import annotations

import ast
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

# Counters and decline reasons, shown by torch_tpu.explain() and compile_stats()["eager_dynamic"].
EAGER: dict[str, Any] = {"bucketed_calls": 0, "gathers": 0, "declined_calls": 0, "traces": 0, "declined": {}}

# Whether successful bucketed calls hand a plan to the C++ fast path (csrc/aten/eager_dynamic.cc),
# which then runs later calls of the same op, arguments and input layout without Python.
FAST = [True]


def set_fast_path(on: bool) -> bool:
    """Turns the C++ fast path on or off (for A/B measurements; plans are kept); returns the
    previous setting."""
    FAST[0] = on
    return bool(torch.ops.torch_tpu._dynamic_fast_enable(on))


def stats() -> dict[str, Any]:
    """Copy of EAGER: bucketed calls (fast_calls of them served by the C++ fast path),
    runtime-offset gathers (fast_gathers in C++), declined calls (with the ones C++ sent to the
    normal path at once) and why per op."""
    fast, gathers, declines = torch.ops.torch_tpu._dynamic_fast_stats(False) if _installed[0] else (0, 0, 0)
    return {**EAGER, "bucketed_calls": EAGER["bucketed_calls"] + fast, "fast_calls": fast,
            "gathers": EAGER["gathers"] + gathers, "fast_gathers": gathers,
            "declined_calls": EAGER["declined_calls"] + declines, "declined": dict(EAGER["declined"])}


def reset_stats() -> None:
    for k in ("bucketed_calls", "gathers", "declined_calls", "traces"):
        EAGER[k] = 0
    EAGER["declined"].clear()
    if _installed[0]:
        torch.ops.torch_tpu._dynamic_fast_stats(True)


_DTYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
           "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
           "Bool": torch.bool, "ComplexFloat": torch.complex64, "ComplexDouble": torch.complex128}
_FORMATS = [torch.contiguous_format, torch.preserve_format, torch.channels_last, torch.channels_last_3d]
_MAX_VARIANTS = 4  # traces per key (each a guard set) before the key declines
# Distinct traces per op before the op declines: a Python scalar is part of the key (it is a
# constant of the traced graph), so a scalar that changes every call must not trace every call.
_MAX_TRACES_PER_OP = 64
_MAX_CALL_TEXTS = 8192
_installed = [False]
_warned = [False]


class _Decline(Exception):
    """The call runs on the normal (exact-size) path; the message says why."""


def _contiguous(shape: list[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        out[d] = acc
        acc *= max(shape[d], 1)
    return out


def _info(t: torch.Tensor) -> tuple[int, int | None, list[int]] | None:
    """(dim, max, padded sizes) of a tensor whose storage is dynamic, else None."""
    raw = torch.ops.torch_tpu._dynamic_info(t)
    if not raw:
        return None
    return int(raw[0]), (None if raw[1] < 0 else int(raw[1])), [int(x) for x in raw[2:]]


def mark_dynamic(tensor: torch.Tensor, dim: int, *, min: int | None = None, max: int | None = None) -> torch.Tensor:  # noqa: A002
    """Makes `dim` of a tpu tensor dynamic for eager ops: programs are built per size bucket
    (powers of two >= 16, capped by `max`) instead of per size, and results of ops along that dim
    stay dynamic. One dynamic dim per tensor. Returns the tensor (marked in place)."""
    from torch_tpu._internal.dynamic_shapes import next_bucket

    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "tpu":
        raise ValueError("torch_tpu.mark_dynamic: expected a tensor on the tpu device; move it with .to('tpu') first")
    if tensor.dim() == 0:
        raise ValueError("torch_tpu.mark_dynamic: a 0-d tensor has no dim to make dynamic")
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"torch_tpu.mark_dynamic: dim {dim} is out of range for a {tensor.dim()}-d tensor")
    d = dim % tensor.dim()
    real = int(tensor.shape[d])
    if max is not None and max < real:
        raise ValueError(f"torch_tpu.mark_dynamic: max={max} is below the current size {real} of dim {d}")
    if min is not None and min > real:
        raise ValueError(f"torch_tpu.mark_dynamic: min={min} is above the current size {real} of dim {d}")
    _install()
    known = _info(tensor)
    if known is not None:
        if known[0] != d:
            raise ValueError(f"torch_tpu.mark_dynamic: dim {known[0]} of this tensor is already dynamic "
                             "(one dynamic dim per tensor)")
        return tensor
    if tensor.is_contiguous() and any(n != 1 for n in tensor.shape[:d]) and not _warned[0]:
        _warned[0] = True
        warnings.warn(f"torch_tpu.mark_dynamic: dim {d} has a dim of size > 1 before it (shape {tuple(tensor.shape)}): "
                      "the padded tensor and results of ops on it are not contiguous (`.view` may refuse them; "
                      "`.reshape`/`.contiguous()` work). Mark the outermost varying dim (batch 1) to keep them "
                      "contiguous.", stacklevel=2)
    padded = list(tensor.shape)
    padded[d] = next_bucket(real, max)
    buf = torch.zeros(padded, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        buf.narrow(d, 0, real).copy_(tensor)
        tensor.set_(buf.untyped_storage(), 0, tensor.shape, buf.stride())
    torch.ops.torch_tpu._dynamic_mark(tensor, padded, d, -1 if max is None else max)
    return tensor


def _install() -> None:
    if _installed[0]:
        return
    lib = torch.library.Library("torch_tpu", "IMPL")
    lib.impl("_eager_dynamic", _handle, "CompositeExplicitAutograd")
    _LIBS.append(lib)
    _installed[0] = True


_LIBS: list[Any] = []


# -- the handler -------------------------------------------------------------------------------

class _Call:
    """A parsed call text: the op and its arguments with tensor slots."""

    def __init__(self, text: str) -> None:
        qual, overload, args = ast.literal_eval(text)
        ns, name = qual.split("::")
        self.op = getattr(getattr(getattr(torch.ops, ns), name), overload)
        schema = self.op._schema
        self.names = [a.name for a in schema.arguments]
        self.kwarg_only = [a.kwarg_only for a in schema.arguments]
        self.args = [_value(v) for v in args]
        self.why = ""
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self.why = "mutates an argument"
        elif torch.Tag.nondeterministic_seeded in self.op.tags and not (
                "dropout_p" in self.names and self.args[self.names.index("dropout_p")] in (0, 0.0)):
            self.why = "random op"  # attention with dropout_p == 0 draws nothing
        elif any(isinstance(v, torch.device) and v.type != "tpu" for v in self.args):
            self.why = "moves to another device"
        self.variants: dict[tuple, list[Any]] = {}
        self.traces = _TRACES.setdefault(str(self.op), [0])  # shared by every call text of the op

    def bind(self, tensors: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for name, ko, v in zip(self.names, self.kwarg_only, self.args, strict=True):
            v = _fill(v, tensors)
            if ko:
                kwargs[name] = v
            else:
                args.append(v)
        return args, kwargs


class _Slot:
    def __init__(self, i: int) -> None:
        self.i = i


def _value(v: Any) -> Any:
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
        tag, x = v
        if tag == "T":
            return _Slot(x)
        if tag == "L":
            return [None if e is None else _value(e) for e in x]
        if tag == "dtype":
            if x not in _DTYPES:
                raise _Decline(f"dtype {x}")
            return _DTYPES[x]
        if tag == "layout":
            if x != 0:
                raise _Decline("non-strided layout")
            return torch.strided
        if tag == "mf":
            return _FORMATS[x]
        if tag == "dev":
            return torch.device(x)
        if tag == "f":
            return float(x)
    if isinstance(v, list):
        return [_value(e) for e in v]
    return v


def _fill(v: Any, tensors: list[Any]) -> Any:
    if isinstance(v, _Slot):
        return tensors[v.i]
    if isinstance(v, list):
        return [_fill(e, tensors) for e in v]
    return v


_CALLS: dict[str, _Call | str] = {}
_TRACES: dict[str, list[int]] = {}


def _handle(text: str, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Runs one op that reads a dynamic storage; [] declines (the normal path runs it)."""
    call = _CALLS.get(text)
    if call is None:
        try:
            call = _Call(text)
        except _Decline as e:
            call = str(e)
        except Exception as e:  # noqa: BLE001 - an argument the parser does not know
            call = f"arguments: {type(e).__name__}: {e}"
        if len(_CALLS) >= _MAX_CALL_TEXTS:  # bounded: start over (traces are rebuilt on demand)
            _CALLS.clear()
        _CALLS[text] = call
    if isinstance(call, str):
        torch.ops.torch_tpu._dynamic_decline()
        return _decline(text[: text.find("[")].strip("(,"), call)
    if call.why:
        torch.ops.torch_tpu._dynamic_decline()
        return _decline(call.op, call.why)
    try:
        return _run(call, list(tensors))
    except _Decline as e:
        return _decline(call.op, str(e))


def _decline(op: Any, why: str) -> list[torch.Tensor]:
    EAGER["declined_calls"] += 1
    EAGER["declined"].setdefault(str(op), why)
    return []


def _results(out: Any) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [o if isinstance(o, torch.Tensor) else torch.tensor(int(o), dtype=torch.int64) for o in outs]


def _run(call: _Call, tensors: list[Any]) -> list[torch.Tensor]:
    # Classify the tensor arguments: dynamic prefix views, other views of dynamic storages (copied
    # out at a runtime offset), plain tensors.
    dyn: dict[int, tuple[int, int | None, torch.Tensor]] = {}  # slot -> (dim, max, bucket-extent view)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):  # None, or a wrapped Python number (it comes back as one)
            continue
        if t.device.type != "tpu":  # CPU index tensors / 0-d operands: the normal path moves or refuses them
            raise _Decline(f"a {t.device.type} tensor argument")
        info = _info(t)
        if info is None:
            continue
        d, hi, padded = info
        found = _dynamic_view(t, d, padded)
        if found is not None:
            dyn[i] = (found[0], hi, found[1])
        else:
            tensors[i] = _gather(t, padded)
    if not dyn:
        if FAST[0]:  # later calls gather in C++ and run the op normally
            torch.ops.torch_tpu._dynamic_passthrough()
        args, kwargs = call.bind(tensors)
        return _results(call.op(*args, **kwargs))
    # One symbol per distinct real size (equal sizes share it, as Dynamo's duck sizing does).
    sizes = sorted({int(tensors[i].shape[d]) for i, (d, _, _) in dyn.items()})
    group = {v: k for k, v in enumerate(sizes)}
    key = tuple(((type(t), t) if not isinstance(t, torch.Tensor) else
                 (t.dtype, str(t.device), tuple(t.shape), tuple(t.stride())) if i not in dyn else
                 (t.dtype, str(t.device), dyn[i][0], group[int(t.shape[dyn[i][0]])], dyn[i][1],
                  tuple(s for k, s in enumerate(t.shape) if k != dyn[i][0]), tuple(t.stride()),
                  t.storage_offset(), tuple(dyn[i][2].shape)))
                for i, t in enumerate(tensors))
    values = {k: v for v, k in group.items()}
    variants = call.variants.setdefault(key, [])
    entry = next((v for v in variants if v.admits(values)), None)
    if entry is None:
        if len(variants) >= _MAX_VARIANTS:
            raise _Decline(f"sizes specialize the trace ({_MAX_VARIANTS} variants)")
        if call.traces[0] >= _MAX_TRACES_PER_OP:
            raise _Decline(f"more than {_MAX_TRACES_PER_OP} distinct argument sets (a changing Python scalar?)")
        call.traces[0] += 1
        entry = _Traced(call, tensors, dyn, group)
        variants.append(entry)
    if entry.why:
        if not entry.guards:  # declines whatever the sizes: C++ stops asking for this key
            torch.ops.torch_tpu._dynamic_decline()
        raise _Decline(entry.why)
    return entry.run(tensors, dyn)


class _Traced:
    """One trace of an op with symbolic dynamic sizes, run by a DynamicGraph."""

    def __init__(self, call: _Call, tensors: list[Any], dyn: dict[int, Any], group: dict[int, int]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
        from torch.utils._sympy.printers import PythonPrinter

        from torch_tpu._internal import dynamic_shapes as ds
        from torch_tpu._internal.compile import _Program, lowered_ops_stay_whole
        from torch_tpu._internal.xla_options import current, encode

        EAGER["traces"] += 1
        self.why = ""
        self.layout_op = call.op in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)
        self.slots = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor)]
        env = ShapeEnv(duck_shape=False)
        fake = FakeTensorMode(shape_env=env)
        from torch._dynamo.source import ConstantSource

        syms: dict[int, Any] = {}
        for size, k in group.items():
            s = env.create_symbol(size, source=ConstantSource(f"e{k}"), dynamic_dim=DimDynamic.DYNAMIC)
            syms[k] = env.create_symintnode(s, hint=size, source=ConstantSource(f"e{k}"))
        self.symbols = {k: v.node.expr for k, v in syms.items()}
        fakes = []
        with fake:
            for i in self.slots:
                t = tensors[i]
                if i in dyn:
                    d = dyn[i][0]
                    shape = list(t.shape)
                    shape[d] = syms[group[int(t.shape[d])]]
                    fakes.append(torch.empty(shape, dtype=t.dtype, device=t.device))
                else:
                    fakes.append(torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device))
        slots = self.slots

        def fn(*xs: torch.Tensor) -> list[Any]:
            full: list[Any] = list(tensors)  # scalars stay as given
            for i, x in zip(slots, xs, strict=True):
                full[i] = x
            args, kwargs = call.bind(full)
            out = call.op(*args, **kwargs)
            return list(out) if isinstance(out, (tuple, list)) else [out]

        self.guards: list[Callable[..., bool]] = []
        try:
            with lowered_ops_stay_whole():
                gm = make_fx(fn, tracing_mode="symbolic", decomposition_table={})(*fakes)
        except Exception as e:  # noqa: BLE001 - the op's meta needs a concrete size, ...
            self.why = f"trace: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            return
        # The sizes the trace assumed (Eq(e0, 5) when the op compared e0 with a static size):
        # later calls must satisfy them, else they get their own trace.
        names = {v: f"_s{k}" for k, v in self.symbols.items()}
        exprs = [g.expr for g in env.guards] + [
            __import__("sympy").Eq(s, r) for s, r in env.replacements.items() if s in names]
        printer = PythonPrinter()
        self.guard_exprs = exprs
        for ex in exprs:
            free = sorted(ex.free_symbols, key=str)
            if not set(free) <= set(names):
                self.why = f"trace guard on an unknown size: {ex}"
                return
            code = printer.doprint(ex.xreplace({s: __import__("sympy").Symbol(names[s]) for s in free}))
            self.guards.append(eval(f"lambda {', '.join(names.values()) or '_'}: bool({code})",  # noqa: S307
                                    {"math": math}))
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        for o in out_node.args[0]:
            v = o.meta.get("val") if isinstance(o, torch.fx.Node) else o
            if len(ds._dyn(v)) > 1:
                self.why = "a result with two dynamic dims"
                return
        if not ds.is_dynamic(gm):
            self.why = "the trace specialized every size"
            return
        xla = encode(current())
        name = f"eager.{call.op}"
        self.graph = ds.DynamicGraph(gm, fakes, lambda g, ins, nm: _Program(g, ins, xla, nm), name, xla)
        if self.graph.unpadded:
            self.why = self.graph.unpadded
            return
        # max= of the marks bounds the buckets of their symbols.
        for i, (d, hi, _) in dyn.items():
            s = self.symbols[group[int(tensors[i].shape[d])]]
            if hi is not None and s in self.graph.upper:
                old = self.graph.upper[s]
                self.graph.upper[s] = hi if old is None else min(old, hi)
        # Per result: ("int", -, its value, -) | ("dyn", dim, its real size, max) | ("plain", ...),
        # and the size expression (for the fast path's plan).
        self.out_plan: list[tuple[str, int, Any, int | None]] = []
        self.out_exprs: list[Any] = []
        for v in self.graph.out_vals:
            if ds._free(v):
                self.out_plan.append(("int", 0, ds.evaluator(v.node.expr), None))
                self.out_exprs.append(v.node.expr)
            elif ds._dyn(v):
                (d, e), = ds._dyn(v).items()
                hi = min((self.graph.upper[s] for s in e.free_symbols
                          if self.graph.upper.get(s) is not None), default=None)
                self.out_plan.append(("dyn", d, ds.evaluator(e), hi))
                self.out_exprs.append(e)
            else:
                self.out_plan.append(("plain", 0, None, None))
                self.out_exprs.append(0)
        self.plans: dict[tuple, Any] = {}  # (bucket, precision) -> fast-path plan (None: cannot express it)

    def admits(self, values: dict[int, int]) -> bool:
        if len(values) != len(self.symbols):
            return False
        vals = [values[k] for k in sorted(self.symbols)]
        return all(g(*vals) for g in self.guards)

    def run(self, tensors: list[Any], dyn: dict[int, Any]) -> list[torch.Tensor]:
        args = [tensors[i] for i in self.slots]
        buffers = [dyn[i][2] if i in dyn else None for i in self.slots]
        got = self.graph.run_padded(args, buffers)
        if got is None:
            self.why = self.graph.unpadded
            raise _Decline(self.why)
        outs, values = got
        EAGER["bucketed_calls"] += 1
        if FAST[0]:
            self._register(args, buffers, values, dyn)
        result: list[torch.Tensor] = []
        for o, (kind, d, size, hi) in zip(outs, self.out_plan, strict=True):
            if kind == "int":
                result.append(torch.tensor(size(values), dtype=torch.int64))
            elif kind == "dyn" and isinstance(o, torch.Tensor):
                v = o.narrow(d, 0, size(values))
                if self.layout_op and o.is_contiguous() and not v.is_contiguous():
                    # clone/contiguous/to promise a contiguous result (`.contiguous().view(..)`); a
                    # prefix view with a non-1 dim before d is not: a compact copy (exact size).
                    result.append(v.contiguous())
                    continue
                _mark_buffer(o, d, hi)
                result.append(v)
            elif isinstance(o, torch.Tensor):
                result.append(o)
            elif o is None:  # an undefined optional result (attention's unused outputs)
                result.append(torch.empty(0, device=args[0].device if args else "tpu"))
            else:
                result.append(torch.tensor(int(o), dtype=torch.int64))
        return result


    def _register(self, args: list[Any], buffers: list[Any], values: dict[Any, int], dyn: dict[int, Any]) -> None:
        """Hands the C++ fast path the plan of this call (the program of its bucket, how to check
        that a later call takes the same program, how to shape the results), for the call key C++
        computed before this call reached Python."""
        g = self.graph
        b = g._buckets(values, args, buffers)
        bucket = tuple(b[s] for s in g.symbols + g.int_symbols)
        from torch_tpu import _C

        precision = _C._matmul_precision()  # the program for the contraction precision now
        plan = self.plans.get((bucket, precision), False)
        if plan is False:
            plan = self.plans[(bucket, precision)] = _plan(self, b, bucket, buffers, [i in dyn for i in self.slots],
                                                           precision)
        if plan is not None:
            torch.ops.torch_tpu._dynamic_plan(*plan)


def _poly(e: Any, groups: dict[Any, int]) -> list[int] | None:
    """A size expression as the fast path's polynomial over the call's size groups:
    [terms, constant, (coefficient, factors, group...)...]; None when it is not a polynomial
    with integer coefficients (FloorDiv, Mod, ...: such calls stay on the Python path)."""
    import sympy

    e = sympy.expand(sympy.sympify(e))
    const, terms = 0, []
    for t in sympy.Add.make_args(e):
        coef, rest = t.as_coeff_Mul()
        if not coef.is_Integer:
            return None
        if rest == 1:
            const += int(coef)
            continue
        fs: list[int] = []
        for f in sympy.Mul.make_args(rest):
            base, exp = f.as_base_exp()
            if base not in groups or not exp.is_Integer or int(exp) < 1:
                return None
            fs += [groups[base]] * int(exp)
        terms.append([int(coef), len(fs), *fs])
    return [len(terms), const] + [x for t in terms for x in t]


def _plan(entry: _Traced, b: dict[Any, int], bucket: tuple, buffers: list[Any], is_dyn: list[bool],
          precision: int) -> tuple[int, int, list[torch.Tensor], list[int]] | None:
    """The arguments of torch_tpu::_dynamic_plan for one bucket of a trace, or None when the fast
    path cannot run it (inputs padded per call, an int-valued symbol, an unusual expression)."""
    import sympy

    g = entry.graph
    if g.int_symbols or ("padded", bucket) not in g.programs:
        return None
    tensor_idx, prog = g.programs[("padded", bucket)]
    if list(tensor_idx) != list(range(len(buffers))):
        return None
    groups = {e: k for k, e in entry.symbols.items()}
    data: list[int] = [len(g.symbols)]
    for s in g.symbols:
        data += [groups[s], -1 if g.upper[s] is None else g.upper[s], b[s]]
    caps: list[int] = []
    for pos, (buf, dynamic) in enumerate(zip(buffers, is_dyn, strict=True)):
        vd = g.val_dyn[pos]
        if not dynamic:
            if vd:
                return None
            continue
        if len(vd) != 1:
            return None  # the trace specialized this size: the program takes the real view
        (j, s), = vd.items()
        if s not in g.symbols or buf.shape[j] != b[s]:
            return None  # padded per call (a buffer smaller than the bucket)
        caps += [g.symbols.index(s), b[s]]
    data += [len(caps) // 2, *caps]
    rels = {sympy.Eq: 0, sympy.Ne: 1, sympy.Lt: 2, sympy.Le: 3, sympy.Gt: 4, sympy.Ge: 5}
    guards: list[int] = []
    for ex in entry.guard_exprs:
        if ex is sympy.true:
            continue
        rel = rels.get(type(ex))
        p = None if rel is None else _poly(ex.lhs - ex.rhs, groups)
        if p is None:
            return None
        guards += [rel, *p]
    data += [len(entry.guard_exprs) - sum(ex is sympy.true for ex in entry.guard_exprs), *guards]
    limits: list[int] = []
    for real, pieces in g.constraints:
        p = _poly(real, groups)
        caps_at_b = [sympy.sympify(sympy.sympify(x).xreplace(b)) for x in pieces]
        if p is None or not all(c.is_Integer for c in caps_at_b):
            return None
        limits += [*p, max(int(c) for c in caps_at_b)]
    data += [len(g.constraints), *limits]
    outs: list[int] = [len(entry.out_plan)]
    if len(prog.spec) != len(entry.out_plan):
        return None
    for (kind, v), (okind, d, _, hi), e in zip(prog.spec, entry.out_plan, entry.out_exprs, strict=True):
        if kind == "out":
            spec = [0, v]
        elif kind == "input":
            spec = [1, v]
        elif v is None:
            spec = [2, 0]
        elif isinstance(v, int) and not isinstance(v, bool):
            spec = [3, v]  # a constant int result (attention's max_q when it is static)
        else:
            return None
        p = _poly(e, groups)
        if p is None:
            return None
        outs += [*spec, {"int": 0, "dyn": 1, "plain": 2}[okind], d, *p, -1 if hi is None else hi]
    data += outs
    data.append(1 if entry.layout_op else 0)
    gid = prog.gid if precision == prog.desc["precision"] else prog._program_for(precision)
    return gid, precision, list(prog.consts), data


def _mark_buffer(o: torch.Tensor, d: int, hi: int | None) -> None:
    """Registers a bucket-sized result as dynamic along d. A result laid out as a permutation
    (pointwise ops keep their input's layout) is registered in memory order."""
    if o.dim() == 0 or o.storage_offset() != 0:
        return
    perm = sorted(range(o.dim()), key=lambda k: (-o.stride(k), k))
    mem = o.permute(perm)
    if not mem.is_contiguous() or mem.numel() * o.element_size() != o.untyped_storage().nbytes():
        return
    torch.ops.torch_tpu._dynamic_mark(o, list(mem.shape), perm.index(d), -1 if hi is None else hi)


def _dynamic_view(t: torch.Tensor, d: int, padded: list[int]) -> tuple[int, torch.Tensor] | None:
    """When view t reads a prefix (from 0) of the dynamic dim d of its padded buffer through one of
    its dims j (and its other dims stay off d): (j, the same view with dim j extended to the
    buffer's capacity). Its real size is t.shape[j]: any prefix is a valid real size."""
    strides = _contiguous(padded)
    sd, cap = strides[d], padded[d]
    outer = sd * cap
    if (t.storage_offset() // sd) % cap != 0:
        return None
    j = None
    for k, (n, st) in enumerate(zip(t.shape, t.stride(), strict=True)):
        if n == 0:
            return None
        if n == 1:
            continue
        if st == sd and j is None:
            j = k
        elif not ((st < sd and (n - 1) * st < sd) or st % outer == 0):
            return None  # this dim moves along d too
    if j is None or not 2 <= t.shape[j] <= cap:
        return None
    size = list(t.shape)
    size[j] = cap
    return j, t.as_strided(size, t.stride(), t.storage_offset())


_GATHERS: dict[tuple, Any] = {}


def _gather(t: torch.Tensor, padded: list[int]) -> torch.Tensor:
    """A copy of a view of a dynamic storage, read at its offset as a runtime operand (one program
    per padded buffer and view layout, whatever the offset)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_tpu._internal.compile import _Program
    from torch_tpu._internal.xla_options import current, encode

    buf = t.as_strided(padded, _contiguous(padded), 0)
    key = (t.dtype, str(t.device), tuple(padded), tuple(t.shape), tuple(t.stride()))
    prog = _GATHERS.get(key)
    numel = math.prod(padded)
    if prog is None:
        size, stride = list(t.shape), list(t.stride())

        def fn(b: torch.Tensor, off: torch.Tensor) -> list[torch.Tensor]:
            idx = off
            for k, (n, st) in enumerate(zip(size, stride, strict=True)):
                shape = [1] * len(size)
                shape[k] = n
                idx = idx + torch.arange(n, device=b.device).reshape(shape) * st
            idx = torch.clamp(idx, 0, numel - 1)  # never outside the buffer, whatever the offset
            return [b.reshape(-1)[idx]]

        example = torch.empty((), dtype=torch.int64, device=t.device)
        gm = make_fx(fn, tracing_mode="fake", decomposition_table={})(buf, example)
        prog = _GATHERS[key] = _Program(gm, [buf, example], encode(current()),
                                        f"eager.gather[{'x'.join(map(str, padded))}]")
    EAGER["gathers"] += 1
    if FAST[0]:
        torch.ops.torch_tpu._dynamic_gather_plan(t, prog.gid, list(prog.consts))
    return prog([buf, torch.tensor(t.storage_offset(), dtype=torch.int64)])[0]
