"""Reductions, matrix products and nn ops on tpu vs CPU (csrc/lowering/{reduction,matmul,nn}.cc).

Every case runs the op on CPU and on tpu and compares; a fixture asserts that none of the ops
lowered in those files ran on the CPU fallback.
"""

import math

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from tests.conftest import assert_same as _assert_same
from tests.conftest import to_dev

DEV = "tpu"

# ATen base names lowered by reduction.cc / matmul.cc / normalization.cc / losses.cc.
LOWERED = {
    "sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
    "var_mean", "std_mean", "norm", "linalg_vector_norm", "all", "any", "logsumexp", "cumsum",
    "cumprod", "count_nonzero", "aminmax",
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "addr", "mv", "dot", "vdot",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
    "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
    "embedding_dense_backward", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
    "nll_loss2d_backward", "mse_loss", "mse_loss_backward",
}


def _base(name) -> str:
    s = str(name)
    s = s.split("::")[-1]
    return s.split(".")[0]


def _fallback_counts() -> dict:
    st = torch_tpu.fallback_stats()
    if isinstance(st, dict):
        items = st.items()
    else:
        items = [(k, 1) for k in st]
    out = {}
    for k, v in items:
        b = _base(k)
        out[b] = out.get(b, 0) + (v if isinstance(v, int) else 1)
    return out


def _new_fallbacks(before: dict) -> dict:
    after = _fallback_counts()
    return {k: after[k] - before.get(k, 0) for k in after if k in LOWERED and after[k] != before.get(k, 0)}


@pytest.fixture(autouse=True)
def no_fallback(request):
    before = _fallback_counts()
    request.node.fallback_before = before
    yield
    if request.node.get_closest_marker("xfail") is None:
        bad = _new_fallbacks(before)
        assert not bad, f"ops ran on the CPU fallback: {bad}"


def assert_lowered(request):
    """In-body variant of the fixture's check (for xfail-marked tests)."""
    bad = _new_fallbacks(request.node.fallback_before)
    assert not bad, f"ops ran on the CPU fallback: {bad}"


TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def assert_same(got, exp, tol=None):
    _assert_same(got, exp, tol, table=TOL)


def check(fn, *args, tol=None, **kw):
    exp = fn(*args, **kw)
    got = fn(*to_dev(args), **{k: to_dev(v) for k, v in kw.items()})
    assert_same(got, exp, tol)
    return got


def rand(shape, dtype=torch.float32, lo=-3, hi=3, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape) * 7 + len(shape))
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        lo = max(lo, 0)
    return torch.randint(lo, hi, shape, generator=g, dtype=dtype)


# Norm backward ops take a bool[] output_mask (the runtime passes it as 0/1 ints).
NEEDS_BOOL_LIST = pytest.mark.usefixtures()

FLOATS = [torch.float32, torch.bfloat16, torch.float64]
DIMS = [None, 0, -1, (0, 2), ()]


# ------------------------------------------------------------------ sum / mean / prod
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64, torch.bool, torch.uint8])
@pytest.mark.parametrize("dim", DIMS)
def test_sum(dtype, dim):
    x = rand((3, 4, 5), dtype)
    if dim is None:
        check(torch.sum, x)
    else:
        for keep in (False, True):
            check(torch.sum, x, dim, keepdim=keep)


def test_sum_dtype_arg_and_0d():
    x = rand((3, 4), torch.bfloat16)
    check(lambda t: torch.sum(t, 1, dtype=torch.float32), x)
    check(lambda t: torch.sum(t, dtype=torch.float64), rand((3, 4), torch.int32))
    check(torch.sum, torch.tensor(2.5))
    check(lambda t: torch.sum(t, 0, keepdim=True), torch.tensor(2.5))
    check(lambda t: torch.sum(t, 0), torch.zeros(0, 3))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", DIMS)
def test_mean(dtype, dim):
    x = rand((3, 4, 5), dtype)
    if dim is None:
        check(torch.mean, x)
    else:
        for keep in (False, True):
            check(torch.mean, x, dim, keepdim=keep)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64, torch.bool])
def test_prod(dtype):
    x = rand((3, 4), dtype, lo=-2, hi=3) if not dtype.is_floating_point else rand((3, 4), dtype, -1.5, 1.5)
    check(torch.prod, x)
    for keep in (False, True):
        check(torch.prod, x, -1, keepdim=keep)
    check(lambda t: torch.prod(t, 0, dtype=torch.float64), x)


# ------------------------------------------------------------------ amax / amin / max / min
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.uint8, torch.bool])
def test_amax_amin(dtype):
    x = rand((3, 4, 5), dtype, lo=0, hi=4)
    for op in (torch.amax, torch.amin):
        check(op, x)
        check(op, x, ())
        check(op, x, -1)
        check(op, x, (0, 2), keepdim=True)


def test_amax_nan():
    x = rand((3, 4))
    x[1, 2] = float("nan")
    check(torch.amax, x, 1)
    check(torch.amin, x, 0)
    check(torch.max, x)
    check(torch.min, x)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.int32, torch.bool])
def test_max_min_dim(dtype):
    x = rand((4, 6), dtype, lo=0, hi=3)  # ties: first occurrence
    if dtype.is_floating_point:
        x = x.round()
    for op in (torch.max, torch.min):
        check(op, x)
        for d in (0, 1, -1):
            for keep in (False, True):
                check(op, x, d, keepdim=keep)


def test_max_dim_nan_and_0d():
    x = rand((3, 5))
    x[0, 3] = float("nan")
    x[0, 4] = float("nan")
    x[2, 0] = float("nan")
    check(torch.max, x, 1)
    check(torch.min, x, 1)
    check(torch.argmax, x, 1)
    check(torch.argmin, x)
    s = torch.tensor(1.5)
    check(torch.max, s, 0)
    check(torch.min, s, -1, keepdim=True)
    check(torch.argmax, s)
    check(torch.amax, s)


def test_max_other():
    a, b = rand((3, 4)), rand((4,), seed=1)
    a[0, 0] = float("nan")
    check(torch.max, a, b)
    check(torch.min, a, b)
    check(torch.maximum, a, b)
    check(torch.max, rand((3, 4), torch.int32), rand((3, 4), torch.int32, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_argmax_argmin(dtype):
    x = rand((4, 6), dtype, lo=0, hi=3)
    if dtype.is_floating_point:
        x = x.round()
    for op in (torch.argmax, torch.argmin):
        check(op, x)
        check(op, x, keepdim=True)
        for d in (0, -1):
            for keep in (False, True):
                check(op, x, d, keepdim=keep)


def test_aminmax():
    x = rand((4, 6))
    check(torch.aminmax, x)
    check(lambda t: torch.aminmax(t, dim=1), x)
    check(lambda t: torch.aminmax(t, dim=-2, keepdim=True), x)
    check(torch.aminmax, rand((4, 6), torch.int32))


# ------------------------------------------------------------------ var / std
@pytest.mark.parametrize("dtype", FLOATS)
def test_var_std(dtype):
    x = rand((4, 5, 6), dtype)
    for op in (torch.var, torch.std, torch.var_mean, torch.std_mean):
        check(op, x)
        check(lambda t, op=op: op(t, unbiased=False), x)
        check(lambda t, op=op: op(t, 1, keepdim=True), x)
        check(lambda t, op=op: op(t, (0, -1), correction=0), x)
        check(lambda t, op=op: op(t, -1, correction=2), x)
    check(lambda t: torch.var(t, 0, correction=0.5), x)
    # N - correction <= 0 -> inf / nan like PyTorch
    check(lambda t: torch.var(t, 0), rand((1, 3), dtype))
    check(lambda t: torch.var(t, correction=0), torch.tensor(2.0, dtype=dtype))


# ------------------------------------------------------------------ norms
@pytest.mark.parametrize("ord", [2, 1, math.inf, -math.inf, 0, 3, 0.5, -1])
def test_vector_norm(ord):
    x = rand((4, 5))
    x[0, 1] = 0
    check(lambda t: torch.linalg.vector_norm(t, ord), x)
    check(lambda t: torch.linalg.vector_norm(t, ord, dim=1), x)
    check(lambda t: torch.linalg.vector_norm(t, ord, dim=(0,), keepdim=True), x)


def test_norm_variants():
    x = rand((4, 5))
    check(torch.norm, x)
    check(lambda t: torch.norm(t, 1), x)
    check(lambda t: torch.norm(t, dim=1), x)
    check(lambda t: torch.norm(t, p=3, dim=-1, keepdim=True), x)
    check(lambda t: torch.linalg.vector_norm(t, 2, dtype=torch.float64), x)
    check(lambda t: torch.linalg.vector_norm(t), rand((4, 5), torch.bfloat16))
    check(lambda t: torch.linalg.vector_norm(t, 2), rand((6,), torch.float64))


# ------------------------------------------------------------------ all / any / count_nonzero
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float32, torch.int64])
def test_all_any(dtype):
    x = rand((3, 4), dtype, lo=0, hi=2) if dtype != torch.float32 else rand((3, 4)).round()
    x[0] = 1
    for op in (torch.all, torch.any):
        check(op, x)
        check(op, x, 1)
        check(op, x, -2, keepdim=True)
        check(op, x, dim=(0, 1))
    nan = torch.tensor([float("nan"), 1.0])
    check(torch.all, nan)


def test_count_nonzero():
    x = rand((3, 4), torch.int64, lo=0, hi=2)
    check(torch.count_nonzero, x)
    check(torch.count_nonzero, x, 0)
    check(torch.count_nonzero, x, (0, 1))
    check(torch.count_nonzero, rand((3, 4)).round(), -1)


# ------------------------------------------------------------------ logsumexp
@pytest.mark.parametrize("dtype", FLOATS)
def test_logsumexp(dtype):
    x = rand((4, 6), dtype) * 10
    x[1] = -math.inf
    x[2, 3] = math.inf
    check(torch.logsumexp, x, 1)
    check(torch.logsumexp, x, (0, 1), keepdim=True)
    check(torch.logsumexp, x, -2)
    check(torch.logsumexp, rand((3, 4), torch.int64), 1)


# ------------------------------------------------------------------ cumsum / cumprod
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64, torch.bool])
def test_cumsum_cumprod(dtype):
    x = rand((3, 37), dtype, lo=-2, hi=3) if not dtype.is_floating_point else rand((3, 37), dtype, -1.1, 1.1)
    check(torch.cumsum, x, 1)
    check(torch.cumsum, x, -2)
    check(torch.cumprod, x[:, :9], 1)
    check(lambda t: torch.cumsum(t, 0, dtype=torch.float64), x)
    check(torch.cumsum, torch.tensor(3.0), 0)


# ------------------------------------------------------------------ out=
def test_out_variant():
    x = rand((3, 4))
    o = torch.empty(3, device=DEV)
    r = torch.sum(x.to(DEV), 1, out=o)
    assert r is o
    assert_same(o, x.sum(1))
    oi = torch.empty(3, dtype=torch.long, device=DEV)
    ov = torch.empty(3, device=DEV)
    torch.max(x.to(DEV), 1, out=(ov, oi))
    assert_same((ov, oi), tuple(torch.max(x, 1)))
    om = torch.empty(3, 5, device=DEV)
    torch.mm(x.to(DEV), rand((4, 5), seed=3).to(DEV), out=om)
    assert_same(om, x @ rand((4, 5), seed=3))


# ------------------------------------------------------------------ matmul family
MM_TYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32]


@pytest.mark.parametrize("dtype", MM_TYPES)
def test_mm_family(dtype):
    a, b = rand((4, 3), dtype, seed=1), rand((3, 5), dtype, seed=2)
    check(torch.mm, a, b)
    check(torch.matmul, a, b)
    check(torch.bmm, rand((2, 4, 3), dtype, seed=3), rand((2, 3, 5), dtype, seed=4))
    check(torch.mv, a, rand((3,), dtype, seed=5))
    check(torch.dot, rand((7,), dtype, seed=6), rand((7,), dtype, seed=7))
    check(torch.outer, rand((4,), dtype, seed=8), rand((3,), dtype, seed=9))
    if dtype != torch.bfloat16:
        check(torch.vdot, rand((7,), dtype, seed=6), rand((7,), dtype, seed=7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_addmm_family(dtype):
    fl = dtype.is_floating_point
    beta, alpha = (0.5, 2.0) if fl else (2, 3)
    m1, m2 = rand((4, 3), dtype, seed=1), rand((3, 5), dtype, seed=2)
    check(torch.addmm, rand((4, 5), dtype), m1, m2)
    check(lambda s, x, y: torch.addmm(s, x, y, beta=beta, alpha=alpha), rand((5,), dtype), m1, m2)
    b1, b2 = rand((2, 4, 3), dtype, seed=3), rand((2, 3, 5), dtype, seed=4)
    check(lambda s, x, y: torch.baddbmm(s, x, y, beta=beta, alpha=alpha), rand((2, 4, 5), dtype), b1, b2)
    check(lambda s, x, y: torch.addbmm(s, x, y, beta=beta, alpha=alpha), rand((4, 5), dtype), b1, b2)
    check(lambda s, x, y: torch.addmv(s, x, y, beta=beta, alpha=alpha), rand((4,), dtype), m1, rand((3,), dtype))
    check(lambda s, x, y: torch.addr(s, x, y, beta=beta, alpha=alpha), rand((4, 3), dtype), rand((4,), dtype),
          rand((3,), dtype, seed=9))


def test_addmm_beta_zero_ignores_nan():
    s = torch.full((4, 5), float("nan"))
    m1, m2 = rand((4, 3), seed=1), rand((3, 5), seed=2)
    check(lambda a, x, y: torch.addmm(a, x, y, beta=0), s, m1, m2)
    check(lambda a, x, y: torch.addmm(a, x, y, beta=0.0, alpha=0.5), s, m1, m2)
    check(lambda a, x, y: torch.baddbmm(a, x, y, beta=0), torch.full((2, 4, 5), float("inf")),
          rand((2, 4, 3)), rand((2, 3, 5)))
    check(lambda a, x, y: torch.addmv(a, x, y, beta=0), torch.full((4,), float("nan")), m1, rand((3,)))
    check(F.linear, rand((2, 3)), rand((5, 3), seed=3), rand((5,), seed=4))


# ------------------------------------------------------------------ nn
@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax(dtype):
    x = rand((4, 7), dtype) * 4
    for op in (torch.softmax, torch.log_softmax):
        check(op, x, -1)
        check(op, x, 0)
        check(op, torch.tensor(1.5, dtype=dtype), 0)
    if dtype == torch.bfloat16:
        check(lambda t: torch.softmax(t, 1, dtype=torch.float32), x)
    x[1] = -math.inf  # fully masked row -> nan, like PyTorch
    check(torch.softmax, x, 1)


def grad_check(fn, inputs, tol=None, seed=5):
    """Forward + backward of fn on CPU vs tpu for the inputs that require grad."""
    cpu_in = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    dev_in = [t.to(DEV).requires_grad_(t.is_floating_point()) for t in inputs]
    out_c = fn(*cpu_in)
    out_d = fn(*dev_in)
    assert_same(out_d.detach(), out_c.detach(), tol)
    g = rand(tuple(out_c.shape), out_c.dtype, seed=seed)
    out_c.backward(g)
    out_d.backward(g.to(DEV))
    for c, d in zip(cpu_in, dev_in, strict=True):
        if c.grad is not None:
            assert_same(d.grad, c.grad, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_backward(dtype):
    x = rand((4, 7), dtype)
    grad_check(lambda t: torch.softmax(t, -1), [x])
    grad_check(lambda t: torch.log_softmax(t, 0), [x])


@pytest.mark.parametrize("dtype", FLOATS)
def test_layer_norm(dtype):
    x, w, b = rand((2, 3, 8), dtype), rand((8,), dtype, seed=1), rand((8,), dtype, seed=2)
    check(lambda t, w, b: F.layer_norm(t, (8,), w, b), x, w, b)
    check(lambda t: F.layer_norm(t, (3, 8)), x)
    exp = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
    got = torch.ops.aten.native_layer_norm(x.to(DEV), [8], None, None, 1e-5)
    assert_same(got[0], exp[0])
    # mean/rstd: PyTorch's meta says float32 for bfloat16 input where the CPU kernel gives bfloat16.
    for g, e in zip(got[1:], exp[1:], strict=True):
        assert_same(g.to(e.dtype), e)


@NEEDS_BOOL_LIST
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_norm_backward(dtype, request):
    x, w, b = rand((2, 3, 8), dtype), rand((8,), dtype, seed=1), rand((8,), dtype, seed=2)
    grad_check(lambda t, w, b: F.layer_norm(t, (8,), w, b), [x, w, b])
    grad_check(lambda t: F.layer_norm(t, (3, 8)), [x])
    assert_lowered(request)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_norm(dtype):
    x, w, b = rand((2, 6, 5), dtype), rand((6,), dtype, seed=1), rand((6,), dtype, seed=2)
    check(lambda t, w, b: F.group_norm(t, 3, w, b), x, w, b)
    check(lambda t: torch.ops.aten.native_group_norm(t, None, None, 2, 6, 5, 2, 1e-5), x)


@NEEDS_BOOL_LIST
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_norm_backward(dtype, request):
    x, w, b = rand((2, 6, 5), dtype), rand((6,), dtype, seed=1), rand((6,), dtype, seed=2)
    grad_check(lambda t, w, b: F.group_norm(t, 3, w, b), [x, w, b])
    grad_check(lambda t, w, b: F.group_norm(t, 2, w, b), [rand((2, 6, 2, 3), dtype), w, b])
    assert_lowered(request)


@pytest.mark.parametrize("dtype", FLOATS)
def test_fused_rms_norm(dtype):
    x, w = rand((2, 3, 8), dtype), rand((8,), dtype, seed=1)
    check(lambda t, w: torch.ops.aten._fused_rms_norm(t, [8], w, 1e-6), x, w)
    check(lambda t: torch.ops.aten._fused_rms_norm(t, [3, 8], None, None), x)



@pytest.mark.parametrize("n", [2048, 2560, 4096, 8192])
def test_trailing_row_sums_as_accurate_as_cpu(n):
    # Sums over trailing rows of up to 2048 elements are a product with ones (shape_util.h
    # row_sum); longer rows divisible by 8 are first folded 8 at a time (2560: 320, 40, 5;
    # 8192: 1024, 128, 16, 2), then the product. Rows of mean 100 are cancellation-prone: the f32
    # error against float64 must stay within 2x of ATen's own for sum, mean, layer norm, softmax,
    # log_softmax (forward and input gradient), RMS norm, var and std (4096-element rows through
    # the product were 3x).
    g = torch.Generator().manual_seed(n)
    x = torch.randn(16, n, generator=g) * 3 + 100
    w, b, go = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(16, n, generator=g)

    def ln_and_grad(t, w, b, go):
        t = t.detach().requires_grad_()
        y = F.layer_norm(t, (n,), w, b)
        (gx,) = torch.autograd.grad(y, t, go)
        return y.detach(), gx

    def with_grad(fn):  # forward and input gradient of a trailing-dim op
        def run(t, go):
            t = t.detach().requires_grad_()
            y = fn(t)
            (gx,) = torch.autograd.grad(y, t, go)
            return y.detach(), gx

        return run

    cases = {
        "sum": (lambda t: t.sum(-1), (x,)),
        "mean": (lambda t: t.mean(-1, keepdim=True), (x,)),
        "layer_norm": (ln_and_grad, (x, w, b, go)),
        "rms_norm": (lambda t, w: F.rms_norm(t, (n,), w), (x, w)),
        "softmax": (with_grad(lambda t: torch.softmax(t, -1)), (x, go)),
        "log_softmax": (with_grad(lambda t: torch.log_softmax(t, -1)), (x, go)),
    }
    if n <= 2048:  # longer rows: var error 2.5-3.5x ATen's at 2560-8192, as with the reduce before (known gap)
        cases["var"] = (lambda t: torch.var(t, -1), (x,))
        cases["std_mean"] = (lambda t: torch.std_mean(t, -1, keepdim=True), (x,))
    for name, (fn, args) in cases.items():
        ref = fn(*(a.double() for a in args))
        cpu, tpu = fn(*args), fn(*to_dev(args))
        for r, c, t in zip(*(o if isinstance(o, tuple) else (o,) for o in (ref, cpu, tpu)), strict=True):
            err_cpu = (c.double() - r).abs().max().item()
            err_tpu = (t.cpu().double() - r).abs().max().item()
            assert err_tpu <= 2 * err_cpu + 1e-7, f"{name} n={n}: tpu error {err_tpu:.3g} vs CPU {err_cpu:.3g}"


@pytest.mark.parametrize("shape,dims,dtype", [
    ((16, 4096), (-1,), torch.float32),        # folded 8 at a time down to 8, then the product
    ((3, 5, 2560), (-1,), torch.float32),      # 320, 40, 5 (not a power of two)
    ((4, 8, 512), (-2, -1), torch.float32),    # two trailing dims, 4096 elements
    ((5, 2056), (-1,), torch.float32),         # 257 after one fold: the product of odd length
    ((6, 4100), (-1,), torch.float32),         # not divisible by 8: the plain reduce
    ((2, 16384), (-1,), torch.float64),
    ((4096,), (0,), torch.float32),            # one row
])
def test_long_trailing_row_sums(shape, dims, dtype):
    # shape_util.h row_sum's fold of rows over 2048 elements ([M, 8, n/8] summed over the 8):
    # every element counted once, in its own row, for sum/mean/var/softmax/layer norm, with
    # inf/nan rows (first element and middle) as CPU gives them.
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x = (torch.randn(*shape, generator=g) * 2 + torch.arange(shape[-1]) / shape[-1]).to(dtype)
    if x.dim() > 1 and x.shape[0] > 3:
        x[1].view(-1)[0] = float("inf")
        x[2].view(-1)[x[2].numel() // 2 + 3] = float("nan")
        x[3].view(-1)[-1] = float("-inf")
    rows = x.flatten(x.dim() - len(dims)) if len(dims) > 1 else x
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-10)
    xt = x.to(DEV)
    for fn in (lambda t: t.sum(dims), lambda t: t.mean(dims, keepdim=True), lambda t: t.var(dims),
               lambda t: t.square().sum(dims)):
        _assert_same(fn(xt), fn(x), tol)
    # Softmax/layer norm over the (flattened) trailing rows.
    rt = rows.to(DEV)
    _assert_same(torch.softmax(rt, -1), torch.softmax(rows, -1), tol)
    _assert_same(F.layer_norm(rt, rows.shape[-1:]), F.layer_norm(rows, rows.shape[-1:]), tol)
    # Exactness of the bookkeeping: integer-valued rows sum exactly in f32 (all partials < 2**24).
    k = torch.randint(-64, 64, shape, generator=g).to(dtype)
    _assert_same(k.to(DEV).sum(dims), k.sum(dims))


@NEEDS_BOOL_LIST
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_rms_norm_backward(dtype, request):
    from torch._decomp.decompositions import _fused_rms_norm_backward as ref  # no CPU kernel

    x, w = rand((2, 3, 8), dtype), rand((8,), dtype, seed=1)
    rstd = torch.ops.aten._fused_rms_norm(x, [8], w, 1e-6)[1]
    go = rand((2, 3, 8), dtype, seed=4)
    exp = ref(go, x, [8], rstd, w, [True, True])
    got = torch.ops.aten._fused_rms_norm_backward(*to_dev((go, x)), [8], rstd.to(DEV), w.to(DEV), [True, True])
    assert_same(got, exp)
    assert_lowered(request)


@pytest.mark.parametrize("scale", [False, True])
def test_embedding_backward(scale):
    idx = torch.tensor([[1, 3, 3], [0, 9, 1]])
    grad = rand((2, 3, 4))
    check(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 10, -1, scale), grad, idx)
    check(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 10, 3, scale), grad, idx)
    w = rand((10, 4))
    grad_check(lambda w, i: F.embedding(i, w, padding_idx=1), [w, idx])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss(reduction):
    x = torch.log_softmax(rand((5, 4)), 1)
    t = torch.tensor([0, 3, 1, -100, 3])
    w = rand((4,), lo=0.5, hi=2, seed=3)
    check(lambda a, b: F.nll_loss(a, b, reduction=reduction), x, t)
    check(lambda a, b, w: F.nll_loss(a, b, w, reduction=reduction), x, t, w)
    check(lambda a, b: F.nll_loss(a, b, ignore_index=3, reduction=reduction), x, t.clamp(min=0))
    check(lambda a, b: F.nll_loss(a, b, reduction=reduction), x[0], t[1])
    grad_check(lambda a: F.nll_loss(a, t.to(a.device), w.to(a.device), reduction=reduction), [x])
    x4 = rand((2, 4, 3, 3))
    t4 = rand((2, 3, 3), torch.int64, lo=0, hi=4)
    grad_check(lambda a: F.nll_loss(a, t4.to(a.device), reduction=reduction), [x4])
    grad_check(lambda a: F.cross_entropy(a, t.clamp(min=0).to(a.device), reduction=reduction), [rand((5, 4))])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_mse_loss(reduction):
    a, b = rand((4, 5)), rand((4, 5), seed=1)
    check(lambda x, y: F.mse_loss(x, y, reduction=reduction), a, b)
    grad_check(lambda x, y: F.mse_loss(x, y, reduction=reduction), [a, b])
    check(lambda x, y: F.mse_loss(x, y, reduction=reduction), rand((4, 5), torch.bfloat16),
          rand((4, 5), torch.bfloat16, seed=1))


def test_means_of_rows_with_inf_and_nan_like_cpu():
    # mean / var / layer norm shift each row by its first element for precision (shape_util.h
    # row_mean); a non-finite first element must not turn an inf mean into nan.
    x = torch.randn(5, 8)
    x[0, 0], x[1, 3], x[2, 0], x[3, 0], x[3, 1] = float("inf"), float("-inf"), float("nan"), float("inf"), -float("inf")
    for fn in (lambda t: t.mean(-1), lambda t: t.mean(0), lambda t: torch.var_mean(t, -1),
               lambda t: F.layer_norm(t, (8,))):
        ref, got = fn(x), fn(x.to("tpu"))
        for r, g in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,), strict=True):
            torch.testing.assert_close(g.cpu(), r, equal_nan=True)
