"""Indexing, joining and shape-manipulating ops (csrc/lowering/indexing.cc, shape_ops.cc):
tpu results against CPU, incl. negative dims, duplicates, in-place and out= variants."""

import pytest
import torch
import torch_tpu

from tests.conftest import assert_same as _assert_same
from tests.conftest import to_dev

DEV = "tpu"

if hasattr(torch_tpu, "reset_fallback_stats"):
    torch_tpu.reset_fallback_stats()

# ATen base names lowered by indexing.cc / shape_ops.cc: none of them may hit the CPU fallback.
MY_OPS = {
    "index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index", "index_put",
    "_index_put_impl", "index_add", "index_copy", "index_fill", "masked_fill", "masked_scatter",
    "take", "put", "embedding", "cat", "stack", "flip", "roll", "repeat", "tril", "triu",
    "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
    "replication_pad2d", "sort", "topk", "diag_embed", "arange", "linspace", "eye", "fill", "zero",
}


def assert_same(got, exp, exact=True, atol=1e-6, rtol=1e-5):
    _assert_same(got, exp, None if exact else dict(atol=atol, rtol=rtol))


def check(fn, *args, exact=True, atol=1e-6, rtol=1e-5, **kwargs):
    exp = fn(*args, **kwargs)
    got = fn(*to_dev(args), **{k: to_dev(v) for k, v in kwargs.items()})
    assert_same(got, exp, exact, atol, rtol)


def gen():
    g = torch.Generator().manual_seed(0)
    return g


G = gen()
X = torch.randn(4, 5, generator=G)
XI = torch.randint(-10, 10, (4, 5), generator=G)
XB = torch.rand(4, 5, generator=G) > 0.5
XBF = X.bfloat16()
A4 = torch.randn(3, 4, 5, 6, generator=G)


# ------------------------------------------------------------------ index_select / gather
@pytest.mark.parametrize("t", [X, XI, XB, XBF], ids=["f32", "i64", "bool", "bf16"])
def test_index_select(t):
    check(torch.index_select, t, -2, torch.tensor([3, 0, 3, 1]))
    check(torch.index_select, t, 1, torch.tensor([4, 4, 0], dtype=torch.int32))


def test_index_select_out_and_empty():
    out = torch.empty(2, 5)
    idx = torch.tensor([1, 2])
    exp = torch.index_select(X, 0, idx, out=out)
    out_d = torch.empty(2, 5, device=DEV)
    res = torch.index_select(X.to(DEV), 0, idx.to(DEV), out=out_d)
    assert res is out_d
    assert_same(out_d, exp)
    check(torch.index_select, X, 0, torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("t", [X, XI, XBF], ids=["f32", "i64", "bf16"])
def test_gather(t):
    check(torch.gather, t, -1, torch.randint(0, 5, (3, 4), generator=G))
    check(torch.gather, t, 0, torch.randint(0, 4, (2, 5), generator=G))


# ------------------------------------------------------------------ scatter family
UIDX = torch.stack([torch.randperm(5, generator=G)[:3] for _ in range(2)])  # unique per row
DIDX = torch.randint(0, 4, (3, 5), generator=G)  # duplicates along dim 0
SRC = torch.randn(4, 5, generator=G)


def test_scatter():
    check(torch.scatter, X, 1, UIDX, SRC)
    check(torch.scatter, X, -1, UIDX, 2.5)
    check(torch.scatter, XI, 1, UIDX, XI)
    check(torch.scatter, X, 0, DIDX, SRC, reduce="add", exact=False)
    check(torch.scatter, X, 0, DIDX, 2.0, reduce="multiply", exact=False)


def test_scatter_inplace():
    def f(x, i, s):
        y = x.clone()
        y.scatter_(1, i, s)
        y.scatter_(0, i[:1] % 4, 7.0)
        return y

    check(f, X, UIDX, SRC)


@pytest.mark.parametrize("t", [X, XI, XBF], ids=["f32", "i64", "bf16"])
def test_scatter_add(t):
    check(torch.scatter_add, t, 0, DIDX, t, exact=t.dtype == torch.int64, atol=1e-2, rtol=1e-2)

    def f(x, i, s):
        return x.clone().scatter_add_(-2, i, s)

    check(f, t, DIDX, t, exact=t.dtype == torch.int64, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("t", [X, XI], ids=["f32", "i64"])
def test_scatter_reduce(reduce, include_self, t):
    src = SRC if t.is_floating_point() else XI
    check(torch.scatter_reduce, t, 0, DIDX, src, reduce, include_self=include_self,
          exact=not t.is_floating_point())


def test_scatter_reduce_nan_and_inplace():
    xn = torch.tensor([1.0, float("nan"), 3.0, -1.0])
    idx = torch.tensor([0, 0, 1, 1])
    check(torch.scatter_reduce, torch.zeros(2), 0, idx, xn, "amax", include_self=False)
    check(torch.scatter_reduce, torch.zeros(2), 0, idx, xn, "amin")

    def f(x, i, s):
        return x.clone().scatter_reduce_(0, i, s, "sum")

    check(f, X, DIDX, SRC, exact=False)


# ------------------------------------------------------------------ advanced indexing
I1 = torch.tensor([[0, 2], [1, -1]])
I2 = torch.tensor([1, 3])
I3 = torch.tensor([-1, 0, 4], dtype=torch.int32)
INDEX_CASES = [
    (I1,),
    (slice(None), I2),
    (slice(None), I2, I2),
    (I1, slice(None), torch.tensor([0, 4])),  # non-adjacent: result dims go first
    (slice(None), slice(None), I3),
    (slice(None), I2.view(2, 1), slice(None), torch.tensor([0, 5, 1])),  # non-adjacent
    (I1, I2),
    (Ellipsis, torch.tensor([5, 0])),
]


@pytest.mark.parametrize("k", range(len(INDEX_CASES)))
def test_index(k):
    ind = INDEX_CASES[k]
    check(lambda a, *i: a[i], A4, *ind)


def test_index_dtypes_and_mask():
    check(lambda x, i: x[i], XI, torch.tensor([3, -4, 0]))
    check(lambda x, i: x[:, i], XB, torch.tensor([1, 1]))
    check(lambda x, i: x[i, 1:], XBF, torch.tensor([2, 0]))
    check(lambda x, i, j: x[i, j], X, torch.tensor([1, 2]), torch.tensor(4))
    # boolean masks are converted to integer indices by the runtime
    check(lambda x, m: x[m], X, XB)
    check(lambda x, m: x[:, m], X, torch.tensor([True, False, True, True, False]))


@pytest.mark.parametrize("k", range(len(INDEX_CASES)))
@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put(k, accumulate):
    ind = INDEX_CASES[k]
    if not accumulate and k in (0, 3, 6):
        pytest.skip("duplicate indices without accumulate are undefined")
    v = torch.randn(A4[ind].shape[-1:], generator=G)

    def _setitem(a, i, v):
        if accumulate:
            a[i] += v
        else:
            a[i] = v
        return a

    if Ellipsis in ind:
        check(lambda a, v, j: _setitem(a.clone(), (Ellipsis, j), v), A4, v, ind[-1], exact=False)
    else:
        fn = lambda a, v, *i: torch.ops.aten.index_put(  # noqa: E731
            a, [None if isinstance(q, slice) else q for q in i], v, accumulate)
        check(fn, A4, v, *ind, exact=False)


def test_index_put_duplicates_accumulate():
    dup = torch.tensor([0, 1, 0, 0, 2])

    def f(x, i, v):
        return x.clone().index_put_((i,), v, accumulate=True)

    check(f, XI, dup, torch.tensor(3))
    check(f, X, dup, torch.randn(5, 5, generator=G), exact=False)
    check(f, XBF, dup, torch.ones(5).bfloat16(), exact=False, atol=1e-2, rtol=1e-2)
    # setitem path (index_put_ through _index_put_impl_)

    def g(x, i):
        x = x.clone()
        x[i] = -1.0
        x[:, i[:2]] += 2.0
        return x

    check(g, X, torch.tensor([2, 0]))

    def h(x, m):
        x = x.clone()
        x[m] = 0.5
        return x

    check(h, X, XB)

    def h2(x, m, v):
        x = x.clone()
        x[m] = v  # one value per true position, in row-major order
        x[:, m[0]] += 1.0
        return x

    check(h2, X, XB, torch.arange(float(XB.sum())))
    a = torch.randn(3, 4, 5, generator=G)
    mask = a[0] > 0
    check(lambda a, m, v: torch.ops.aten.index_put(a, [None, m], v), a, mask, torch.randn(3, int(mask.sum())))
    check(lambda a, m, v: torch.ops.aten.index_put(a, [None, m], v, True), a, mask, torch.randn(3, 1), exact=False)


# ------------------------------------------------------------------ index_* along a dim
def test_index_add_copy_fill():
    ii = torch.tensor([0, 2, 0])
    srcd = torch.randn(4, 3, generator=G)
    check(torch.index_add, X, 1, ii, srcd, alpha=2.0, exact=False)
    check(torch.index_add, XI, -1, ii, XI[:, :3].contiguous())
    check(lambda x, i, s: x.clone().index_add_(0, i, s), X, torch.tensor([3, 3]), torch.ones(2, 5))
    check(torch.index_copy, X, 1, torch.tensor([4, 1]), srcd[:, :2].contiguous())
    check(lambda x, i, s: x.clone().index_copy_(-2, i, s), XBF, torch.tensor([1]), torch.ones(1, 5).bfloat16())
    check(torch.index_fill, X, 0, torch.tensor([1, -1, 1]), -3.0)
    check(torch.index_fill, XI, 1, torch.tensor([2]), torch.tensor(7))
    check(lambda x, i: x.clone().index_fill_(1, i, True), XB, torch.tensor([0, 3]))


# ------------------------------------------------------------------ masked ops
MASK = torch.rand(5, generator=G) > 0.5


def test_masked_fill():
    check(torch.masked_fill, X, MASK, 1.5)
    check(torch.masked_fill, XBF, MASK, torch.tensor(-2.0))
    check(torch.masked_fill, XI, XB, 3)
    check(torch.masked_fill, XB, XB, False)
    check(lambda x, m: x.clone().masked_fill_(m, float("-inf")), X, XB)


def test_masked_scatter():
    check(torch.masked_scatter, X, MASK, torch.randn(30, generator=G))
    check(torch.masked_scatter, X, torch.rand(4, 1, generator=G) > 0.3, torch.randn(3, 7, generator=G))
    check(lambda x, m, s: x.clone().masked_scatter_(m, s), XI, XB, torch.arange(20))


# ------------------------------------------------------------------ take / put / embedding
def test_take_put_embedding():
    ti = torch.tensor([[0, -1], [7, 19]])
    check(torch.take, X, ti)
    check(lambda x, i, s: x.clone().put_(i, s, accumulate=True), X, ti, torch.ones(2, 2))
    check(lambda x, i, s: x.clone().put_(i, s), XI, torch.tensor([3, 0]), torch.tensor([9, 8]))
    w = torch.randn(10, 3, generator=G)
    check(torch.nn.functional.embedding, torch.tensor([[1, 2, 9], [0, 0, 1]]), w)


# ------------------------------------------------------------------ cat / stack
def test_cat():
    check(torch.cat, [X, torch.empty(0), X * 2], -2)
    check(torch.cat, [X, XI], 1)  # type promotion
    check(torch.cat, [XB, XB[:, :2]], 1)
    check(torch.cat, [XBF, XBF], 0)
    check(torch.cat, [torch.empty(0, 5), X])
    out = torch.empty(8, 5)
    out_d = torch.empty(8, 5, device=DEV)
    exp = torch.cat([X, X], out=out)
    res = torch.cat([X.to(DEV), X.to(DEV)], out=out_d)
    assert res is out_d
    assert_same(out_d, exp)


def test_stack():
    check(torch.stack, [X, X * 2], -1)
    check(torch.stack, [XI, XI], 0)


# ------------------------------------------------------------------ reorderings
def test_flip_roll_repeat():
    check(torch.flip, X, [0, -1])
    check(torch.flip, XB, [1])
    check(torch.roll, X, [2, -7], [0, 1])
    check(torch.roll, XI, 3)
    check(lambda x: x.repeat(2, 1, 3), X)
    check(lambda x: x.repeat(2, 3), XBF)


@pytest.mark.parametrize("d", [-1, 0, 2])
def test_tril_triu(d):
    check(torch.tril, A4, d)
    check(torch.triu, XI, d)
    check(torch.triu, XB, d)
    check(lambda x: x.clone().tril_(d), X)


def test_diag_embed():
    de = torch.randn(2, 3, generator=G)
    for off, d1, d2 in [(0, -2, -1), (1, 0, 2), (-2, 2, 0)]:
        check(torch.diag_embed, de, off, d1, d2)


def test_pads():
    check(torch.constant_pad_nd, X, [1, -2, 2, 0], 9.0)
    check(torch.constant_pad_nd, XI, [0, 3], 1)
    check(torch.nn.functional.pad, XBF, (2, 2))
    x3 = torch.randn(2, 3, 5, 6, generator=G)
    F = torch.nn.functional
    check(F.pad, x3[0], (2, 3), mode="reflect")
    check(F.pad, x3, (2, 3, 1, 4), mode="reflect")
    check(F.pad, x3, (2, 3, 1, 4), mode="replicate")
    check(F.pad, x3[0], (0, 3), mode="replicate")


@pytest.mark.parametrize("pad", [(-6, 5, 0, 0), (0, 0, 2, -5), (7, -6, -5, 3), (-2, -1, 4, 6)])
def test_replicate_pad_cropping_a_whole_side(no_fallback, pad):
    # A side that crops the whole dim leaves one edge element repeated (PyTorch's clamp rule);
    # was a CPU fallback. Forward and gradient vs CPU, no fallback.
    x = torch.randn(2, 3, 5, 6, generator=G, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_(True)
    out, out_t = torch.nn.functional.pad(x, pad, mode="replicate"), torch.nn.functional.pad(xt, pad, mode="replicate")
    w = torch.randn(out.shape, generator=G)
    (out * w).sum().backward()
    (out_t * w.to("tpu")).sum().backward()
    torch.testing.assert_close(out_t.cpu(), out, rtol=0, atol=0)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ sort / topk
def test_sort():
    xn = torch.tensor([[3.0, float("nan"), 1.0, 3.0, -0.0, 0.0, float("inf"), 1.0]])
    for desc in [False, True]:
        check(torch.sort, xn, dim=-1, descending=desc, stable=True)
        check(torch.sort, torch.randint(0, 4, (6, 7), generator=G), dim=0, descending=desc, stable=True)
    check(torch.sort, XB, dim=1, stable=True)
    check(torch.sort, XBF, stable=True)
    check(torch.sort, X, dim=0)  # distinct values: stable or not does not matter
    check(torch.argsort, X, dim=1, descending=True)
    vals, idx = torch.empty(4, 5), torch.empty(4, 5, dtype=torch.long)
    exp = torch.sort(X, dim=1, out=(vals, idx))
    vd, id_ = torch.empty(4, 5, device=DEV), torch.empty(4, 5, dtype=torch.long, device=DEV)
    torch.sort(X.to(DEV), dim=1, out=(vd, id_))
    assert_same((vd, id_), exp)


def test_topk():
    for largest in [True, False]:
        check(torch.topk, X, 3, dim=1, largest=largest)
        check(torch.topk, XI.float() + torch.arange(4).view(4, 1) * 0.01, 2, dim=-2, largest=largest)
    v, i = torch.topk(X.to(DEV), 3, sorted=False)
    assert_same(v.cpu().sort(dim=-1, descending=True).values.to(DEV), torch.topk(X, 3).values)


# ------------------------------------------------------------------ creation
@pytest.mark.parametrize("args,dtype", [
    ((0, 10, 1), torch.int64), ((1.5, 7.25, 0.25), torch.float32), ((0, 1, 0.1), torch.float32),
    ((-3, 20, 3), torch.int32), ((0, 1, 0.1), torch.float64), ((0, 5, 0.5), torch.bfloat16),
    ((7,), torch.float32),
])
def test_arange(args, dtype):
    exp = torch.arange(*args, dtype=dtype)
    got = torch.arange(*args, dtype=dtype, device=DEV)
    # CPU's vectorized kernel rounds differently in the last ulp for some elements.
    assert_same(got, exp, exact=not dtype.is_floating_point, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("args,dtype", [
    ((0, 1, 7), torch.float32), ((-2.5, 10, 50), torch.float32), ((0, 10, 7), torch.int64),
    ((3, -3, 11), torch.float64), ((1, 5, 1), torch.float32), ((0, 1, 9), torch.bfloat16),
])
def test_linspace(args, dtype):
    exp = torch.linspace(*args, dtype=dtype)
    got = torch.linspace(*args, dtype=dtype, device=DEV)
    assert_same(got, exp, exact=not dtype.is_floating_point, atol=1e-6, rtol=1e-6)


def test_eye_fill_zero():
    assert_same(torch.eye(3, 5, device=DEV), torch.eye(3, 5))
    assert_same(torch.eye(4, dtype=torch.bool, device=DEV), torch.eye(4, dtype=torch.bool))
    assert_same(torch.full((3, 4), 2.5, device=DEV), torch.full((3, 4), 2.5))
    check(lambda x: x.clone().fill_(2.5), X)
    check(lambda x, v: x.clone().fill_(v), XI, torch.tensor(3.7))
    check(lambda x: x.clone().zero_(), XBF)
    assert_same(torch.zeros(2, 3, dtype=torch.int32, device=DEV), torch.zeros(2, 3, dtype=torch.int32))


# ------------------------------------------------------------------ no fallback (keep last)
def _base(name):
    name = str(name)
    if name.startswith("aten::"):
        name = name[len("aten::"):]
    name = name.split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def test_zz_no_fallback_for_my_ops():
    stats = dict(torch_tpu.fallback_stats())
    why = dict(torch_tpu.fallback_reasons())
    # Boolean-mask indexing (x[mask], x[mask] = v) needs nonzero(), whose output shape depends on
    # the data: PyTorch's meta function refuses, so the runtime falls back for the whole op.
    # That is the runtime's business, not a lowering's; every other fallback of these ops is a bug.
    hit = {k: v for k, v in stats.items()
           if _base(k) in MY_OPS and "nonzero" not in str(why.get(k, ""))}
    assert not hit, f"ops fell back to CPU: {hit} ({ {k: why.get(k) for k in hit} })"
