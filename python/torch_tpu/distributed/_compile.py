"""torch.compile of graphs with collectives: the program is split at each collective.

The CPU plugin cannot run a collective inside a PJRT program (each process has its own
single-device client), so a graph from a tensor-parallel model (DTensor's
`_c10d_functional` ops + `wait_tensor`) is cut into segments: runs of ordinary ops are
compiled as one tpu program each (the normal compile path), and the collective nodes between
them run eagerly through the tpu_dist backend. Every segment is compiled once per signature, so
a decode loop recompiles nothing after warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})


def _is_collective(n: torch.fx.Node) -> bool:
    if n.op != "call_function":
        return False
    t = n.target
    ns = getattr(t, "namespace", None)
    if ns is None and isinstance(t, torch._ops.OpOverloadPacket):
        ns = t._qualified_op_name.split("::")[0]
    return ns in _NAMESPACES


def has_collectives(gm: torch.fx.GraphModule) -> bool:
    return any(_is_collective(n) for n in gm.graph.nodes)


def split_at_collectives(gm: torch.fx.GraphModule, compile_fn: Callable[[torch.fx.GraphModule, Sequence[Any]],
                                                                        Callable]) -> Callable:
    """A boxed callable: `gm` with each collective-free segment compiled by `compile_fn`."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch.fx.passes.split_module import split_module

    part: dict[torch.fx.Node, int] = {}
    k, in_coll = 0, False
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        coll = _is_collective(n)
        if coll != in_coll:
            k += 1
            in_coll = coll
        part[n] = k
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if not isinstance(sub, torch.fx.GraphModule) or has_collectives(sub):
            continue  # collectives run eagerly (tpu_dist backend)
        out = next(n for n in sub.graph.nodes if n.op == "output")
        single = not isinstance(out.args[0], (tuple, list))
        if single:  # compiled programs return a tuple of outputs
            out.args = ((out.args[0],),)
            sub.recompile()
        setattr(split, name, _Boxed(compile_fn(sub, []), single))
    split.recompile()
    return make_boxed_func(split.forward)


class _Boxed(torch.nn.Module):
    """A compiled segment (boxed calling convention) called like the submodule it replaces."""

    def __init__(self, fn: Callable, single: bool) -> None:
        super().__init__()
        self.fn = fn
        self.single = single

    def forward(self, *args: Any) -> Any:
        out = self.fn(list(args))
        return out[0] if self.single else tuple(out)
