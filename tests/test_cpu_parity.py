"""Results that equal PyTorch CPU exactly (not within a tolerance): fused eager with
TORCH_TPU_FUSED_FMA=0 rounds each op as CPU does (no FMA contraction across ops), and ops that used
to run on the CPU fallback are lowered with CPU's own edge-case rules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from tests.conftest import warn_always


@pytest.fixture
def no_fallback():
    torch_tpu.reset_fallback_stats()
    yield
    assert torch_tpu.fallback_stats() == {}


_CONTRACTION = """
import torch, torch_tpu
a = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to("tpu")
with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
    b = a * 0.9
    c = torch.where(b > -100, b, b)
    print((c - a * 0.9).abs().max().item())
"""


def test_fused_eager_without_fma_rounds_each_op_like_cpu() -> None:
    # c holds a * 0.9 rounded; c - a * 0.9 is exactly 0 on CPU. XLA:CPU contracts the second
    # product into the subtraction (one FMA keeps it unrounded: 1.2e-7) unless
    # TORCH_TPU_FUSED_FMA=0 (read once per process, hence the subprocess).
    env = {**os.environ, "TORCH_TPU_FUSED_FMA": "0"}
    out = subprocess.run([sys.executable, "-c", _CONTRACTION], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 0.0


def test_tril_triu_indices_equal_cpu(no_fallback: None) -> None:
    for row, col in [(0, 3), (1, 1), (3, 5), (5, 3), (4, 4), (7, 2), (2, 9)]:
        for offset in range(-8, 9, 3):
            for f in (torch.tril_indices, torch.triu_indices):
                expected = f(row, col, offset)
                assert torch.equal(f(row, col, offset, device="tpu").cpu(), expected), (f, row, col, offset)
    assert torch.equal(torch.triu_indices(2000, 3000, 7, device="tpu").cpu(), torch.triu_indices(2000, 3000, 7))


def test_logcumsumexp_infinities_and_nan_like_cpu(no_fallback: None) -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, -inf, -inf, 1.0, inf, inf, 2.0, nan, 3.0], [-inf] * 4 + [5.0, -inf, 1e30, -1e30, 0.5]])
    torch.testing.assert_close(torch.logcumsumexp(x.to("tpu"), 1).cpu(), torch.logcumsumexp(x, 1), equal_nan=True)
    with pytest.raises(IndexError, match="Dimension out of range"):
        torch.logcumsumexp(x.to("tpu"), 2)


def test_logspace_matches_cpu(no_fallback: None) -> None:
    for start, end, steps in [(0, 2, 5), (-1, 3, 7), (2, 2, 1), (1.5, -2.5, 9)]:
        for dtype in (torch.float32, torch.float64, torch.int64):
            for base in (10.0, 2.5):
                expected = torch.logspace(start, end, steps, base=base, dtype=dtype)
                got = torch.logspace(start, end, steps, base=base, dtype=dtype, device="tpu").cpu()
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_index_reduce_nan_and_index_errors_like_cpu(no_fallback: None) -> None:
    x = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    src = torch.tensor([[float("nan"), 1.0], [5.0, 2.0]])
    idx = torch.tensor([0, 0])
    for reduce in ("amax", "amin", "prod", "mean"):
        for include_self in (True, False):
            expected = x.index_reduce(0, idx, src, reduce, include_self=include_self)
            got = x.to("tpu").index_reduce(0, idx.to("tpu"), src.to("tpu"), reduce, include_self=include_self)
            torch.testing.assert_close(got.cpu(), expected, equal_nan=True)
    ints = torch.tensor([5, -7, 3]).to("tpu").index_reduce(0, torch.tensor([0, 1, 1], device="tpu"),
                                                          torch.tensor([2, 2, 2], device="tpu"), "mean")
    assert ints.cpu().tolist() == [3, -1, 3]  # floor division, as CPU
    with pytest.raises(IndexError, match="index out of range in self"):
        torch.zeros(3, 2, device="tpu").index_reduce(0, torch.tensor([0, -1], device="tpu"),
                                                     torch.ones(2, 2, device="tpu"), "amax").cpu()


@pytest.mark.parametrize("p", [1, 2])
def test_multi_margin_loss_and_grad_like_cpu(p: int, no_fallback: None) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    target, weight = torch.tensor([0, 3, 1, 2, 3]), torch.rand(4, dtype=torch.float64)
    xt = x.detach().to("tpu").requires_grad_()
    for reduction in ("none", "mean", "sum"):
        expected = F.multi_margin_loss(x, target, p, 0.7, weight, reduction=reduction)
        got = F.multi_margin_loss(xt, target.to("tpu"), p, 0.7, weight.to("tpu"), reduction=reduction)
        torch.testing.assert_close(got.cpu(), expected)
        grad = torch.rand(expected.shape, dtype=torch.float64)
        (ge,) = torch.autograd.grad(expected, x, grad)
        (gt,) = torch.autograd.grad(got, xt, grad.to("tpu"))
        torch.testing.assert_close(gt.cpu(), ge)
    with pytest.raises(RuntimeError, match="target out of range"):
        F.multi_margin_loss(xt.detach(), torch.tensor([0, 4, 1, 2, 3], device="tpu"), p).cpu()


def test_median_kthvalue_nan_rules_like_cpu(no_fallback: None) -> None:
    # median: a row with NaN gives NaN and the index of its first NaN; nanmedian skips NaNs
    # (all-NaN row: NaN); kthvalue orders NaN above every number.
    nan = float("nan")
    x = torch.tensor([[3.0, 1.0, 2.0, -0.0, 5.0], [nan, 1.0, nan, 0.0, 2.0], [nan] * 5, [4.0, nan, -1.0, 7.0, 8.0]])
    t = x.to("tpu")
    for got, want in ((torch.median(t, 1), torch.median(x, 1)), (torch.median(t, 0, keepdim=True), torch.median(x, 0, keepdim=True))):
        torch.testing.assert_close(got.values.cpu(), want.values, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(got.indices.cpu(), want.indices)
    got, want = torch.kthvalue(t, 4, 1), torch.kthvalue(x, 4, 1)  # which of several NaNs: unspecified
    torch.testing.assert_close(got.values.cpu(), want.values, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(x.gather(1, got.indices.cpu()[:, None])[:, 0], want.values, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(torch.nanmedian(t, 1).values.cpu(), torch.nanmedian(x, 1).values, equal_nan=True)
    assert torch.median(t).isnan().item() and torch.nanmedian(t).item() == torch.nanmedian(x).item()
    assert torch.median(t[0]).item() == 2.0 and str(torch.median(t[0, 3:4]).item()) == "-0.0"
    with pytest.raises(RuntimeError, match="out of range"):
        torch.kthvalue(t, 6, 1)


def test_binary_cross_entropy_like_cpu(no_fallback: None) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 5, generator=g).index_put_((torch.tensor([0, 1]), torch.tensor([0, 1])), torch.tensor([0.0, 1.0]))
    y, w = torch.rand(6, 5, generator=g), torch.rand(5, generator=g)
    for red in ("none", "mean", "sum"):
        xt = x.to("tpu").requires_grad_()
        got = F.binary_cross_entropy(xt, y.to("tpu"), weight=w.to("tpu"), reduction=red)
        xc = x.clone().requires_grad_()
        want = F.binary_cross_entropy(xc, y, weight=w, reduction=red)
        torch.testing.assert_close(got.cpu(), want)  # log terms clamped at -100 at 0 and 1
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(xt.grad.cpu(), xc.grad)
    for bad in (torch.tensor([1.5, 0.5]), torch.tensor([float("nan"), 0.5])):
        with pytest.raises(RuntimeError, match="input should be between 0 and 1"):
            F.binary_cross_entropy(bad.to("tpu"), torch.tensor([0.0, 1.0], device="tpu")).item()
    with pytest.raises(RuntimeError, match="target should be between 0 and 1"):
        F.binary_cross_entropy(torch.tensor([0.5], device="tpu"), torch.tensor([2.0], device="tpu")).item()


def test_grid_sample_like_cpu(no_fallback: None) -> None:
    # Coordinates reach outside [-1, 1] so every padding mode matters; bfloat16 follows CPU's
    # scalar kernel step by step (bitwise), float32 its vectorized one (within rounding).
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 5, 7, generator=g).to(dt)
        grid = (torch.rand(2, 4, 6, 2, generator=g) * 3 - 1.5).to(dt)
        for mode, pad, align in (("bilinear", "zeros", False), ("bilinear", "reflection", True), ("nearest", "border", True),
                                 ("nearest", "reflection", False), ("bicubic", "zeros", True), ("bicubic", "reflection", False)):
            want = F.grid_sample(x, grid, mode=mode, padding_mode=pad, align_corners=align)
            got = F.grid_sample(x.to("tpu"), grid.to("tpu"), mode=mode, padding_mode=pad, align_corners=align)
            if dt == torch.bfloat16:
                assert torch.equal(got.cpu(), want), (mode, pad, align)
            else:
                torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_grid_sample_gradients_like_cpu(no_fallback: None) -> None:
    g = torch.Generator().manual_seed(1)
    x, grid = torch.randn(2, 3, 5, 7, generator=g), torch.rand(2, 4, 6, 2, generator=g) * 3 - 1.5
    go = torch.randn(2, 3, 4, 6, generator=g)
    for mode, pad, align in (("bilinear", "zeros", False), ("bilinear", "reflection", True), ("nearest", "border", False)):
        grads = []
        for dev in ("cpu", "tpu"):
            xi, gi = x.to(dev).detach().requires_grad_(), grid.to(dev).detach().requires_grad_()
            F.grid_sample(xi, gi, mode=mode, padding_mode=pad, align_corners=align).backward(go.to(dev))
            grads.append((xi.grad.cpu(), gi.grad.cpu()))
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def test_embedding_bag_and_max_norm_like_cpu(no_fallback: None) -> None:
    # EmbeddingBag with an empty bag, padding_idx, include_last_offset and per-sample weights,
    # forward and gradients; nn.Embedding(max_norm=...) renormalizes the looked-up rows in place.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 4, generator=g)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 0])
    for mode, last, pad, psw in (("sum", False, 4, True), ("mean", True, None, False), ("max", False, 2, False)):
        off = torch.tensor([0, 3, 3, 7, 10] if last else [0, 3, 3, 7])
        ps = torch.rand(10, generator=g) if psw else None
        res = []
        for dev in ("cpu", "tpu"):
            wi = w.to(dev).detach().requires_grad_()
            pi = ps.to(dev).detach().requires_grad_() if ps is not None else None
            out = F.embedding_bag(idx.to(dev), wi, off.to(dev), mode=mode, include_last_offset=last, padding_idx=pad,
                                  per_sample_weights=pi)
            out.backward(torch.arange(out.numel(), dtype=torch.float).reshape(out.shape).to(dev))
            res.append([out.detach().cpu(), wi.grad.cpu()] + ([pi.grad.cpu()] if pi is not None else []))
        torch.testing.assert_close(res[1], res[0])
    with pytest.raises(RuntimeError, match="valid range"):
        F.embedding_bag(torch.tensor([1, 11], device="tpu"), w.to("tpu"), torch.tensor([0], device="tpu")).cpu()
    wc, wt = w * 3, (w * 3).to("tpu")
    torch.testing.assert_close(F.embedding(idx.to("tpu"), wt, max_norm=1.5).cpu(), F.embedding(idx, wc, max_norm=1.5))
    torch.testing.assert_close(wt.cpu(), wc)  # rows renormalized in place, the others untouched


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_frexp_nextafter_bits_like_cpu(no_fallback: None) -> None:
    # Bit-exact against CPU: signed zeros, inf/NaN passthrough, subnormals (normalised mantissa,
    # exponent below the normal range), stepping across zero and to inf.
    inf, nan = float("inf"), float("nan")
    for dt in (torch.float16, torch.bfloat16, torch.float32):  # float64: the same code, other constants
        fi = torch.finfo(dt)
        tiny = fi.smallest_normal
        x = torch.tensor([0.0, -0.0, 1.0, -3.5, inf, nan, -inf, tiny / 3, -tiny / 7, tiny, fi.max, -0.3], dtype=dt)
        m, e = torch.frexp(x)
        mt, et = torch.frexp(x.to("tpu"))
        assert torch.equal(_bits(mt.cpu()), _bits(m)) and torch.equal(et.cpu(), e), dt
        a = torch.tensor([0.0, 0.0, -0.0, 1.0, 1.0, -1.0, -1.0, tiny, -tiny, nan, 1.0, inf, -inf, fi.max, 0.0, tiny / 4],
                         dtype=dt)
        b = torch.tensor([-1.0, 1.0, 0.0, 2.0, 0.0, -2.0, 0.0, 0.0, 0.0, 1.0, nan, 0.0, 0.0, inf, -0.0, 1.0], dtype=dt)
        want, got = torch.nextafter(a, b), torch.nextafter(a.to("tpu"), b.to("tpu")).cpu()
        assert torch.equal(want.isnan(), got.isnan()), dt
        assert torch.equal(_bits(want)[~want.isnan()], _bits(got)[~got.isnan()]), dt
    x = torch.ones(2, device="tpu")
    with pytest.raises(RuntimeError, match="expects exponent to have int dtype"):
        torch.frexp(x, out=(torch.empty_like(x), torch.empty(2, dtype=torch.int64, device="tpu")))


def test_mode_like_cpu(no_fallback: None) -> None:
    # Values and indices equal CPU's on short slices (its insertion sort, NaNs stopping it, keeps
    # equal values in order: the last occurrence); ties go to the smallest value; NaNs count once each.
    g = torch.Generator().manual_seed(0)
    nan = float("nan")
    cases = [(torch.tensor([[3, 1, 3, 1, 2], [5, 5, 5, 2, 2]]), 1, False), (torch.tensor([True, False, True]), 0, False),
             (torch.tensor([[1.0, nan, nan, 2.0], [nan, nan, -0.0, 0.0], [nan, 3, 3, nan], [nan, 3, nan, 4], [2, nan, 1, 1]]).T, 0,
              True)]
    for t, d, keep in cases:
        w, got = torch.mode(t, d, keep), torch.mode(t.to("tpu"), d, keep)
        torch.testing.assert_close(got.values.cpu(), w.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(_bits(got.values.cpu()) if t.is_floating_point() else got.values.cpu(),
                           _bits(w.values) if t.is_floating_point() else w.values), (t, d, keep)
        assert torch.equal(got.indices.cpu(), w.indices), (t, d, keep)
    # Long slices: CPU's unstable sort picks some occurrence; ours must hold the mode value.
    x = torch.randint(0, 5, (2, 300), generator=g)
    v, i = torch.mode(x.to("tpu"), 1)
    assert torch.equal(v.cpu(), torch.mode(x, 1).values)
    assert torch.equal(x.gather(1, i.cpu()[:, None])[:, 0], v.cpu())
    with pytest.raises(RuntimeError, match="non-zero size"):
        torch.mode(torch.empty(0, 3, device="tpu"), 0)


def test_cauchy_log_normal_geometric_distributions(no_fallback: None) -> None:
    # In-place random fills on the device: reproducible under manual_seed, the right support and
    # location statistics (n = 20000: the sample median / mean are within a few % of the truth).
    n = 20000
    fills = {
        "cauchy": lambda t: t.cauchy_(1.0, 2.0),
        "log_normal": lambda t: t.log_normal_(0.5, 0.4),
        "geometric": lambda t: t.geometric_(0.3),
    }
    draws = {}
    for name, fill in fills.items():
        torch.manual_seed(3)
        a = fill(torch.empty(n, device="tpu")).cpu()
        torch.manual_seed(3)
        assert torch.equal(fill(torch.empty(n, device="tpu")).cpu(), a), name
        assert not torch.equal(fill(torch.empty(n, device="tpu")).cpu(), a), name
        assert bool(a.isfinite().all()), name
        draws[name] = a
    c, ln, geo = draws["cauchy"], draws["log_normal"], draws["geometric"]
    assert abs(c.median().item() - 1.0) < 0.1 and abs((c - 1).abs().median().item() - 2.0) < 0.15  # median, scale
    assert bool((ln > 0).all()) and abs(ln.log().mean().item() - 0.5) < 0.02 and abs(ln.log().std().item() - 0.4) < 0.02
    assert bool((geo >= 1).all()) and torch.equal(geo, geo.round()) and abs(geo.mean().item() - 1 / 0.3) < 0.1
    assert bool((torch.empty(1000, dtype=torch.int64, device="tpu").geometric_(0.5).cpu() >= 1).all())
    with pytest.raises(RuntimeError, match="floating point"):
        torch.empty(3, dtype=torch.long, device="tpu").cauchy_()
    with pytest.raises(RuntimeError, match="expects p to be in"):
        torch.empty(3, device="tpu").geometric_(1.0)
    with pytest.raises(RuntimeError, match="std > 0"):
        torch.empty(3, device="tpu").log_normal_(0.0, -1.0)


def test_lu_inverse_solve_like_cpu(no_fallback: None) -> None:
    # LU with partial pivoting: the same pivots as LAPACK, inverse and solves (left/right,
    # vector right-hand side, batches) and their gradients; a singular matrix reports info and
    # linalg.inv raises CPU's error.
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(3, 5, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, 2, generator=g, dtype=torch.float64)
    At, Bt = A.to("tpu"), B.to("tpu")
    lu, piv = torch.linalg.lu_factor(At)
    lu_c, piv_c = torch.linalg.lu_factor(A)
    torch.testing.assert_close(lu.cpu(), lu_c)
    assert torch.equal(piv.cpu(), piv_c)
    torch.testing.assert_close(torch.linalg.inv(At).cpu(), torch.linalg.inv(A))
    torch.testing.assert_close(torch.linalg.solve(At, Bt).cpu(), torch.linalg.solve(A, B))
    torch.testing.assert_close(torch.linalg.solve(At, Bt[..., 0]).cpu(), torch.linalg.solve(A, B[..., 0]))
    torch.testing.assert_close(torch.linalg.solve(At, Bt.mT, left=False).cpu(), torch.linalg.solve(A, B.mT, left=False))
    grads = []
    for a, b in ((A, B), (At, Bt)):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        (torch.linalg.solve(a, b).sum() + torch.linalg.inv(a).square().sum()).backward()
        grads.append((a.grad.cpu(), b.grad.cpu()))
    torch.testing.assert_close(grads[1], grads[0])
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], device="tpu")
    assert torch.linalg.inv_ex(singular).info.item() == 2
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        torch.linalg.inv(singular)


# ---- i10b: Cholesky, QR (LAPACK's algorithms), pdist, special functions


def _spd(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    a = torch.randn(*shape, generator=g, dtype=dtype)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=dtype)


def test_cholesky_like_cpu(no_fallback: None) -> None:
    # potf2's column order: values, info and the partial factor of a non-positive-definite input
    # equal CPU's; torch.linalg.cholesky / torch.cholesky raise CPU's LinAlgError.
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        A = _spd(g, 3, 5, 5, dtype=dtype)
        At = A.to("tpu")
        for upper in (False, True):
            torch.testing.assert_close(torch.linalg.cholesky(At, upper=upper).cpu(), torch.linalg.cholesky(A, upper=upper))
            L = torch.linalg.cholesky(A[0], upper=upper)
            torch.testing.assert_close(torch.cholesky_inverse(L.to("tpu"), upper=upper).cpu(), torch.cholesky_inverse(L, upper=upper))
        assert torch.equal(torch.linalg.cholesky_ex(At).info.cpu(), torch.zeros(3, dtype=torch.int32))
    bad = torch.tensor([[4.0, 2, 1], [2, 1, 3], [1, 3, 5]])
    for upper in (False, True):
        L, info = torch.linalg.cholesky_ex(bad.to("tpu"), upper=upper)
        L_c, info_c = torch.linalg.cholesky_ex(bad, upper=upper)
        assert torch.equal(L.cpu(), L_c) and info.item() == info_c.item() == 2
    nan = torch.eye(3)
    nan[2, 2] = float("nan")
    assert torch.linalg.cholesky_ex(nan.to("tpu")).info.item() == 3
    with pytest.raises(torch.linalg.LinAlgError, match=r"^linalg.cholesky: \(Batch element 1\): The factorization could not"
                       r" be completed because the input is not positive-definite \(the leading minor of order 2 is not"):
        torch.linalg.cholesky(torch.stack([torch.eye(3), bad]).to("tpu"))
    with pytest.warns(UserWarning, match="deprecated"), warn_always():  # ATen warns once per process
        torch.testing.assert_close(torch.cholesky(At[0]).cpu(), torch.cholesky(A[0]))
    with pytest.raises(torch.linalg.LinAlgError, match=r"^cholesky: The factorization .* minor of order 2 is"):
        torch.cholesky(bad.to("tpu"))
    with pytest.raises(RuntimeError, match="cholesky: A must be batches of square matrices, but they are 2 by 3"):
        torch.cholesky(torch.ones(2, 3, device="tpu"))
    # Gradients through the factor and the inverse.
    grads = []
    for dev in ("cpu", "tpu"):
        a = A.detach().to(dev).requires_grad_()
        L = torch.linalg.cholesky(a)
        (L.square().sum() + torch.cholesky_inverse(L).sum()).backward()
        grads.append(a.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


def test_qr_householder_like_cpu(no_fallback: None) -> None:
    # geqr2 with larfg's reflectors: R's diagonal signs, Q, tau and the packed factor equal
    # LAPACK's, also for rank-deficient input (a zero column gives tau = 0, H = I).
    g = torch.Generator().manual_seed(1)
    A = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    deficient = A[0].clone()  # exactly rank 2: zero columns leave tau = 0 (H = I) as in LAPACK
    deficient[:, 1] = 0
    deficient[:, 3] = 0
    for a in (A, A.mT, deficient, A.float()):
        at = a.to("tpu")
        for mode in ("reduced", "complete", "r"):
            Q, R = torch.linalg.qr(at, mode=mode)
            Q_c, R_c = torch.linalg.qr(a, mode=mode)
            torch.testing.assert_close(R.cpu(), R_c)
            torch.testing.assert_close(Q.cpu(), Q_c)
        h, tau = torch.geqrf(at)
        h_c, tau_c = torch.geqrf(a)
        torch.testing.assert_close(h.cpu(), h_c)
        torch.testing.assert_close(tau.cpu(), tau_c)
        if a.shape[-2] >= a.shape[-1]:
            torch.testing.assert_close(torch.linalg.householder_product(h, tau).cpu(),
                                       torch.linalg.householder_product(h_c, tau_c))
        c = torch.randn(*a.shape[:-2], a.shape[-2], 3, generator=g, dtype=a.dtype)
        for left, transpose in ((True, False), (True, True), (False, False), (False, True)):
            other = c if left else c.mT
            torch.testing.assert_close(torch.ormqr(h, tau, other.to("tpu"), left, transpose).cpu(),
                                       torch.ormqr(h_c, tau_c, other, left, transpose))
    with pytest.raises(RuntimeError, match=r"tau.shape\[-1\] must be equal to min\(other.shape\[-2\], input.shape\[-1\]\)"):
        torch.ormqr(h[0], tau[0, :2], torch.randn(6, 3, device="tpu"))
    # A column in the span of others: the residual is rounding noise, so only R's leading rows
    # and the reconstruction are determined (Q's trailing columns follow the noise, on CPU too).
    dup = A[0].clone()
    dup[:, 2] = 2 * dup[:, 0] - dup[:, 1]
    Q, R = torch.linalg.qr(dup.to("tpu"))
    torch.testing.assert_close(R[:2].cpu(), torch.linalg.qr(dup).R[:2])
    torch.testing.assert_close((Q @ R).cpu(), dup)
    grads = []
    for dev in ("cpu", "tpu"):
        a = A.detach().to(dev).requires_grad_()
        Q, R = torch.linalg.qr(a)
        (Q.sum() + R.square().sum()).backward()
        grads.append(a.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])
    w = torch.empty(5, 8, device="tpu")
    torch.nn.init.orthogonal_(w)
    torch.testing.assert_close((w @ w.T).cpu(), torch.eye(5), atol=1e-5, rtol=0)


def test_pdist_like_cpu(no_fallback: None) -> None:
    # Packed row pairs i < j in CPU's order, every p branch, and the gradient (zero at coincident rows).
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    x[4] = x[1]
    for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")):
        grads = []
        for dev in ("cpu", "tpu"):
            a = x.detach().to(dev).requires_grad_()
            d = F.pdist(a, p)
            (d * torch.arange(d.numel(), dtype=d.dtype, device=dev)).sum().backward()
            grads.append((d.detach().cpu(), a.grad.cpu()))
        torch.testing.assert_close(grads[1], grads[0], msg=f"p={p}")
    assert F.pdist(torch.randn(1, 3, device="tpu")).shape == (0,)
    big = torch.randn(300, 4, generator=g)
    torch.testing.assert_close(F.pdist(big.to("tpu")).cpu(), F.pdist(big))


def test_modified_bessel_like_cpu(no_fallback: None) -> None:
    # Clenshaw's Chebyshev sums in the input's precision: within a few ulp of CPU's float32 (not
    # just of the true value), CPU's NaN at i0(inf) / i1(inf), and gradients (through i1, i1e).
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(2000, generator=g) * 30, torch.tensor([0.0, -0.0, 8.0, -8.0, 88.5, 89.0, 700.0])])
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), float("nan")])])
    fns = (torch.i0, torch.special.i0e, torch.special.i1, torch.special.i1e,
           torch.special.modified_bessel_i0, torch.special.modified_bessel_i1, torch.special.modified_bessel_k0,
           torch.special.modified_bessel_k1, torch.special.scaled_modified_bessel_k0, torch.special.scaled_modified_bessel_k1)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        xd = x.to(dtype)
        for fn in fns if dtype != torch.bfloat16 else fns[:4]:  # CPU has no bfloat16 modified_bessel_*
            got, want = fn(xd.to("tpu")).cpu(), fn(xd)
            finite = want.isfinite()
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])
            # bfloat16: CPU's vectorized loop computes in float32 (as here) but its scalar tail
            # runs i0e in bfloat16 arithmetic, up to 2 bfloat16 ulp off.
            ulp = (8 if dtype != torch.bfloat16 else 2) * torch.finfo(dtype).eps
            # atol: XLA:CPU flushes subnormal results (K0/K1 past x ~ 97 in float32) to zero.
            tiny = torch.finfo(dtype).tiny
            torch.testing.assert_close(got[finite], want[finite], rtol=ulp, atol=tiny, msg=f"{fn.__name__} {dtype}")
    assert torch.i0(torch.arange(3, device="tpu")).dtype == torch.float32
    for fn in fns[:4]:
        grads = []
        for dev in ("cpu", "tpu"):
            a = x[:50].double().to(dev).requires_grad_()
            fn(a).sum().backward()
            grads.append(a.grad.cpu())
        torch.testing.assert_close(grads[1], grads[0])


def test_weight_norm_forward_and_grads_like_cpu(no_fallback: None) -> None:
    # torch.nn.utils weight norm (wav2vec2's positional conv, vocoders): ATen's fused kernel over
    # the first or the last dim, values and both gradients; float32 and bfloat16 (float32 norms).
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=1e-6)), (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))):
        for dim, gshape in ((0, (6, 1, 1)), (2, (1, 1, 5))):
            v = torch.randn(6, 4, 5, generator=g).to(dtype)
            gv = torch.randn(gshape, generator=g).to(dtype)
            up = torch.randn(6, 4, 5, generator=g).to(dtype)
            res = []
            for dev in ("cpu", "tpu"):
                vi, gi = v.to(dev).detach().requires_grad_(), gv.to(dev).detach().requires_grad_()
                w, norm = torch._weight_norm_interface(vi, gi, dim)
                w.backward(up.to(dev))
                res.append([t.detach().cpu() for t in (w, norm, vi.grad, gi.grad)])
            for got, exp in zip(res[1], res[0], strict=True):
                assert got.dtype == exp.dtype and got.shape == exp.shape
                torch.testing.assert_close(got.float(), exp.float(), **tol)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3, groups=2), dim=2)
    x = torch.randn(2, 4, 9, generator=g)
    conv_t = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3, groups=2), dim=2).to("tpu")
    conv_t.load_state_dict(conv.state_dict())
    conv(x).square().sum().backward()
    conv_t(x.to("tpu")).square().sum().backward()
    for (name, p), pt in zip(conv.named_parameters(), conv_t.parameters(), strict=True):
        torch.testing.assert_close(pt.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_weight_norm_over_a_middle_dim_raises_like_cpu() -> None:
    v, gv = torch.randn(3, 4, 5), torch.randn(1, 4, 1)
    with pytest.raises(RuntimeError, match="first or last dim"):
        torch._weight_norm_interface(v, gv, 1)
    with pytest.raises(RuntimeError, match="first or last dim"):
        torch._weight_norm_interface(v.to("tpu"), gv.to("tpu"), 1)
    torch.testing.assert_close(torch._weight_norm(v.to("tpu"), gv.to("tpu"), 1).cpu(), torch._weight_norm(v, gv, 1))
