"""Ops that compiled graphs must hold: _grouped_mm in every dtype, the fused optimizers,
graphs with an unlowered node (compiled pieces around it, not the whole graph op by op), and the
static KV cache write (index_copy at arange + offset) as one dynamic_update_slice."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._functorch.config
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


class _StaticKV(torch.nn.Module):
    """HF StaticLayer.update's write (transformers 5.x): `index_copy_` at arange(n) + the cache's
    one-element length tensor, then the length advances in place."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, size, 3))
        self.register_buffer("v", torch.zeros(1, 2, size, 3))
        self.register_buffer("length", torch.zeros(1, dtype=torch.long))

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(k.shape[-2], device=k.device) + self.length
        self.length.add_(k.shape[-2])
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return (self.k * self.v).sum(2)


def _cache_write_programs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rewrite: bool,
                          size: int) -> tuple[_StaticKV, _StaticKV, torch.nn.Module]:
    """(CPU module, its tpu copy, the compiled tpu copy); the programs it builds go to tmp_path."""
    from torch_tpu._internal import graph_passes

    monkeypatch.setitem(graph_passes.REWRITES, "cache_writes_at_offset", rewrite)
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path))  # the programs as run (device checks included)
    m = _StaticKV(size)
    mt = copy.deepcopy(m).to("tpu")
    return m, mt, torch.compile(mt, backend="tpu", fullgraph=True, dynamic=False)


def _dumped(tmp_path: Path) -> list[str]:
    """The compiled graphs' programs (not the eager ops') the runtime asked XLA for."""
    return [t for t in (p.read_text() for p in sorted(tmp_path.glob("*.mlir"))) if t.startswith("// graph ")]


@pytest.mark.parametrize("rewrite", [True, False])
def test_static_cache_write_is_one_dynamic_update_slice(rewrite: bool, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """The static KV cache write index_copy_(2, arange(n) + length, kv) compiles to a
    dynamic_update_slice of the donated cache (no scatter); cache contents equal CPU's step by
    step. With the rewrite off, the old program's scatter is there (the expectation guards it)."""
    torch.manual_seed(5)
    m, mt, cm = _cache_write_programs(monkeypatch, tmp_path, rewrite, 11)
    before = tpu_compile.STATS["cache_writes_at_offset"]
    # Programs built here, not served from AOTAutograd's cache (its key does not see the switch).
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        for _ in range(3):
            k, v = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
            out = cm(k.to("tpu"), v.to("tpu"))
            torch.testing.assert_close(out.cpu(), m(k, v))
            for a, b in ((mt.k, m.k), (mt.v, m.v), (mt.length, m.length)):
                assert torch.equal(a.cpu(), b)
    texts = _dumped(tmp_path)
    assert len(texts) == 1
    if rewrite:
        assert tpu_compile.STATS["cache_writes_at_offset"] == before + 2
        assert texts[0].count("stablehlo.dynamic_update_slice") == 2 and "\"stablehlo.scatter\"(" not in texts[0]
        assert "(tensor<1x2x11x3xf32>, tensor<1x2x3x3xf32>, tensor<i64>, tensor<i64>, tensor<i64>, tensor<i64>) " \
               "-> tensor<1x2x11x3xf32>" in texts[0], texts[0]
        # in place: the caches are donated into their results
        assert texts[0].count("tensor<1x2x11x3xf32> {tf.aliasing_output") == 2, texts[0]
    else:
        assert tpu_compile.STATS["cache_writes_at_offset"] == before
        assert texts[0].count("\"stablehlo.scatter\"(") == 2 and "stablehlo.dynamic_update_slice" not in texts[0]


@pytest.mark.parametrize("start", [-1, 9])
def test_static_cache_write_out_of_range_raises_like_cpu(start: int, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """A cache length that puts the run outside [0, size): IndexError as on CPU (the slice would
    clamp the start; the range check keeps index_copy's behaviour); in-range steps before it are
    written like CPU's."""
    m, mt, cm = _cache_write_programs(monkeypatch, tmp_path, True, 11)
    k, v = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    before = tpu_compile.STATS["cache_writes_at_offset"]
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        cm(k.to("tpu"), v.to("tpu")).cpu()
        m(k, v)
        m.length.fill_(start)
        mt.length.fill_(start)
        with pytest.raises(IndexError, match=r"index_copy_\(\): index .*out of bounds for dimension 2 with size 11"):
            m(k, v)
        with pytest.raises(IndexError, match=r"index_copy_\(\): index .*out of bounds for dimension 2 with size 11"):
            cm(k.to("tpu"), v.to("tpu")).cpu()
    assert tpu_compile.STATS["cache_writes_at_offset"] == before + 2  # the slice program ran
