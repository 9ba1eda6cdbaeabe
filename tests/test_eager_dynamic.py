"""Eager bounded dynamism: torch_tpu.mark_dynamic(tensor, dim) buckets strict and fused eager
programs (power-of-two sizes, masks where padding could leak) and results stay dynamic. Every
value is compared with PyTorch on the CPU; program counts come from the runtime's cache stats."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch_tpu
from torch_tpu._internal import eager_dynamic

TPU = "tpu"


def _programs() -> int:
    c = torch_tpu.cache_stats()
    return int(c.get("misses", 0) + c.get("disk_hits", 0))  # compiled by XLA or loaded from disk


def _dyn(x: torch.Tensor, dim: int = 1, **kw: int) -> torch.Tensor:
    t = x.to(TPU)
    torch_tpu.mark_dynamic(t, dim, **kw)
    return t


def _ops(x: torch.Tensor, w: torch.Tensor, tail: torch.Tensor) -> list[torch.Tensor]:
    """Ops over the dynamic dim 1 of x [1, L, 8]: masked reductions, contraction, softmax, cat,
    cumsum, views at the end, composites that must stay dynamic."""
    y = torch.cat([x, tail], dim=1) * 2 + 1                       # cat along the dynamic dim
    p = torch.softmax(y, dim=1)                                     # softmax over it
    s = y.sum(1), y.mean(1), y.amax(1), y.amin(1), y.max(), y.argmax(1), y.argmin(1)  # reductions
    c = torch.cumsum(y, dim=1)
    m = y.transpose(1, 2) @ y                                       # contraction over it: [1, 8, 8]
    lin = torch.nn.functional.linear(y, w)                          # per-row: stays dynamic
    last = y[:, -1:, :] + y[:, -2, :].unsqueeze(1)                  # views from the end
    ones = torch.ones_like(y[..., 0]).cumsum(1) - 1                 # positions
    flags = torch.stack([(y > 3).all(), (y > 3).any()])
    cl = y.clone().to(torch.float64)
    return [y, p, *s, c, m, lin, last, ones, flags, cl]


@pytest.mark.parametrize("fused", [False, True], ids=["strict", "fused"])
def test_bucketed_ops_equal_cpu_and_reuse_programs(fused: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 8)
    mode = torch_tpu.EagerMode.DEFER_AND_FUSE if fused else torch_tpu.EagerMode.DEFER_NEVER
    built = []
    with torch_tpu.set_eager_mode(mode):
        for n in (5, 11, 20):  # buckets 16, 16, 32 (n + 1 after the cat)
            x, tail = torch.randn(1, n, 8), torch.randn(1, 1, 8)
            xd, wd, td = _dyn(x), w.to(TPU), tail.to(TPU)  # marking copies x once: one program per size
            torch_tpu.synchronize()
            before = _programs()
            got = _ops(xd, wd, td)
            torch_tpu.synchronize()
            built.append(_programs() - before)
            got_cpu = [g.cpu() for g in got]  # prefix views are read whole and sliced on the host
            assert _programs() == before + built[-1]
            for a, b in zip(got_cpu, _ops(x, w, tail), strict=True):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # A second size in the same bucket builds nothing new; the next bucket does (fused runs after
    # strict and shares its bucketed programs, which are keyed by the padded graph).
    assert built[1] == 0, built
    assert fused or built[2] > 0
    assert eager_dynamic.stats()["bucketed_calls"] > 0


def test_results_stay_dynamic_and_growth_uses_buckets() -> None:
    x = _dyn(torch.arange(10).reshape(1, 10))
    ref = torch.arange(10).reshape(1, 10)
    torch_tpu.reset_cache_stats()
    for k in range(30):  # 10 -> 40: buckets 16, 32, 64
        nxt = torch.full((1, 1), 100 + k)
        x = torch.cat([x, nxt.to(TPU)], dim=-1)
        ref = torch.cat([ref, nxt], dim=-1)
        assert torch.ops.torch_tpu._dynamic_info(x)  # still dynamic
    assert torch.equal(x.cpu(), ref)
    cats = {b["graph"] for b in torch_tpu.compile_stats()["dynamic"] if "eager.aten.cat" in b["graph"]}
    assert len(cats) == 3, cats  # one program per bucket: <=16, <=32, <=64
    assert "eager.aten.cat" in str(torch_tpu.explain(print_result=False))


def test_max_caps_the_bucket() -> None:
    x = _dyn(torch.arange(12.0).reshape(1, 12), max=20)
    assert torch.ops.torch_tpu._dynamic_info(x)[3] == 16
    for _ in range(6):
        x = torch.cat([x, torch.ones(1, 1, device=TPU)], dim=1)
    assert x.shape[1] == 18 and torch.ops.torch_tpu._dynamic_info(x)[3] == 20  # capped at max, not 32
    assert torch.equal(x.cpu(), torch.cat([torch.arange(12.0).reshape(1, 12), torch.ones(1, 6)], 1))


def test_in_place_update_runs_exactly() -> None:
    x = _dyn(torch.arange(6.0).reshape(2, 3), 0)
    x.add_(1)  # a mutation of a dynamic storage runs on the normal (exact-size) path
    assert torch.equal(x.cpu(), torch.arange(6.0).reshape(2, 3) + 1)
    assert torch.equal((x * 2).cpu(), (torch.arange(6.0).reshape(2, 3) + 1) * 2)  # still usable


def test_cpu_tensor_arguments_take_the_normal_path() -> None:
    # As for an unmarked tpu tensor: CPU index tensors are accepted, a CPU operand is refused.
    base = torch.randn(3, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "results are strided" note for a dim before the dynamic one
        x = _dyn(base.clone(), 1)
    idx = torch.tensor([0, 2])
    assert torch.equal(x[idx].cpu(), base[idx])
    assert torch.equal(x[:, idx].cpu(), base[:, idx])
    with pytest.raises(RuntimeError):
        x + torch.ones(3, 20)
    assert torch.equal((x + torch.tensor(2.0)).cpu(), base + 2.0)  # 0-d CPU tensor: a scalar, as on CPU


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="tpu device"):
        torch_tpu.mark_dynamic(torch.ones(2, 3), 1)
    with pytest.raises(IndexError, match="out of range"):
        torch_tpu.mark_dynamic(torch.ones(2, 3, device=TPU), 2)
    with pytest.raises(ValueError, match="below the current size"):
        torch_tpu.mark_dynamic(torch.ones(2, 30, device=TPU), 1, max=20)
    t = torch_tpu.mark_dynamic(torch.ones(1, 3, device=TPU), 1)
    with pytest.raises(ValueError, match="one dynamic dim per tensor"):
        torch_tpu.mark_dynamic(t, 0)
    assert torch_tpu.mark_dynamic(t, 1) is t  # marking again is a no-op


def test_contiguity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eager_dynamic, "_warned", [False])
    # [1, L, 8]: results are contiguous prefix views (view works, as on CPU).
    ref = torch.randn(1, 6, 8)
    y = _dyn(ref) * 2
    assert y.is_contiguous() and torch.ops.torch_tpu._dynamic_info(y)
    assert torch.equal(y.view(6, 8).cpu(), (ref * 2).view(6, 8))
    # [2, L, 8]: results are strided prefix views, but clone/contiguous keep their promise.
    ref2 = torch.randn(2, 6, 8)
    with pytest.warns(UserWarning, match="not contiguous"):
        z = _dyn(ref2) + 1
    assert not z.is_contiguous() and torch.ops.torch_tpu._dynamic_info(z)
    c = z.contiguous()
    assert c.is_contiguous()
    assert torch.equal(c.view(12, 8).cpu(), (ref2 + 1).view(12, 8))
    assert torch.equal(torch.nn.functional.linear(z, torch.eye(8, device=TPU)).cpu(), ref2 + 1)


def test_hf_generate_strict_eager_is_bucketed() -> None:
    transformers = pytest.importorskip("transformers")
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, intermediate_size=64, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    kw = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    model.to(TPU)

    def gen() -> torch.Tensor:
        x, am = ids.to(TPU), torch.ones_like(ids).to(TPU)
        torch_tpu.mark_dynamic(x, 1)
        torch_tpu.mark_dynamic(am, 1)
        return model.generate(x, attention_mask=am, **kw).cpu()

    eager_dynamic.reset_stats()
    assert torch.equal(gen(), ref)  # lengths 5 .. 17: buckets 16 and 32
    stats = eager_dynamic.stats()
    assert stats["bucketed_calls"] > 100, stats  # the KV cache, attention, positions all bucketed
    kinds = {b["graph"].split("[")[0] for b in torch_tpu.compile_stats()["dynamic"]}
    assert "eager.aten.cat.default" in kinds and any("scaled_dot_product" in k for k in kinds), kinds
    before = _programs()
    eager_dynamic.reset_stats()
    assert torch.equal(gen(), ref)
    assert _programs() == before, f"second generate built {_programs() - before} programs"
    stats = eager_dynamic.stats()  # repeats of a bucketed call run from C++ (no Python)
    assert stats["fast_calls"] > 0.9 * stats["bucketed_calls"] > 90 and stats["fast_gathers"] > 0, stats  # (not: cat at 16)


def _steps(x: torch.Tensor, tail: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, emb: torch.Tensor
           ) -> list[torch.Tensor]:
    y = torch.cat([x, tail], 1)
    return [y, (y * 2 + 1).sum(1), torch.softmax(y, 1), y[:, -1:] + 1, torch.nn.functional.linear(y, w),
            y[:, :16] * 3, emb.index_select(0, ids), y.amax(1, keepdim=True) - y]


def test_fast_path_equals_python_path() -> None:
    """Repeated bucketed calls run from C++ (plan: program, shape guards, buckets, result views);
    growing through buckets 16/32 (the cat at length 16 grows its bucket), a Min(16, s) slice
    (no polynomial: Python), views read at an offset. Values equal CPU with and without it."""
    torch.manual_seed(0)
    tail, w, emb = torch.randn(1, 1, 8), torch.randn(4, 8), torch.randn(30, 8)
    td, wd, ed = tail.to(TPU), w.to(TPU), emb.to(TPU)
    counts = {}
    try:
        for fast in (False, True):
            eager_dynamic.FAST[0] = fast
            torch.ops.torch_tpu._dynamic_clear_plans()
            eager_dynamic.reset_stats()
            x, ids = torch.randn(1, 3, 8), torch.arange(3)
            xd, idd = _dyn(x), _dyn(ids, 0)
            for _ in range(22):  # lengths 3 .. 25
                got, ref = _steps(xd, td, wd, idd, ed), _steps(x, tail, w, ids, emb)
                for a, b in zip(got, ref, strict=True):
                    assert a.shape == b.shape
                    torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
                assert torch.ops.torch_tpu._dynamic_info(got[0])  # fast-path results stay dynamic
                x, xd = ref[0], got[0]
                ids, idd = torch.cat([ids, ids[-1:] % 30]), torch.cat([idd, idd[-1:] % 30])
            counts[fast] = eager_dynamic.stats()
    finally:
        eager_dynamic.FAST[0] = True
    assert counts[False]["fast_calls"] == 0 and counts[False]["fast_gathers"] == 0
    st = counts[True]
    assert st["fast_calls"] > 100 and st["fast_gathers"] > 30, st
    assert st["bucketed_calls"] == counts[False]["bucketed_calls"], (st, counts[False])


def test_fast_path_follows_matmul_precision() -> None:
    # Whether "medium" runs bf16 passes is the platform's choice (XLA:CPU does on AVX-512 machines
    # and keeps float32 on AVX2 ones), so the bucketed fast path is held to what a plain strict
    # matmul gives under the same precision (bf16 passes would differ by ~1e-2) and to its own
    # plan per precision.
    torch.manual_seed(0)
    a, w = torch.randn(1, 20, 64), torch.randn(64, 64)
    ad, wd = _dyn(a), w.to(TPU)
    prev = torch.get_float32_matmul_precision()
    errs = {}
    try:
        for p in ("highest", "medium", "highest", "medium"):
            torch.set_float32_matmul_precision(p)
            eager_dynamic.reset_stats()
            for _ in range(3):
                r = ad @ wd
            assert eager_dynamic.stats()["fast_calls"] >= 2  # each precision has its own plan
            torch.testing.assert_close(r.cpu(), (a.to(TPU) @ wd).cpu(), rtol=1e-5, atol=1e-5, msg=p)
            errs.setdefault(p, []).append(float((r.cpu() - a @ w).abs().max()))
    finally:
        torch.set_float32_matmul_precision(prev)
    assert max(errs["highest"]) < 1e-4, errs


def test_cat_with_static_pieces_anywhere() -> None:
    # Static pieces are written at their runtime offset (a scatter of their rows), dynamic ones
    # gathered; the result's bucket grows when the real result would not fit.
    torch.manual_seed(0)
    t1, t3 = torch.randn(1, 1, 8), torch.randn(1, 3, 8)
    for n in (3, 13, 14, 17, 30):
        x = torch.randn(1, n, 8)
        xd, d1, d3 = _dyn(x), t1.to(TPU), t3.to(TPU)
        for a, b in ((torch.cat([xd, d3, xd, d1], 1), torch.cat([x, t3, x, t1], 1)),
                     (torch.cat([d3, xd, d1], 1), torch.cat([t3, x, t1], 1)),
                     (torch.cat([xd, d3, d1, d3], 1), torch.cat([x, t3, t1, t3], 1))):
            assert torch.equal(a.cpu(), b)


def test_changing_python_scalar_stops_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Python scalar is a constant of the traced op: past the per-op bound the op runs exactly.
    monkeypatch.setattr(eager_dynamic, "_MAX_TRACES_PER_OP", 2)
    ref = torch.arange(1.0, 7.0).reshape(2, 3)
    x = _dyn(ref, 0)
    for k in range(4):
        assert torch.equal(torch.fmod(x, 1.5 + k).cpu(), torch.fmod(ref, 1.5 + k))
    assert "distinct argument sets" in eager_dynamic.stats()["declined"]["aten.fmod.Scalar"]
