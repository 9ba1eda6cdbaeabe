"""aten::_grouped_mm (all forms, autograd, no host sync) and the MoE routing ops (histc, bincount,
bucketize, searchsorted, cummax/cummin) on tpu against PyTorch on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch_tpu

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(params=["host", "xla"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU plugin's host kernel (an XLA FFI custom call), then the XLA lowering."""
    if request.param == "host" and torch.tpu.ops.host_kernels().startswith("unavailable"):
        pytest.skip("no host kernels here")  # test_ragged_dot.py::test_host_kernels_registered checks why
    torch.tpu.ops.host_kernels(request.param == "host")
    yield request.param
    torch.tpu.ops.host_kernels(True)


def _offs(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def _run(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    torch_tpu.reset_fallback_stats()
    ref = torch._grouped_mm(a, b, offs)
    out = torch._grouped_mm(a.to("tpu"), b.to("tpu"), None if offs is None else offs.to("tpu")).cpu()
    assert torch_tpu.fallback_stats() == {}
    assert out.dtype == ref.dtype and out.shape == ref.shape
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_3d_rows_grouped(dtype: torch.dtype, path: str) -> None:
    torch.manual_seed(0)
    a = torch.randn(24, 16, dtype=dtype)
    w = torch.randn(5, 16, 8, dtype=dtype)
    offs = _offs(4, 4, 11, 11, 20)  # groups 1 and 3 empty; rows 20.. belong to no group
    out, ref = _run(a, w, offs)
    torch.testing.assert_close(out[:20], ref[:20], **TOL[dtype])
    assert out[20:].abs().max().item() == 0  # PyTorch leaves them uninitialised; we write zeros


@pytest.mark.parametrize(
    "ends",
    [
        (8, 16, 24, 32, 40, 48, 56, 64),  # groups aligned with the 8-row tiles
        (3, 3, 3, 30, 31, 50, 50, 61),  # empty groups, groups starting/ending inside tiles, tail rows
        (0, 0, 0, 0, 0, 0, 0, 64),  # everything in the last group
        (64, 64, 64, 64, 64, 64, 64, 64),  # everything in the first group
        (0, 0, 0, 0, 0, 0, 0, 0),  # no row belongs to a group
    ],
)
@pytest.mark.parametrize("col_major", [False, True])
def test_2d_3d_tiled_routings(ends: tuple[int, ...], col_major: bool, path: str) -> None:
    # 64 rows over 8 groups takes the tiled path (8-row tiles, 15 tile/group pairs); a
    # column-major mat2 (weight.transpose(-2, -1)) is sliced in its own storage order.
    torch.manual_seed(11)
    a = torch.randn(64, 16)
    w = torch.randn(8, 8, 16).transpose(-2, -1) if col_major else torch.randn(8, 16, 8)
    out, ref = _run(a, w, _offs(*ends))
    n = ends[-1]
    torch.testing.assert_close(out[:n], ref[:n], **TOL[torch.float32])
    assert out[n:].abs().sum().item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_3d_transposed_weight_view(dtype: torch.dtype, path: str) -> None:
    # Transformers passes weight.transpose(-2, -1) of a [G, N, K] parameter.
    torch.manual_seed(1)
    a = torch.randn(16, 8, dtype=dtype)
    w = torch.randn(3, 16, 8, dtype=dtype).transpose(-2, -1)
    out, ref = _run(a, w, _offs(5, 9, 16))
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_3d_2d_cols_grouped(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    a = torch.randn(3, 8, 16, dtype=dtype)
    w = torch.randn(16, 24, dtype=dtype)
    offs = _offs(8, 8, 16)  # group 1 empty; columns 16.. belong to no group
    out, ref = _run(a, w, offs)
    torch.testing.assert_close(out[:, :16], ref[:, :16], **TOL[dtype])
    assert out[:, 16:].abs().max().item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_2d_offsets_along_k(dtype: torch.dtype, path: str) -> None:
    torch.manual_seed(3)
    a = torch.randn(8, 24, dtype=dtype)
    b = torch.randn(24, 16, dtype=dtype)
    out, ref = _run(a, b, _offs(6, 6, 17, 24))  # empty group -> zero block, like the CPU
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert out[1].abs().max().item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_3d_3d_batched(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    a = torch.randn(3, 8, 16, dtype=dtype)
    b = torch.randn(3, 16, 8, dtype=dtype)
    out, ref = _run(a, b, None)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_nan_in_one_expert_stays_there() -> None:
    a = torch.randn(8, 8)
    w = torch.randn(2, 8, 8)
    w[1, 0, 0] = float("nan")
    out, ref = _run(a, w, _offs(4, 8))
    torch.testing.assert_close(out, ref, equal_nan=True)
    assert not out[:4].isnan().any()


def test_checks_like_cpu() -> None:
    a = torch.randn(8, 8, device="tpu")
    w = torch.randn(2, 8, 8, device="tpu")
    with pytest.raises(RuntimeError, match="int32"):
        torch._grouped_mm(a, w, torch.tensor([4, 8], device="tpu"))
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(torch.randn(8, 3, device="tpu"), torch.randn(2, 3, 8, device="tpu"), _offs(4, 8).to("tpu"))
    with pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        torch._grouped_mm(a.double(), w.double(), _offs(4, 8).to("tpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_no_host_sync(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    a = torch.randn(24, 16, dtype=dtype)
    w = torch.randn(4, 16, 8, dtype=dtype)
    offs = _offs(5, 5, 13, 24)
    g = torch.randn(24, 8, dtype=dtype)

    def run(dev: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ad = a.detach().to(dev).requires_grad_()
        wd = w.detach().to(dev).requires_grad_()
        y = torch._grouped_mm(ad, wd.transpose(-2, -1).contiguous().transpose(-2, -1), offs.to(dev))
        (y * g.to(dev)).sum().backward()
        return y, ad.grad, wd.grad

    ref = run("cpu")
    torch_tpu.reset_fallback_stats()
    torch_tpu.synchronize()
    before = torch_tpu.dispatch_stats()["host_syncs"]
    out = run("tpu")
    torch_tpu.synchronize()
    assert torch_tpu.dispatch_stats()["host_syncs"] == before
    assert torch_tpu.fallback_stats() == {}
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o.detach().cpu(), r.detach(), **TOL[dtype])


# ---------------------------------------------------------------- routing ops


def _same(f, *args, exact: bool = True) -> None:  # noqa: ANN001
    torch_tpu.reset_fallback_stats()
    ref = f(*args)
    out = f(*[x.to("tpu") if isinstance(x, torch.Tensor) else x for x in args])
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == r.dtype and o.shape == r.shape
        if exact:
            torch.testing.assert_close(o.cpu(), r, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(o.cpu(), r)
    assert torch_tpu.fallback_stats() == {}


def test_histc_float() -> None:
    torch.manual_seed(6)
    x = torch.randn(200)
    x[:3] = torch.tensor([-1.0, 1.0, float("nan")])  # both outer edges, a skipped NaN
    _same(lambda t: torch.histc(t, bins=10, min=-1, max=1), x)
    _same(lambda t: torch.histc(t, bins=7), x[3:])  # min == max: data range
    _same(lambda t: torch.histc(t, bins=4, min=2, max=2), torch.full((5,), 2.0))  # constant: +-1
    _same(lambda t: torch.histc(t, bins=5, min=0, max=3), torch.rand(3, 20, dtype=torch.float64) * 3)


def test_histc_int_bins_like_float() -> None:
    # CPU has no integer histc; CUDA semantics (counts in the input dtype) with float binning.
    torch.manual_seed(7)
    for e in (2, 4, 8, 60):
        ids = torch.randint(0, e, (97,), dtype=torch.int32)
        out = torch.histc(ids.to("tpu"), bins=e, min=0, max=e - 1).cpu()
        assert out.dtype == torch.int32
        assert torch.equal(out, torch.histc(ids.float(), bins=e, min=0, max=e - 1).int())
    ids = torch.tensor([-3, 0, 2, 5, 9, 9, 11], dtype=torch.int64)  # out of range dropped
    assert torch.equal(torch.histc(ids.to("tpu"), bins=3, min=0, max=9).cpu(),
                       torch.histc(ids.float(), bins=3, min=0, max=9).long())


def test_bincount_one_host_sync() -> None:
    torch.manual_seed(8)
    x = torch.randint(0, 6, (40,))
    w = torch.randn(40)
    _same(torch.bincount, x)
    _same(lambda t: torch.bincount(t, minlength=10), x)
    _same(lambda t, u: torch.bincount(t, u), x, w, exact=False)
    _same(lambda t, u: torch.bincount(t, u), x, w.double(), exact=False)
    _same(lambda t: torch.bincount(t, minlength=3), torch.zeros(0, dtype=torch.int64))
    xd = x.to("tpu")
    torch_tpu.synchronize()
    before = torch_tpu.dispatch_stats()["host_syncs"]
    torch.bincount(xd)
    torch_tpu.synchronize()
    assert torch_tpu.dispatch_stats()["host_syncs"] - before == 1
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(torch.tensor([1, -1], device="tpu"))


def test_searchsorted_and_bucketize() -> None:
    torch.manual_seed(9)
    seq = torch.sort(torch.randint(0, 10, (3, 12)).float()).values  # duplicates
    vals = torch.randint(-1, 11, (3, 5)).float()
    for right in (False, True):
        _same(lambda s, v, right=right: torch.searchsorted(s, v, right=right), seq, vals)
        _same(lambda s, v, right=right: torch.searchsorted(s[0], v, right=right, out_int32=True), seq, vals)
        _same(lambda v, s, right=right: torch.bucketize(v, s[1], right=right), vals, seq)
    _same(lambda s, v: torch.searchsorted(s, v, side="right"), seq, vals)
    unsorted = torch.randn(3, 12)
    sorter = torch.argsort(unsorted, dim=-1)
    _same(lambda s, v, so: torch.searchsorted(s, v, sorter=so), unsorted, vals / 5, sorter)
    _same(lambda s: torch.searchsorted(s, 0.25), torch.linspace(0, 1, 9))  # Scalar value
    _same(lambda s: torch.bucketize(3, s), torch.arange(6, dtype=torch.int32))  # Scalar, int boundaries
    _same(lambda s, v: torch.searchsorted(s, v), torch.tensor([0.0, 1.0, float("nan")]),
          torch.tensor([0.5, float("nan"), 2.0]))


def test_cummax_cummin() -> None:
    torch.manual_seed(10)
    x = torch.randint(0, 4, (3, 11)).float()  # ties: the later index wins
    x[1, 4] = float("nan")
    _same(lambda t: torch.cummax(t, 1), x)
    _same(lambda t: torch.cummin(t, 1), x)
    _same(lambda t: torch.cummax(t, 0), torch.randint(-5, 5, (9, 2), dtype=torch.int32))
    _same(lambda t: torch.cummin(t, -1), torch.randn(2, 3, 5))
    _same(lambda t: torch.cummax(t, 0), torch.tensor([False, True, False]))
    # Gradients flow through the indices (scatter-add backward).
    xc = torch.randn(4, 6).requires_grad_()
    xt = xc.detach().to("tpu").requires_grad_()
    torch.cummax(xc, 1).values.sum().backward()
    torch.cummax(xt, 1).values.sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)
