"""Bounded dynamic shapes for `torch.compile(backend="tpu")`: one Dynamo graph, a few programs.

When Dynamo hands over a graph with symbolic sizes (automatic dynamic after a size changed,
`dynamic=True`, `torch._dynamo.mark_dynamic`), the backend keeps it symbolic (it never
specializes a SymInt, so Dynamo installs no per-size guard) and picks a program per call:

- padded (the normal case): each size symbol gets a bucket, the smallest power of two >= its
  value (at least BUCKET_MIN, at most the symbol's upper bound, e.g. mark_dynamic's max=). The
  graph is re-traced at the bucket sizes with an FX interpreter that knows, per value, which dims
  are padded: the real data is the prefix, the real sizes are runtime 0-d inputs of the program
  (so one program serves every size in its bucket). Ops whose result would see the padding get
  masks: reductions/softmax/matmul over a padded dim use the identity, attention masks padded
  keys with -inf, a cat along a padded dim writes each piece at its real offset (index_copy).
  Outputs are prefix views of the padded buffers; when such a view comes back as an input (a KV
  cache), its buffer is passed as is, so steady-state steps copy nothing.
- exact: the graph re-traced at the call's concrete sizes, one program per size. Used when the
  graph has an op outside the padding whitelist (`reason` says which); correct, just more programs.

`BUCKETS` (in torch_tpu.compile_stats()["dynamic"]) records the bucket each program serves; the
program names in torch_tpu.explain() carry it too (`graph3[s0<=32]`).
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx

BUCKET_MIN = 16
_INT_MAX = 2**62

# One entry per program built for a dynamic graph: {"graph", "kind": "padded" | "exact",
# "bucket": {symbol: padded size} (exact: the sizes), "reason": why not padded ("" if padded)}.
BUCKETS: list[dict[str, Any]] = []

aten = torch.ops.aten

# Padded programs by (XLA options, padded graph code, input types), shared by the dynamic graphs.
_SHARED: dict[tuple, Any] = {}


def _free(v: Any) -> bool:
    return isinstance(v, torch.SymInt) and bool(v.node.expr.free_symbols)


def is_dynamic(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph's inputs have symbolic sizes (or are size symbols)."""
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if _free(v) or (isinstance(v, torch.Tensor) and any(_free(s) for s in v.shape)):
            return True
    return False


def _expr(s: Any) -> sympy.Expr:
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


def _dyn(v: Any) -> dict[int, sympy.Expr]:
    """Dims of a traced value whose size is symbolic: dim -> size expression."""
    if not isinstance(v, torch.Tensor):
        return {}
    return {d: s.node.expr for d, s in enumerate(v.shape) if _free(s)}


_FNS: dict[sympy.Expr, Callable[[dict[sympy.Symbol, int]], int]] = {}


def evaluator(e: sympy.Expr) -> Callable[[dict[sympy.Symbol, int]], int]:
    """A size expression as a plain Python function of the symbol values (built once per
    expression): sympy's xreplace on every call cost ~0.5 ms per compiled call."""
    f = _FNS.get(e)
    if f is None:
        syms = sorted(e.free_symbols, key=str)
        try:
            from torch.utils._sympy.printers import PythonPrinter

            names = [f"_v{i}" for i in range(len(syms))]
            code = PythonPrinter().doprint(e.xreplace(dict(zip(syms, map(sympy.Symbol, names), strict=True))))
            g = eval(f"lambda {', '.join(names)}: {code}", {"math": math})  # noqa: S307 - our own expression
            probe = {s: 7 + 3 * i for i, s in enumerate(syms)}
            if int(g(*[probe[x] for x in syms])) != int(e.xreplace(probe)):
                raise ValueError(code)

            def f(vals: dict[sympy.Symbol, int], g: Any = g, syms: list = syms) -> int:
                return int(g(*[vals[x] for x in syms]))
        except Exception:  # noqa: BLE001 - an expression the printer cannot spell: sympy it is
            def f(vals: dict[sympy.Symbol, int], e: sympy.Expr = e) -> int:
                return int(e.xreplace(vals))
        _FNS[e] = f
    return f


def next_bucket(v: int, hi: int | None) -> int:
    b = max(BUCKET_MIN, 1 << max(0, v - 1).bit_length())
    return max(v, min(b, hi)) if hi is not None else b


class Unpaddable(Exception):
    """An op the padded trace cannot express: the graph runs as exact-size programs."""


class _Real:
    """Real sizes inside the padded trace: a size expression -> a 0-d int64 tensor."""

    def __init__(self, tensors: dict[sympy.Symbol, torch.Tensor | int]) -> None:
        self.tensors = tensors

    def of(self, e: sympy.Expr) -> torch.Tensor | int:
        if e.is_Integer:
            return int(e)
        if isinstance(e, sympy.Symbol):
            return self.tensors[e]
        if isinstance(e, sympy.Add):
            parts = [self.of(a) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = out + p
            return out
        if isinstance(e, sympy.Mul):
            parts = [self.of(a) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = out * p
            return out
        raise Unpaddable(f"size expression {e}")


def _keep(x: torch.Tensor, d: int, real: torch.Tensor | int) -> torch.Tensor:
    """Boolean mask, broadcastable to x, true on the real prefix of dim d."""
    n = x.shape[d]
    shape = [1] * x.dim()
    shape[d] = n
    return (torch.arange(n, device=x.device) < real).reshape(shape)


_LAYOUT = {aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default,
           aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
           aten.alias.default, aten.clone.default, aten._to_copy.default, aten.detach.default,
           aten.lift_fresh_copy.default, torch.ops.prims.convert_element_type.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_FACTORY = {aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default,
            aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default,
            aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
            aten.empty_strided.default, aten.arange.default}
_REDUCE_FILL = {aten.sum.dim_IntList: 0.0, aten.sum.default: 0.0, aten.amax.default: -math.inf, aten.amin.default: math.inf,
                aten._softmax.default: -math.inf, aten._log_softmax.default: -math.inf,
                aten.max.default: -math.inf, aten.min.default: math.inf,
                aten.argmax.default: -math.inf, aten.argmin.default: math.inf}
_SYM_OPS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg,
            aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, torch.sym_max, torch.sym_min}


def _prod(xs: Sequence[sympy.Expr]) -> sympy.Expr:
    return sympy.expand(sympy.Mul(*xs)) if xs else sympy.Integer(1)


def _view_map(src: torch.Tensor, out: torch.Tensor) -> dict[int, tuple[int, int, int]] | None:
    """How a view keeps the real data a prefix: for each symbolic output dim j, (input dim i,
    multiplier, divisor) of its physical size, or None when it does not. Allowed: the dim kept
    whole, merged with static dims after it, or split into itself and static dims after it
    (always with the same number of elements before it)."""
    ins = [_expr(s) for s in src.shape]
    outs = [_expr(s) for s in out.shape]
    din, dout = _dyn(src), _dyn(out)
    if len(din) != len(dout):
        return None

    def same(a: sympy.Expr, b: sympy.Expr) -> bool:
        return sympy.expand(a - b) == 0

    def static_run(dims: list[sympy.Expr], start: int, want: sympy.Expr, base: sympy.Expr) -> int | None:
        prod = sympy.Integer(1)
        for k in range(start, len(dims) + 1):
            if same(base * prod, want):
                return int(prod)
            if k == len(dims) or dims[k].free_symbols:
                return None
            prod = prod * dims[k]
        return None

    out_map: dict[int, tuple[int, int, int]] = {}
    for j, e in dout.items():
        pre = _prod(outs[:j])
        for i in din:
            if not same(_prod(ins[:i]), pre):
                continue
            merged = static_run(ins, i + 1, e, ins[i])  # e == ins[i] * static dims after i
            if merged is not None:
                out_map[j] = (i, merged, 1)
                break
            split = static_run(outs, j + 1, ins[i], e)  # ins[i] == e * static dims after j
            if split is not None:
                out_map[j] = (i, 1, split)
                break
        else:
            return None
    return out_map


def _nodes_in(v: Any) -> set[torch.fx.Node]:
    if isinstance(v, torch.fx.Node):
        return {v}
    if isinstance(v, (list, tuple)):
        return set().union(*(_nodes_in(e) for e in v)) if v else set()
    return set()


def _shape_arg_nodes(n: torch.fx.Node) -> set[torch.fx.Node]:
    """Size nodes a call uses only as a shape (a padded size is right there); a size anywhere
    else is a value, which must be the real one."""
    t, args = n.target, n.args
    if t in _VIEWS or t is aten.expand.default:
        return _nodes_in(args[1]) if len(args) > 1 else set()
    if t in (aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default):
        return _nodes_in(args[0]) if args else set()
    if t is aten.empty_strided.default:
        return _nodes_in(args[:2])
    if t in (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default):
        return _nodes_in(args[1]) if len(args) > 1 else set()
    if t is aten.slice.Tensor and len(args) > 3:
        src = args[0].meta.get("val") if isinstance(args[0], torch.fx.Node) else None
        dim = args[1] if len(args) > 1 else 0
        if isinstance(src, torch.Tensor) and dim % src.dim() in _dyn(src):
            return _nodes_in(args[3])  # the end of a prefix
    return set()


def _draws_random(op: Any, args: Any, kwargs: Any) -> bool:
    from torch_tpu._internal.compile import _draws_random as draws

    return draws(op, args, kwargs)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


class _PaddedInterpreter(torch.fx.Interpreter):
    """Runs the symbolic graph on buffers padded to the bucket (under make_fx): per node, the real
    size of each dim comes from the node's symbolic meta, the physical one from the buffer."""

    def __init__(self, gm: torch.fx.GraphModule, real: _Real, padded: set[sympy.Symbol],
                 phys: Callable[[sympy.Expr], int]) -> None:
        super().__init__(gm)
        self.real = real
        self.padded = padded  # the bucketed symbols
        self.phys = phys  # physical (padded) size of a size expression

    def run_node(self, n: torch.fx.Node) -> Any:
        self._node = n
        try:
            return super().run_node(n)
        except Unpaddable as e:
            raise Unpaddable(f"{n.name} ({n.target}): {_first_line(e)}") from None
        except Exception as e:  # shape mismatch of padded buffers, ...: not expressible padded
            raise Unpaddable(f"{n.name} ({n.target}): {type(e).__name__}: {_first_line(e)}") from None

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        n = self._node
        vals = [a.meta.get("val") for a in n.all_input_nodes]
        dyn_in = any(_dyn(v) for v in vals)
        out_val = n.meta.get("val")
        if target is operator.getitem:
            return target(*args, **kwargs)
        if _free(out_val) and out_val.node.expr.free_symbols & self.padded:
            return self.phys(out_val.node.expr)  # a padded size: the buffers' size, whatever op made it
        if target in _SYM_OPS:
            return target(*args, **kwargs)
        sym_args = [a for a in n.all_input_nodes if _free(a.meta.get("val"))
                    and a.meta["val"].node.expr.free_symbols & self.padded]
        if sym_args and isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags \
                and not kwargs:
            # A size as an operand (mean's backward divides by it): its real value, as a 0-d tensor.
            args = tuple(self.real.of(a.meta["val"].node.expr) if a in sym_args else v
                         for a, v in zip(n.args, args, strict=True))
            if not any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in args):
                raise Unpaddable("a size is used as a value")
            if target._overloadname == "Scalar" and hasattr(target.overloadpacket, "Tensor"):
                target = target.overloadpacket.Tensor  # div.Scalar(x, n) -> div.Tensor(x, n)
        elif sym_args and set(sym_args) - _shape_arg_nodes(n):
            raise Unpaddable("a size is used as a value")
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags \
                and (dyn_in or _dyn(out_val)) and _draws_random(target, n.args, n.kwargs):
            raise Unpaddable("random op on padded data (its random stream depends on the size)")
        if target is aten.copy_.default and (dyn_in or _dyn(out_val)):
            raise Unpaddable("in-place update of a padded input")
        if target is aten.arange.default and len(args) > 0 and not isinstance(args[0], int):
            pass  # arange(s): an iota of the bucket, its real prefix is right
        if not dyn_in:
            return target(*args, **kwargs)
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            return target(*args, **kwargs)
        if target in _LAYOUT or target in _FACTORY:
            return target(*args, **kwargs)
        if target is aten.embedding.default:
            w, idx = args[0], args[1]
            if _dyn(n.args[0].meta["val"]):
                raise Unpaddable("embedding table with a symbolic size")
            # padded positions may hold any index: keep them inside the table
            return target(w, torch.clamp(idx, 0, w.shape[0] - 1), *args[2:], **kwargs)
        if target is aten.index_select.default:
            x, d, idx = args[0], args[1] % vals[0].dim(), args[2]
            if d in _dyn(vals[0]):
                raise Unpaddable("index_select along a symbolic dim")  # an index past the real size must raise
            vi = n.args[2].meta["val"]
            if 0 in _dyn(vi):  # padded positions of the index hold anything: read row 0 there
                idx = torch.where(_keep(idx, 0, self.real.of(_dyn(vi)[0])), idx, torch.zeros((), dtype=idx.dtype,
                                                                                              device=idx.device))
            return target(x, d, idx)
        if target in _VIEWS:
            vmap = _view_map(n.args[0].meta["val"], out_val)
            if vmap is None:
                raise Unpaddable("view moves a symbolic dim inside a merged or split dim")
            x = args[0]
            shape = [x.shape[i] * mul // div if j in vmap else int(s) for j, s in enumerate(out_val.shape)
                     for i, mul, div in [vmap.get(j, (0, 1, 1))]]
            return target(x, shape)
        if target is aten.slice.Tensor:
            return self._slice(n, args, kwargs)
        if target is aten.select.int:
            d = args[1] % vals[0].dim()
            if d in _dyn(vals[0]) and not (isinstance(args[2], int) and args[2] >= 0):
                raise Unpaddable("select along a symbolic dim from its end")  # [i >= 0] is in the prefix
            return target(*args, **kwargs)
        if target is aten.cat.default:
            return self._cat(n, args, kwargs)
        if target is aten.index.Tensor:
            return self._index(n, args)
        if target is aten.native_layer_norm.default:
            src = n.args[0].meta["val"]
            if any(d >= src.dim() - len(args[1]) for d in _dyn(src)):
                raise Unpaddable("layer norm over a symbolic dim")
            return target(*args, **kwargs)  # rows are normalized independently
        if target in _REDUCE_FILL or target in (aten.mean.dim, aten.mean.default):
            return self._reduce(n, target, args, kwargs)
        if target in (aten.cumsum.default, aten.cumprod.default):
            return target(*args, **kwargs)  # element i sees only elements <= i: padding comes after
        if target in (aten.all.default, aten.any.default, aten.all.dim, aten.any.dim, aten.all.dims, aten.any.dims):
            src = n.args[0].meta["val"]
            raw = args[1] if len(args) > 1 else kwargs.get("dim")
            dims = list(range(src.dim())) if raw in (None, []) else [d % src.dim() for d in (
                raw if isinstance(raw, (list, tuple)) else [raw])]
            x = args[0]
            for d in dims:  # padded entries become the identity (True for all, False for any)
                if d in _dyn(src):
                    x = torch.where(_keep(x, d, self.real.of(_dyn(src)[d])), x,
                                    torch.full((), target.overloadpacket is aten.all, dtype=x.dtype, device=x.device))
            return target(x, *args[1:], **kwargs)
        if target in (aten.mm.default, aten.bmm.default):
            return self._matmul(n, target, args)
        if target is aten.addmm.default and not kwargs:
            mm = self._matmul(n, aten.mm.default, args[1:3], first=1)
            return args[0] + mm  # beta = alpha = 1 (what a Linear traces to)
        if target in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
            grad, out, d = args[0], args[1], args[2] % args[0].dim()
            vg, vo = n.args[0].meta["val"], n.args[1].meta["val"]
            if d in _dyn(vg):
                grad = self._masked(grad, vg, [d], 0.0)
                if target is aten._softmax_backward_data.default:
                    out = self._masked(out, vo, [d], 0.0)
            return target(grad, out, *args[2:])
        if target is aten._scaled_dot_product_fused_attention_overrideable.default:
            return self._sdpa(n, args, kwargs)
        raise Unpaddable(f"no padded rule for {target}")

    def _slice(self, n: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        src = n.args[0].meta["val"]
        x = args[0]
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.dim()
        if dim not in _dyn(src):
            start = args[2] if len(args) > 2 else kwargs.get("start")
            end = args[3] if len(args) > 3 else kwargs.get("end")
            step = args[4] if len(args) > 4 else kwargs.get("step", 1)
            return aten.slice.Tensor(x, dim, start, end, step)
        start = n.args[2] if len(n.args) > 2 else n.kwargs.get("start", 0)
        step = n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)
        if start not in (0, None) or step != 1:
            raise Unpaddable("slice of a symbolic dim that does not start at 0")
        return x  # a prefix of the real prefix: same buffer, real size from the node's meta

    def _cat(self, n: torch.fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
        symbolic = _cat_along_symbolic_dim(n)
        if symbolic is None:
            out_val = n.meta["val"]
            return aten.cat.default(list(args[0]), (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out_val.dim())
        # Each piece at its real offset; the capacity is the largest piece's (the bucket chooser
        # made sure the real result fits: _capacity_constraints).
        dim, kept = symbolic
        xs = [args[0][i] for i in kept]
        srcs = [n.args[0][i].meta["val"] for i in kept]
        cap = max(x.shape[dim] for x in xs)
        first = xs[0]
        pad = [0, 0] * (first.dim() - 1 - dim) + [0, cap - first.shape[dim]]
        out = aten.constant_pad_nd.default(first, pad, 0.0) if cap > first.shape[dim] else first
        # Piece i fills rows [offset, offset + real_i): a gather (clamped source rows) and a
        # select, so no index runs outside the buffer (rows after the real data are don't-care).
        offset = self.real.of(_expr(srcs[0].shape[dim]))
        rows = torch.arange(cap, device=first.device)
        shape = [1] * out.dim()
        shape[dim] = cap
        for x, s in zip(xs[1:], srcs[1:], strict=True):
            if x.shape[dim] > cap:
                raise Unpaddable("cat piece larger than the capacity")
            n_real = self.real.of(_expr(s.shape[dim]))
            if not _free(s.shape[dim]):
                # A piece of static size k (a KV cache's new token): k rows written at the offset
                # (a scatter of k rows, not a gather over the whole capacity); they fit, as the
                # real result does.
                k = int(s.shape[dim])
                idx: list[Any] = [None] * out.dim()
                idx[dim] = offset + torch.arange(k, device=first.device)
                out = aten.index_put.default(out, idx, x)
                offset = offset + n_real
                continue
            src = torch.clamp(rows - offset, 0, x.shape[dim] - 1)
            taken = aten.index_select.default(x, dim, src)
            inside = ((rows >= offset) & (rows < offset + n_real)).reshape(shape)
            out = torch.where(inside, taken, out)
            offset = offset + n_real
        return out

    def _index(self, n: torch.fx.Node, args: tuple) -> torch.Tensor:
        """x[i0, i1, ..]: indices into a padded dim count negatives from the real end; every
        index is clamped into the buffer (padded positions of index tensors hold anything)."""
        x, indices = args[0], list(args[1])
        src = n.args[0].meta["val"]
        dyn = _dyn(src)
        fixed: list[Any] = []
        for d, idx in enumerate(indices):
            if idx is None or idx.dtype == torch.bool:
                if idx is not None and d in dyn:
                    raise Unpaddable("boolean mask over a symbolic dim")
                fixed.append(idx)
                continue
            size = x.shape[d]
            if d in dyn:
                idx = torch.where(idx < 0, idx + self.real.of(dyn[d]), idx)
                idx = torch.clamp(idx, 0, size - 1)
            else:
                idx = torch.clamp(idx, -size, size - 1)
            fixed.append(idx)
        return aten.index.Tensor(x, fixed)

    def _masked(self, x: torch.Tensor, src: torch.Tensor, dims: Sequence[int], fill: float) -> torch.Tensor:
        dyn = _dyn(src)
        for d in dims:
            if d in dyn:
                x = torch.where(_keep(x, d, self.real.of(dyn[d])), x, torch.full((), fill, dtype=x.dtype,
                                                                                  device=x.device))
        return x

    def _reduce(self, n: torch.fx.Node, target: Any, args: tuple, kwargs: dict) -> Any:
        src = n.args[0].meta["val"]
        x = args[0]
        if target in (aten._softmax.default, aten._log_softmax.default):
            dims = [args[1] % x.dim()]
        else:
            raw = args[1] if len(args) > 1 else kwargs.get("dim")
            dims = list(range(x.dim())) if raw in (None, []) else [d % x.dim() for d in (
                raw if isinstance(raw, (list, tuple)) else [raw])]
        touched = [d for d in dims if d in _dyn(src)]
        if not touched:
            return target(*args, **kwargs)
        if target in (aten.argmax.default, aten.argmin.default) and len(dims) > 1 and x.dim() > 1:
            raise Unpaddable("flat argmax/argmin over a padded tensor (the flat index counts padding)")
        if target in (aten.mean.dim, aten.mean.default):
            total = aten.sum.default if target is aten.mean.default else aten.sum.dim_IntList
            s = total(self._masked(x, src, touched, 0.0), *args[1:], **kwargs)
            count = 1
            for d in dims:
                count = count * self.real.of(_expr(src.shape[d]))
            return s / count
        fill = _REDUCE_FILL[target]
        if not x.dtype.is_floating_point and fill != 0.0:
            raise Unpaddable("integer max/min over a symbolic dim")
        return target(self._masked(x, src, touched, fill), *args[1:], **kwargs)

    def _matmul(self, n: torch.fx.Node, target: Any, args: tuple, first: int = 0) -> torch.Tensor:
        a, b = args[0], args[1]
        va, vb = n.args[first].meta["val"], n.args[first + 1].meta["val"]
        ka, kb = a.dim() - 1, b.dim() - 2
        if ka in _dyn(va) or kb in _dyn(vb):
            a = self._masked(a, va, [ka], 0.0)
            b = self._masked(b, vb, [kb], 0.0)
        return target(a, b)

    def _sdpa(self, n: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        op = aten._scaled_dot_product_fused_attention_overrideable.default
        names = [a.name for a in op._schema.arguments]
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        q_val, k_val = n.args[0].meta["val"], n.args[1].meta["val"]
        k, q = bound["key"], bound["query"]
        kd = k.dim() - 2
        ed = q.dim() - 1
        if ed in _dyn(q_val):  # padded head dim: zero it in q and k; the default scale needs the real one
            q = self._masked(q, q_val, [ed], 0.0)
            if bound.get("scale") is None:  # the op scales by the padded size: rescale to the real one
                real_e = self.real.of(_dyn(q_val)[ed])
                q = q * (math.sqrt(q.shape[ed]) * torch.rsqrt(torch.as_tensor(real_e, device=q.device).to(q.dtype)))
            bound["query"] = q
            bound["key"] = k = self._masked(k, k_val, [ed], 0.0)
        if kd not in _dyn(k_val):
            return op(**bound)
        if bound.get("is_causal", False):
            qd = q.dim() - 2
            if _dyn(q_val).get(qd) != _dyn(k_val)[kd]:
                raise Unpaddable("causal attention with a padded key length unlike the query's")
            return op(**bound)  # padded keys sit after every real query: causal hides them
        keep = torch.arange(k.shape[kd], device=k.device) < self.real.of(_dyn(k_val)[kd])
        bias = bound.get("attn_bias")
        if bias is None:
            bias = torch.where(keep, torch.zeros((), dtype=q.dtype, device=q.device),
                               torch.full((), -math.inf, dtype=q.dtype, device=q.device))
        elif bias.dtype == torch.bool:
            bias = bias & keep
        else:
            bias = torch.where(keep, bias, torch.full((), -math.inf, dtype=bias.dtype, device=bias.device))
        bound["attn_bias"] = bias
        return op(**bound)


def _capacity_constraints(gm: torch.fx.GraphModule) -> list[tuple[sympy.Expr, list[sympy.Expr]]]:
    """For each cat along a symbolic dim: (real result size, sizes of its pieces); the bucket
    must make the largest padded piece hold the real result."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.cat.default:
            symbolic = _cat_along_symbolic_dim(n)
            if symbolic is not None:
                dim, kept = symbolic
                out.append((_expr(n.meta["val"].shape[dim]),
                            [_expr(n.args[0][i].meta["val"].shape[dim]) for i in kept]))
    return out


def _static_zero(size: Any) -> bool:
    """A size known to be 0 (Dynamo specializes sizes 0 and 1, so a symbolic size is never 0)."""
    return isinstance(size, int) and size == 0


def _cat_along_symbolic_dim(n: torch.fx.Node) -> tuple[int, list[int]] | None:
    """For an aten.cat node along a symbolic dim: (dim, indices of the pieces that take part);
    None when the dim is static. torch.cat skips legacy empty 1-D pieces (DynamicCache starts
    from torch.tensor([])), so they take no part."""
    out_val = n.meta["val"]
    dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % out_val.dim()
    if dim not in _dyn(out_val):
        return None
    pieces = [a.meta["val"] for a in n.args[0]]
    kept = [i for i, p in enumerate(pieces)
            if not (p.dim() == 1 and (out_val.dim() != 1 or _static_zero(p.shape[0])))]
    return dim, kept


class DynamicGraph:
    """The callable for a graph with symbolic sizes: picks (and builds once) the program for each
    call's bucket, pads inputs, and returns the real prefix of the outputs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 build: Callable[[torch.fx.GraphModule, Sequence[Any], str], Any], name: str,
                 cache_key: bytes = b"") -> None:
        self.gm = gm
        self.cache_key = cache_key
        self.build = build
        self.name = name
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.vals = [n.meta.get("val") for n in self.placeholders]
        self.val_dyn = [_dyn(v) for v in self.vals]  # per input: symbolic dim -> size expression
        self._wants: dict[tuple, list[int]] = {}  # (input, bucket) -> padded shape
        # Where each symbol's value is read from: (input index, dim) or (input index, None).
        self.bind: dict[sympy.Symbol, tuple[int, int | None]] = {}
        shape_env = None
        for i, v in enumerate(self.vals):
            if _free(v):
                shape_env = v.node.shape_env
                if isinstance(v.node.expr, sympy.Symbol):
                    self.bind.setdefault(v.node.expr, (i, None))
            elif isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    if _free(s):
                        shape_env = s.node.shape_env
                        if isinstance(s.node.expr, sympy.Symbol):
                            self.bind.setdefault(s.node.expr, (i, d))
        # Sizes of tensor dims are bucketed; symbols only passed as ints (a stride Dynamo made
        # dynamic, a counter) are part of the program key with their exact value.
        dims = {s.node.expr for v in self.vals if isinstance(v, torch.Tensor) for s in v.shape if _free(s)}
        self.symbols = sorted((s for s in self.bind if s in dims), key=str)
        self.int_symbols = sorted((s for s in self.bind if s not in dims), key=str)
        self.upper: dict[sympy.Symbol, int | None] = {}
        for s in self.symbols:
            hi = None
            if shape_env is not None and s in shape_env.var_to_range:
                u = shape_env.var_to_range[s].upper
                hi = int(u) if u.is_Integer else None
            self.upper[s] = hi
        self.constraints = _capacity_constraints(gm)
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        self.out_vals = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in outs]
        # Outputs that are views of an input: AOTAutograd regenerates them from the input with the
        # output's size/stride/offset, so those must be the real view's, not the padded buffer's.
        self.alias_of: dict[int, int] = {}
        from torch.multiprocessing.reductions import StorageWeakRef

        refs = {StorageWeakRef(v.untyped_storage()): i for i, v in enumerate(self.vals)
                if isinstance(v, torch.Tensor)}
        for k, v in enumerate(self.out_vals):
            if isinstance(v, torch.Tensor):
                j = refs.get(StorageWeakRef(v.untyped_storage()))
                if j is not None:
                    self.alias_of[k] = j
        self.unpadded: str = ""  # why this graph runs as exact-size programs ("" while padded)
        unbound = {e for v in self.vals for e in ([v.node.expr] if _free(v) else [
            s.node.expr for s in v.shape if _free(s)] if isinstance(v, torch.Tensor) else [])
            for e in [e] if e.free_symbols - set(self.bind)}
        if unbound:
            self.unpadded = f"input sizes {sorted(map(str, unbound))} are not plain symbols"
        self.programs: dict[tuple, Any] = {}
        self._boxed_call = True

    # -- binding and buckets
    def _values(self, args: Sequence[Any]) -> dict[sympy.Symbol, int]:
        out = {}
        for s, (i, d) in self.bind.items():
            a = args[i]
            out[s] = int(a) if d is None else int(a.shape[d])
        return out

    def _buffer(self, i: int, a: Any, buffers: Sequence[Any] | None) -> torch.Tensor | None:
        """The padded buffer behind input i: given by the caller (eager), else a prefix view's base."""
        if buffers is not None:
            return buffers[i]
        return _base_buffer(a, self.vals[i])

    def _buckets(self, values: dict[sympy.Symbol, int], args: Sequence[Any],
                 buffers: Sequence[Any] | None = None) -> dict[sympy.Symbol, int]:
        b = {s: next_bucket(values[s], self.upper[s]) for s in self.symbols}
        # A buffer that comes back (a prefix view of one of our outputs) with a larger capacity
        # than the bucket: use its capacity, so it is passed as is.
        for i, dyn in enumerate(self.val_dyn):
            for d, s in dyn.items():
                base = self._buffer(i, args[i], buffers)
                if s in b and base is not None and base.shape[d] > b[s] and (self.upper[s] is None or base.shape[d] <= self.upper[s]):
                    b[s] = int(base.shape[d])
        for _ in range(64):
            grow = False
            for real, pieces in self.constraints:
                both = {**values, **b}
                if evaluator(real)(values) > max(evaluator(p)(both) for p in pieces):
                    # grow the bucket of the largest size in the result (one symbol at a time)
                    grown = sorted(((b[s], str(s), s) for s in real.free_symbols & set(self.symbols)
                                    if next_bucket(b[s] + 1, self.upper[s]) > b[s]), reverse=True)
                    if grown:
                        s = grown[0][2]
                        b[s], grow = next_bucket(b[s] + 1, self.upper[s]), True
            if not grow:
                break
        return {**{s: values[s] for s in self.int_symbols}, **b}

    def _phys_fn(self, b: dict[sympy.Symbol, int]) -> Callable[[sympy.Expr], int]:
        """Physical size of a size expression: a cat result's capacity (its largest piece), else
        the expression at the bucket sizes."""
        caps: dict[sympy.Expr, int] = {}
        for real, pieces in self.constraints:
            caps[real] = max(caps.get(real, 0), max(int(p.xreplace(b)) for p in pieces))

        def phys(e: sympy.Expr) -> int:
            return caps[e] if e in caps else int(e.xreplace(b))
        return phys

    def _physical(self, i: int, a: Any, b: dict[sympy.Symbol, int], key: tuple,
                  base: torch.Tensor | None = None) -> Any:
        """The buffer passed for input i (a): its bucket-sized buffer as is, else padded to the bucket."""
        dyn = self.val_dyn[i]
        if not dyn:
            return a
        want = self._wants.get((i, key))
        if want is None:
            want = self._wants[(i, key)] = [evaluator(_expr(s))(b) if _free(s) else int(s) for s in self.vals[i].shape]
        x = base if base is not None else a
        if list(x.shape) == want:
            return x
        if any(x.shape[d] > want[d] for d in dyn):
            x = a  # a buffer larger than this call's bucket (another input set it): pad the view
        pad: list[int] = []
        for d in reversed(range(x.dim())):
            pad += [0, want[d] - x.shape[d]]
        return torch.constant_pad_nd(x, pad, 0.0)

    # -- programs
    def _trace(self, fn: Callable, inputs: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
        from torch.fx.experimental.proxy_tensor import make_fx

        from torch_tpu._internal.compile import lowered_ops_stay_whole

        with lowered_ops_stay_whole():
            return make_fx(fn, tracing_mode="fake", decomposition_table={})(*inputs)

    def _padded_program(self, b: dict[sympy.Symbol, int], phys: list[Any]) -> Any:
        tensor_idx = [i for i, a in enumerate(phys) if isinstance(a, torch.Tensor)]
        dev = next((phys[i].device for i in tensor_idx), torch.device("tpu"))
        reals = [torch.empty((), dtype=torch.int64, device=dev) for _ in self.symbols]

        def fn(*ins: torch.Tensor) -> list[Any]:
            full: list[Any] = list(phys)
            for k, i in enumerate(tensor_idx):
                full[i] = ins[k]
            for i, v in enumerate(self.vals):
                if _free(v):
                    full[i] = int(v.node.expr.xreplace(b))
            real = _Real({**{s: b[s] for s in self.int_symbols},
                          **dict(zip(self.symbols, ins[len(tensor_idx):], strict=True))})
            return _PaddedInterpreter(self.gm, real, set(self.symbols), self._phys_fn(b)).run(*full)

        pg = self._trace(fn, [phys[i] for i in tensor_idx] + reals)
        tag = ",".join([f"{s}<={b[s]}" for s in self.symbols] + [f"{s}={b[s]}" for s in self.int_symbols])
        # Dynamo may hand over the same computation twice (e.g. again once an input's stride
        # became symbolic): the same padded graph reuses the program built for the first.
        shared_key = None
        if not any(n.op == "get_attr" for n in pg.graph.nodes):
            shared_key = (self.cache_key, pg.code, tuple((tuple(x.shape), x.dtype) for x in
                                                          [phys[i] for i in tensor_idx]))
        prog = _SHARED.get(shared_key) if shared_key is not None else None
        if prog is None:
            prog = self.build(pg, [phys[i] for i in tensor_idx] + reals, f"{self.name}[{tag}]")
            if shared_key is not None:
                _SHARED[shared_key] = prog
        BUCKETS.append({"graph": f"{self.name}[{tag}]", "kind": "padded",
                        "bucket": {str(s): b[s] for s in self.symbols + self.int_symbols}, "reason": "",
                        "program": prog.desc["name"]})
        return tensor_idx, prog

    def _exact_program(self, args: Sequence[Any]) -> Any:
        tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ints = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}

        def fn(*ins: torch.Tensor) -> list[Any]:
            full: list[Any] = [None] * len(args)
            for k, i in enumerate(tensor_idx):
                full[i] = ins[k]
            for i, a in ints.items():
                full[i] = a
            return torch.fx.Interpreter(self.gm).run(*full)

        pg = self._trace(fn, [args[i] for i in tensor_idx])
        sizes = self._values(args)
        tag = ",".join(f"{s}={sizes[s]}" for s in self.symbols + self.int_symbols)
        prog = self.build(pg, [args[i] for i in tensor_idx], f"{self.name}[{tag}]")
        BUCKETS.append({"graph": f"{self.name}[{tag}]", "kind": "exact",
                        "bucket": {str(s): sizes[s] for s in self.symbols + self.int_symbols},
                        "reason": self.unpadded, "program": prog.desc["name"]})
        return tensor_idx, prog

    def run_padded(self, args: Sequence[Any], buffers: Sequence[Any] | None = None
                   ) -> tuple[list[Any], dict[sympy.Symbol, int]] | None:
        """The padded program's outputs (bucket-sized buffers) and the symbol values, or None when
        this graph cannot run padded (`unpadded` says why). `buffers[i]`: the padded buffer behind
        input i when the caller knows it (eager), else found from prefix views."""
        if self.unpadded:
            return None
        values = self._values(args)
        b = self._buckets(values, args, buffers)
        key = ("padded", tuple(b[s] for s in self.symbols + self.int_symbols))
        phys = [self._physical(i, a, b, key, self._buffer(i, a, buffers)) for i, a in enumerate(args)]
        if key not in self.programs:
            try:
                self.programs[key] = self._padded_program(b, phys)
            except Unpaddable as e:
                self.unpadded = _first_line(e)
            except Exception as e:  # noqa: BLE001 - a lowering refused the padded graph
                self.unpadded = f"{type(e).__name__}: {_first_line(e)}"
        if self.unpadded:
            return None
        tensor_idx, prog = self.programs[key]
        ins = [phys[i] for i in tensor_idx] + [torch.tensor(values[s], dtype=torch.int64) for s in self.symbols]
        return prog(ins), values

    def __call__(self, args: list[Any]) -> list[Any]:
        args = list(args)
        padded = self.run_padded(args)
        if padded is not None:
            return self._real_outputs(padded[0], padded[1], args)
        key = ("exact", tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
        if key not in self.programs:
            try:
                self.programs[key] = self._exact_program(args)
            except Exception as e:  # noqa: BLE001 - no program holds it: run op by op, like eager
                warnings.warn(f"torch_tpu: dynamic graph runs op by op in eager mode ({e})", stacklevel=2)
                self.programs[key] = None
        if self.programs[key] is None:
            return list(torch.fx.Interpreter(self.gm).run(*args))
        tensor_idx, prog = self.programs[key]
        return list(prog([args[i] for i in tensor_idx]))

    def _real_outputs(self, outs: Sequence[Any], values: dict[sympy.Symbol, int], args: Sequence[Any]) -> list[Any]:
        result = []
        for k, (o, v) in enumerate(zip(outs, self.out_vals, strict=True)):
            if k in self.alias_of:
                def real(x: Any) -> int:
                    return evaluator(_expr(x))(values)

                result.append(args[self.alias_of[k]].as_strided(
                    [real(x) for x in v.shape], [real(x) for x in v.stride()], real(v.storage_offset())))
            elif _free(v):
                result.append(evaluator(v.node.expr)(values))
            elif isinstance(o, torch.Tensor) and _dyn(v):
                for d, e in _dyn(v).items():
                    o = o.narrow(d, 0, evaluator(e)(values))
                result.append(o)
            else:
                result.append(o)
        return result


def _base_buffer(a: Any, v: Any) -> torch.Tensor | None:
    """The padded buffer behind a prefix view we returned earlier (same dims, same strides,
    offset 0, larger only along symbolic dims), else None."""
    if not isinstance(a, torch.Tensor) or a._base is None:
        return None
    base = a._base
    dyn = _dyn(v)
    if base.dim() != a.dim() or a.storage_offset() != 0 or base.stride() != a.stride() or not base.is_contiguous():
        return None
    for d in range(a.dim()):
        if base.shape[d] != a.shape[d] and d not in dyn:
            return None
    return base
