"""FX rewrites of compiled tpu graphs before they are described and lowered (compile.compile_graph).

`ungroup_repeated_kv`: grouped-query attention written as HF's `repeat_kv` (`unsqueeze(kv, 2)` ->
`expand` to G copies -> `clone` -> view as Hk*G heads) feeding the fused SDPA op. The SDPA
lowering groups the query heads by their K/V head itself (csrc/lowering/attention.cc: query head h
uses K/V head h // G, exactly what the repeat builds), so the op is given the Hk K/V heads and the
G-fold copies of K and V are never materialized: the scores are one [B*Hk, G*L, S] product per K/V
head instead of B*Hq products against broadcast copies. The repeat stays in the graph for any
other user (it is dropped when SDPA was its only one). Same sums per element: the result is
bitwise the same as with the repeated K/V.

`write_cache_at_offset`: HF's static cache writes `cache.index_copy_(2, arange(n) + offset, kv)`
(`offset` the cache's one-element length tensor). The index is a contiguous run by construction,
so the functional `index_copy` becomes `torch_tpu::index_copy_at(cache, 2, offset, kv)`, which
lowers to one dynamic_update_slice (in place on the donated cache buffer) with index_copy's range
check, instead of a scatter (csrc/lowering/indexing.cc). Same values written, same IndexError.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# Graph-only op the cache-write rewrite emits; outside a compiled program (a graph split around an
# unlowered node) it is the index_copy it replaced.
_LIB = torch.library.Library("torch_tpu", "FRAGMENT")
_LIB.define("index_copy_at(Tensor self, int dim, Tensor start, Tensor source) -> Tensor")


@torch.library.impl(_LIB, "index_copy_at", "CompositeExplicitAutograd")
def _index_copy_at(self: torch.Tensor, dim: int, start: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    n = source.shape[dim] if source.dim() else 1
    return torch.index_copy(self, dim, torch.arange(n, device=self.device) + start, source)


@torch.library.register_fake("torch_tpu::index_copy_at")
def _index_copy_at_fake(self: torch.Tensor, dim: int, start: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(self)


# The switch compile_graph reads (tests and A/B runs turn the rewrites off with it), and one per
# rewrite (by its compile_stats() count name).
ENABLED = [True]
REWRITES = {"ungrouped_kv": True, "cache_writes_at_offset": True}

_SDPA_FORWARDS = (aten._scaled_dot_product_fused_attention_overrideable.default,)
_VIEWS = (aten._unsafe_view.default, aten.view.default, aten.reshape.default)
_REPEAT_OPS = (*_VIEWS, aten.clone.default, aten.expand.default, aten.unsqueeze.default)


def _shape(n: object) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    # Symbolic sizes: leave the graph alone (int() of a SymInt would specialize it: a guard).
    if not all(isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def _repeated_kv_source(n: torch.fx.Node) -> torch.fx.Node | None:
    """kv [B, Hk, S, E] when `n` is repeat_kv(kv, G) = view(clone?(expand(unsqueeze(kv, 2),
    [B, Hk, G, S, E])), [B, Hk*G, S, E]); None otherwise."""
    if n.op != "call_function" or n.target not in _VIEWS:
        return None
    src = n.args[0]
    if isinstance(src, torch.fx.Node) and src.target is aten.clone.default:
        src = src.args[0]
    if not (isinstance(src, torch.fx.Node) and src.target is aten.expand.default):
        return None
    unsq = src.args[0]
    if not (isinstance(unsq, torch.fx.Node) and unsq.target is aten.unsqueeze.default and unsq.args[1] in (2, -3)):
        return None
    kv = unsq.args[0]
    kv_s, exp_s, out_s = _shape(kv), _shape(src), _shape(n)
    if kv_s is None or exp_s is None or out_s is None or len(kv_s) != 4 or len(exp_s) != 5:
        return None
    b, hk, s, e = kv_s
    g = exp_s[2]
    if exp_s != (b, hk, g, s, e) or out_s != (b, hk * g, s, e):
        return None
    return kv


def _erase_dead(graph: torch.fx.Graph, n: torch.fx.Node) -> None:
    """Removes `n` and then its producers of the repeat that no longer have users."""
    stack = [n]
    while stack:
        x = stack.pop()
        if x.op != "call_function" or x.users or x.target not in _REPEAT_OPS:
            continue
        inputs = list(x.all_input_nodes)
        graph.erase_node(x)
        stack.extend(inputs)


def ungroup_repeated_kv(gm: torch.fx.GraphModule) -> int:
    """Feeds grouped K/V to the fused SDPA op instead of their head-repeated copies (module doc);
    returns how many SDPA calls changed."""
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _SDPA_FORWARDS or len(n.args) < 3:
            continue
        k, v = (_repeated_kv_source(a) if isinstance(a, torch.fx.Node) else None for a in n.args[1:3])
        q_s, k_s, v_s = _shape(n.args[0]), _shape(k), _shape(v)
        # K and V grouped alike, and the query heads (those of the repeat) a multiple of theirs.
        if q_s is None or k_s is None or v_s is None or len(q_s) != 4 or k_s[:2] != v_s[:2] or q_s[1] % k_s[1]:
            continue
        old = n.args[1:3]
        n.args = (n.args[0], k, v, *n.args[3:])
        changed += 1
        for o in old:
            _erase_dead(gm.graph, o)
    return changed


def _arange_length(n: object) -> int | None:
    """n for `arange(n)` / `arange(0, n[, 1])` of int64 with static n; None otherwise."""
    if not (isinstance(n, torch.fx.Node) and n.op == "call_function"):
        return None
    args = list(n.args)
    if n.target is aten.arange.default:
        args = [0, *args]
    elif n.target is aten.arange.start:
        pass
    elif n.target is aten.arange.start_step:
        if args[2] != 1:
            return None
    else:
        return None
    if args[0] != 0 or not isinstance(args[1], int):
        return None
    v = n.meta.get("val")
    return args[1] if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and _shape(n) == (args[1],) else None


def _run_offset(index: object, length: int) -> torch.fx.Node | None:
    """`off` when `index` = arange(length) + off (either order), off an integer tensor of one
    element (shape [] or [1]); None otherwise."""
    if not (isinstance(index, torch.fx.Node) and index.target is aten.add.Tensor and len(index.args) == 2):
        return None
    if index.kwargs.get("alpha", 1) != 1:
        return None
    for a, off in (index.args, index.args[::-1]):
        v = off.meta.get("val") if isinstance(off, torch.fx.Node) else None
        if (_arange_length(a) == length and isinstance(v, torch.Tensor) and _shape(off) in ((), (1,))
                and not v.dtype.is_floating_point and not v.dtype.is_complex and v.dtype != torch.bool):
            return off
    return None


def write_cache_at_offset(gm: torch.fx.GraphModule) -> int:
    """index_copy(self, dim, arange(n) + off, src) -> torch_tpu::index_copy_at(self, dim, off, src)
    (module doc); returns how many changed."""
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.index_copy.default or len(n.args) != 4 or n.kwargs:
            continue
        self_, dim, index, src = n.args
        s_s, src_s, i_s = _shape(self_), _shape(src), _shape(index)
        if s_s is None or src_s is None or i_s is None or len(i_s) != 1 or not s_s or len(src_s) != len(s_s):
            continue
        d = dim % len(s_s)
        length = i_s[0]
        if src_s[d] != length or any(a != b for k, (a, b) in enumerate(zip(s_s, src_s, strict=True)) if k != d):
            continue
        v, iv = n.meta.get("val"), index.meta.get("val")
        if not isinstance(v, torch.Tensor) or not isinstance(iv, torch.Tensor) or iv.dtype != torch.int64:
            continue
        off = _run_offset(index, length)
        if off is None:
            continue
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(torch.ops.torch_tpu.index_copy_at.default, (self_, d, off, src))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        for x in (index, *index.all_input_nodes):  # the index run, unless something else reads it
            if isinstance(x, torch.fx.Node) and not x.users and x.target in (aten.add.Tensor, *_ARANGES):
                gm.graph.erase_node(x)
        changed += 1
    return changed


_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def run(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The rewrites, in place; the counts of what changed."""
    passes = {"ungrouped_kv": ungroup_repeated_kv, "cache_writes_at_offset": write_cache_at_offset}
    counts = {name: fn(gm) if REWRITES.get(name, True) else 0 for name, fn in passes.items()}
    if any(counts.values()):
        gm.graph.lint()
        gm.recompile()
    return counts
