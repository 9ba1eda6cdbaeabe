"""Ops that compiled graphs must hold: _grouped_mm in every dtype, the fused optimizers, and
graphs with an unlowered node (compiled pieces around it, not the whole graph op by op)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo
import torch_tpu
from torch_tpu._internal import compile as tpu_compile


@pytest.fixture(autouse=True)
def _reset_dynamo() -> None:
    torch._dynamo.reset()


def _stats_delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in tpu_compile.STATS.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_compiles_in_every_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(10, 16, dtype=dtype), torch.randn(3, 16, 8, dtype=dtype)
    offs = torch.tensor([2, 7, 10], dtype=torch.int32)

    def f(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=offs) * 2

    before = dict(tpu_compile.STATS)
    args = [t.to("tpu") for t in (a, b, offs)]
    out = torch.compile(f, backend="tpu", fullgraph=True)(*args)
    assert _stats_delta(before)["programs"] == 1
    torch.testing.assert_close(out.cpu(), f(*args).cpu(), atol=0, rtol=0)
    torch.testing.assert_close(out.cpu().float(), f(a, b, offs).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("opt_name,kwargs", [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "fused": True}),
    ("SGD", {"lr": 0.1, "fused": True}),  # no momentum buffers: an empty mutable list
    ("Adam", {"lr": 1e-2, "fused": True}),
    ("AdamW", {"lr": 1e-2, "fused": True, "amsgrad": True}),
])
def test_fused_optimizer_step_compiles(opt_name: str, kwargs: dict) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 4)
    mt = copy.deepcopy(m).to("tpu")
    cls = getattr(torch.optim, opt_name)
    opt, opt_t = cls(m.parameters(), **{**kwargs, "fused": False}), cls(mt.parameters(), **kwargs)

    @torch.compile(backend="tpu")
    def step() -> None:
        opt_t.step()

    before = dict(tpu_compile.STATS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "op by op" / split warnings
        for i in range(3):
            for p, pt in zip(m.parameters(), mt.parameters(), strict=True):
                p.grad = torch.randn_like(p) * (i + 1)
                pt.grad = p.grad.to("tpu")
            opt.step()
            step()
    d = _stats_delta(before)
    assert d["eager_graphs"] == 0 and d["partitioned_graphs"] == 0 and d["programs"] >= 1
    for p, pt in zip(m.parameters(), mt.parameters(), strict=True):
        torch.testing.assert_close(pt.detach().cpu(), p.detach(), atol=1e-6, rtol=1e-5)


def test_unlowered_node_runs_between_compiled_pieces() -> None:
    x = torch.randn(4, 5)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) * 2 + 1
        z = torch.igamma(y.abs() + 0.5, y.abs() + 1)  # no lowering: runs in eager between the pieces
        return torch.tanh(z).sum(0) + y.mean()

    before = dict(tpu_compile.STATS)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="tpu")(x.to("tpu"))
    d = _stats_delta(before)
    assert {k: v for k, v in torch_tpu.compile_stats().items()
            if k not in ("graph_tiers", "dynamic", "eager_dynamic")} == tpu_compile.STATS
    assert d["partitioned_graphs"] == 1 and d["eager_graphs"] == 0
    assert d["eager_nodes"] == 1 and d["programs"] == 2, d
    assert any("compiled pieces" in str(w.message) for w in log)
    torch.testing.assert_close(out.cpu(), f(x), atol=1e-5, rtol=1e-5)


def test_unlowered_multi_output_node_is_split_out() -> None:
    # median.dim (no lowering) returns (values, indices): the pieces read its getitems.
    x = torch.randn(3, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.median(x * 3, dim=1).values + torch.sort(x, dim=1).values[:, 0]

    out = torch.compile(f, backend="tpu")(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), f(x))
