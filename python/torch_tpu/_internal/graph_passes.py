"""FX rewrites of compiled tpu graphs before they are described and lowered (compile.compile_graph).

`ungroup_repeated_kv`: grouped-query attention written as HF's `repeat_kv` (`unsqueeze(kv, 2)` ->
`expand` to G copies -> `clone` -> view as Hk*G heads) feeding the fused SDPA op. The SDPA
lowering groups the query heads by their K/V head itself (csrc/lowering/attention.cc: query head h
uses K/V head h // G, exactly what the repeat builds), so the op is given the Hk K/V heads and the
G-fold copies of K and V are never materialized: the scores are one [B*Hk, G*L, S] product per K/V
head instead of B*Hq products against broadcast copies. The repeat stays in the graph for any
other user (it is dropped when SDPA was its only one). Same sums per element: the result is
bitwise the same as with the repeated K/V.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# The switch compile_graph reads (tests and A/B runs turn the rewrites off with it).
ENABLED = [True]

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


def run(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The rewrites, in place; the counts of what changed."""
    counts = {"ungrouped_kv": ungroup_repeated_kv(gm)}
    if any(counts.values()):
        gm.graph.lint()
        gm.recompile()
    return counts
