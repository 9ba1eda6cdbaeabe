"""Pointwise ops on tpu vs CPU (csrc/lowering/elementwise_{unary,binary}.cc).

Every case runs the op on CPU and on tpu and compares (CPU results are the only expected
values); a fixture asserts that none of the ops lowered in those files ran on the CPU fallback.
"""

import math

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from tests.conftest import assert_same as _assert_same
from tests.conftest import to_dev

DEV = "tpu"
A = torch.ops.aten

# ATen base names lowered by elementwise_unary.cc / elementwise_binary.cc.
LOWERED = {
    # unary
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "sin",
    "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "sigmoid", "erf", "erfc", "erfinv", "deg2rad", "rad2deg", "angle", "silu", "mish",
    "hardsigmoid", "hardswish", "gelu", "softplus", "leaky_relu", "elu", "hardtanh", "relu",
    "logit", "sign", "sgn", "signbit", "floor", "ceil", "trunc", "frac", "round", "abs", "neg",
    "bitwise_not", "logical_not", "isnan", "isinf", "isposinf", "isneginf", "isfinite",
    "nan_to_num", "heaviside", "sinc", "hardshrink", "softshrink", "log_sigmoid_forward",
    # binary / ternary
    "add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "pow", "atan2",
    "hypot", "copysign", "xlogy", "maximum", "minimum", "fmax", "fmin", "lerp", "addcmul",
    "addcdiv", "where", "clamp", "clamp_min", "clamp_max", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_left_shift", "bitwise_right_shift", "__lshift__", "__rshift__", "threshold",
    "threshold_backward", "sigmoid_backward", "tanh_backward", "gelu_backward", "silu_backward",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "hardsigmoid_backward", "hardswish_backward", "mish_backward", "logit_backward",
    "logaddexp", "logaddexp2", "hardshrink_backward", "softshrink_backward", "log_sigmoid_backward",
}


def _base(name) -> str:
    name = str(name).split("::")[-1].split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _fallbacks() -> dict:
    out: dict = {}
    for k, v in dict(torch_tpu.fallback_stats()).items():
        out[_base(k)] = out.get(_base(k), 0) + v
    return out


@pytest.fixture(autouse=True)
def no_fallback():
    before = _fallbacks()
    yield
    after = _fallbacks()
    bad = {k: v - before.get(k, 0) for k, v in after.items() if k in LOWERED and v != before.get(k, 0)}
    assert not bad, f"ops ran on the CPU fallback: {bad}"


TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
}


def assert_same(got, exp, tol=None):
    _assert_same(got, exp, tol, table=TOL)


def check(fn, *args, tol=None):
    exp = fn(*args)
    got = fn(*to_dev(args))
    assert_same(got, exp, tol)


def rand(shape, dtype=torch.float32, lo=-3.0, hi=3.0, seed=0):
    g = torch.Generator().manual_seed(seed + 31 * sum(shape) + len(shape))
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(int(math.floor(lo)), int(math.ceil(hi)) + 1, shape, generator=g, dtype=dtype)


def with_specials(x):
    x = x.clone()
    x.view(-1)[:4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=x.dtype)
    return x


FLOATS = [torch.float32, torch.bfloat16, torch.float64]
SHAPE = (4, 8)

# ------------------------------------------------------------------ unary float functions
# name -> (fn, lo, hi, accepts integer inputs)
UNARY = {
    "exp": (torch.exp, -10, 10), "exp2": (torch.exp2, -10, 10), "expm1": (torch.expm1, -2, 2),
    "log": (torch.log, 0.01, 10), "log2": (torch.log2, 0.01, 10), "log10": (torch.log10, 0.01, 10),
    "log1p": (torch.log1p, -0.9, 3), "sqrt": (torch.sqrt, 0, 10), "rsqrt": (torch.rsqrt, 0.01, 10),
    "reciprocal": (torch.reciprocal, -3, 3), "sin": (torch.sin, -6, 6), "cos": (torch.cos, -6, 6),
    "tan": (torch.tan, -1.5, 1.5), "asin": (torch.asin, -1, 1), "acos": (torch.acos, -1, 1),
    "atan": (torch.atan, -5, 5), "sinh": (torch.sinh, -5, 5), "cosh": (torch.cosh, -5, 5),
    "tanh": (torch.tanh, -5, 5), "asinh": (torch.asinh, -5, 5), "acosh": (torch.acosh, 1, 6),
    "atanh": (torch.atanh, -0.99, 0.99), "sigmoid": (torch.sigmoid, -8, 8),
    "erf": (torch.erf, -4, 4), "erfc": (torch.erfc, -3, 3), "erfinv": (torch.erfinv, -0.999, 0.999),
    "deg2rad": (torch.deg2rad, -300, 300), "rad2deg": (torch.rad2deg, -3, 3),
    "angle": (torch.angle, -3, 3), "silu": (F.silu, -6, 6), "mish": (F.mish, -6, 6),
    "hardsigmoid": (F.hardsigmoid, -5, 5), "hardswish": (F.hardswish, -5, 5),
    "gelu": (F.gelu, -4, 4), "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), -4, 4),
    "relu": (torch.relu, -3, 3), "frac": (torch.frac, -3, 3),
    "softplus": (lambda x: F.softplus(x, 2.0, 5.0), -5, 5),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), -3, 3),
    "elu": (lambda x: A.elu(x, 1.5, 1.1, 0.9), -3, 3),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 2.0), -3, 3),
    "logit": (torch.logit, -0.1, 1.1), "logit_eps": (lambda x: torch.logit(x, 0.1), -0.1, 1.1),
    "nan_to_num": (torch.nan_to_num, -3, 3), "sinc": (torch.sinc, -3, 3),
    "hardshrink": (lambda x: F.hardshrink(x, 0.7), -2, 2), "softshrink": (F.softshrink, -2, 2),
    "logsigmoid": (F.logsigmoid, -20, 20),
    "nan_to_num_args": (lambda x: torch.nan_to_num(x, 1.0, 2.0, -3.0), -3, 3),
}
SPECIALS = {"sinc", "softshrink", "logsigmoid", "abs", "sign", "relu", "angle", "nan_to_num", "nan_to_num_args", "exp", "sigmoid", "erf", "tanh", "floor"}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_float(name, dtype):
    fn, lo, hi = UNARY[name]
    x = rand(SHAPE, dtype, lo, hi)
    if name in SPECIALS:
        x = with_specials(x)
    check(fn, x)


# float functions of integer tensors promote to the default float dtype
@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "sin", "tanh", "sigmoid", "erf", "reciprocal",
                                  "atan", "expm1", "rad2deg", "angle", "acosh"])
def test_unary_int_promotes(name):
    fn, lo, hi = UNARY[name]
    x = rand(SHAPE, torch.int32, max(lo, 1 if name in ("log", "acosh") else 0 if name == "sqrt" else -3), 5)
    check(fn, x)
    if name == "exp":
        check(fn, x.to(torch.int64))


def test_unary_accuracy_wide_ranges():
    for dt, lo, hi in [(torch.float32, -30, 30), (torch.float64, -7, 7)]:
        check(torch.erf, rand((256,), dt, lo, hi))
        check(torch.erf, rand((256,), dt, -1e-3, 1e-3))
    check(torch.erfc, rand((256,), torch.float64, -7, 25), tol=dict(rtol=1e-12, atol=0))
    check(torch.erfinv, torch.linspace(-1, 1, 2001), tol=dict(rtol=3e-6, atol=1e-6))
    check(torch.erfinv, torch.linspace(-1, 1, 2001, dtype=torch.float64), tol=dict(rtol=1e-12, atol=1e-13))
    tiny = rand((64,), torch.float32, -1e-3, 1e-3)
    for fn in (torch.sinh, torch.expm1, torch.tanh, torch.log1p, torch.asinh, torch.atanh):
        check(fn, tiny)
    check(torch.sinh, rand((64,), torch.float32, -80, 80))
    check(torch.cosh, rand((64,), torch.float32, -80, 80))
    check(torch.asinh, rand((64,), torch.float32, -1e5, 1e5))
    check(torch.acosh, rand((64,), torch.float32, 1, 1e5))


# f32 tanh / expm1 / log1p are polynomial + exp/log forms (vector code on XLA:CPU): within a few
# ulp of the float64 result over magnitudes 1e-30..80 (both branches and their seams), and -0 kept.
@pytest.mark.parametrize("name,ulps", [("tanh", 2), ("expm1", 6), ("log1p", 3)])
def test_f32_vector_forms_ulp(name, ulps):
    fn = getattr(torch, name)
    mags = torch.logspace(-30, math.log10(80), 20001, dtype=torch.float64).float()
    x = torch.cat([mags, -mags, torch.linspace(-1, 1, 4001), torch.tensor([0.0, -0.0])])
    if name == "log1p":
        x = x[x > -1]
    got = fn(x.to(DEV)).cpu()
    ref = fn(x.double())
    fin = torch.isfinite(ref.float()) & (ref.abs() > 1.2e-38)
    ulp = (torch.nextafter(ref.float().abs(), torch.tensor(math.inf)) - ref.float().abs()).double()
    err = ((got.double() - ref).abs() / ulp)[fin]
    assert err.max().item() <= ulps, f"{name}: {err.max().item():.2f} ulp at x={x[fin][err.argmax()].item()}"
    zero = torch.tensor([-0.0])
    assert torch.signbit(fn(zero.to(DEV)).cpu()).item()


# ------------------------------------------------------------------ unary ops keeping the dtype
KEEP = {
    "abs": torch.abs, "neg": torch.neg, "sign": torch.sign, "sgn": torch.sgn, "floor": torch.floor,
    "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc, "signbit": torch.signbit,
    "isnan": torch.isnan, "isinf": torch.isinf, "isfinite": torch.isfinite,
    "isposinf": torch.isposinf, "isneginf": torch.isneginf, "relu": torch.relu,
    "round_dec2": lambda x: torch.round(x, decimals=2), "round_dec-1": lambda x: torch.round(x, decimals=-1),
}


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32])
@pytest.mark.parametrize("name", sorted(KEEP))
def test_unary_keep_dtype(name, dtype):
    x = rand(SHAPE, dtype, -30, 30)
    if dtype.is_floating_point:
        x = with_specials(x)
        x.view(-1)[4:8] = torch.tensor([0.5, 1.5, 2.5, -2.5], dtype=dtype)
    try:
        KEEP[name](x)
    except RuntimeError:
        pytest.skip("not supported by PyTorch on CPU either")
    check(KEEP[name], x)


def test_unary_int_corners():
    i8 = torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8)
    check(torch.abs, i8)
    check(torch.neg, i8)
    u8 = torch.tensor([0, 1, 200, 255], dtype=torch.uint8)
    check(torch.neg, u8)
    check(torch.sign, u8)
    b = torch.tensor([True, False, True])
    check(torch.sign, b)
    check(torch.bitwise_not, b)
    check(torch.logical_not, b)
    check(torch.bitwise_not, rand(SHAPE, torch.int32, -100, 100))
    check(torch.logical_not, rand(SHAPE, torch.float32, -1, 1).round())
    check(torch.signbit, b)


def test_heaviside():
    x = rand(SHAPE, torch.float32).round()
    check(torch.heaviside, x, rand(SHAPE, torch.float32))
    check(torch.heaviside, x, torch.tensor([0.5]))


def test_unary_inplace_out_and_views():
    x = rand(SHAPE)
    check(lambda t: t.clone().exp_(), x)
    check(lambda t: t.clone().clamp_(-1, 1), x)
    check(lambda t: torch.sigmoid(t, out=torch.empty_like(t)), x)
    check(lambda t: torch.erf(t.t()), x)
    check(lambda t: torch.tanh(t[:, ::2]), x)
    check(torch.exp, torch.tensor(1.5))
    check(torch.exp, torch.zeros(0, 3))
    check(lambda t: torch.add(t, 1, out=torch.empty(SHAPE, dtype=torch.float64, device=t.device)), x)
    # computed in float32, then written to the float64 out
    check(lambda t: torch.exp(t, out=torch.empty(SHAPE, dtype=torch.float64, device=t.device)), x,
          tol=TOL[torch.float32])


# ------------------------------------------------------------------ binary arithmetic
def binary_variants(fn, dtype, first, lo=-3, hi=3, lo2=None, hi2=None, nonzero=False, scalar=True,
                    inplace=True):
    """All dtypes: same-shape operands. First dtype of an op also: broadcasting, Python scalar,
    0-d CPU and device tensors, in-place and out= (keeps the number of compiled programs low)."""
    x = rand(SHAPE, dtype, lo, hi)
    y = rand(SHAPE, dtype, lo if lo2 is None else lo2, hi if hi2 is None else hi2, seed=1)
    if nonzero:
        y = torch.where(y == 0, torch.ones_like(y), y)
    check(fn, x, y)
    if not first:
        return
    check(fn, x, y[0])  # broadcast
    check(fn, x[:, :1], y)  # broadcast the other way
    if scalar:
        s = 2.5 if dtype.is_floating_point else 3
        check(lambda a: fn(a, s), x)  # Python scalar
        check(lambda a: fn(a, torch.tensor(s)), x)  # 0-d CPU tensor
        check(fn, x, torch.tensor(s))  # 0-d device tensor
    if inplace:
        check(lambda a, b: fn(a.clone(), b, inplace=True), x, y)
        check(lambda a, b: fn(a, b, out=torch.empty_like(a)), x, y)


def method(name, **fixed):
    def fn(a, b, inplace=False, out=None):
        if inplace:
            return getattr(a, name + "_")(b, **fixed)
        if out is not None:
            return getattr(torch, name)(a, b, out=out, **fixed)
        return getattr(torch, name)(a, b, **fixed)
    return fn


ARITH = {  # name -> (fn, dtypes, kwargs of binary_variants)
    "add": (method("add"), FLOATS + [torch.int32, torch.int64, torch.bool], {}),
    "add_alpha": (method("add", alpha=2), FLOATS + [torch.int64], {}),
    "sub_alpha": (method("sub", alpha=2), FLOATS + [torch.int32], {}),
    "mul": (method("mul"), FLOATS + [torch.int32, torch.int64, torch.bool], {}),
    "div": (method("div"), FLOATS + [torch.int32], dict(nonzero=True, inplace=False)),
    "div_trunc": (method("div", rounding_mode="trunc"), FLOATS + [torch.int32, torch.int64], dict(nonzero=True)),
    "div_floor": (method("div", rounding_mode="floor"), FLOATS + [torch.int32, torch.int64], dict(nonzero=True)),
    "floor_divide": (method("floor_divide"), FLOATS + [torch.int64], dict(nonzero=True)),
    "remainder": (method("remainder"), FLOATS + [torch.int32, torch.int64], dict(nonzero=True)),
    "fmod": (method("fmod"), FLOATS + [torch.int64], dict(nonzero=True)),
    "pow": (method("pow"), FLOATS, dict(lo=0.1, hi=3, lo2=-2, hi2=2)),
    "pow_int": (method("pow"), [torch.int32, torch.int64], dict(lo=-3, hi=3, lo2=0, hi2=5)),
    "atan2": (method("atan2"), FLOATS, dict(scalar=False)),
    "hypot": (method("hypot"), FLOATS, dict(lo=-1e3, hi=1e3, scalar=False)),
    "copysign": (method("copysign"), FLOATS, {}),
    "xlogy": (method("xlogy"), FLOATS, dict(lo=-1, hi=3, lo2=0, hi2=3)),
    "maximum": (method("maximum"), FLOATS + [torch.int32], dict(scalar=False, inplace=False)),
    "minimum": (method("minimum"), FLOATS + [torch.int64], dict(scalar=False, inplace=False)),
    "fmax": (method("fmax"), FLOATS, dict(scalar=False, inplace=False)),
    "fmin": (method("fmin"), FLOATS, dict(scalar=False, inplace=False)),
    "logaddexp": (method("logaddexp"), FLOATS, dict(lo=-5, hi=5, scalar=False, inplace=False)),
    "logaddexp2": (method("logaddexp2"), FLOATS, dict(lo=-5, hi=5, scalar=False, inplace=False)),
    "bitwise_and": (method("bitwise_and"), [torch.int32, torch.bool, torch.uint8], dict(lo=0, hi=100)),
    "bitwise_or": (method("bitwise_or"), [torch.int64, torch.bool], dict(lo=0, hi=100)),
    "bitwise_xor": (method("bitwise_xor"), [torch.int32, torch.bool], dict(lo=0, hi=100)),
    "logical_and": (method("logical_and"), [torch.bool, torch.float32, torch.int32], dict(lo=-1, hi=1, scalar=False)),
    "logical_or": (method("logical_or"), [torch.bool, torch.int32], dict(lo=-1, hi=1, scalar=False)),
    "logical_xor": (method("logical_xor"), [torch.bool, torch.float32], dict(lo=-1, hi=1, scalar=False)),
}
CASES = [(n, d) for n, (_, ds, _) in ARITH.items() for d in ds]


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{str(d).split('.')[-1]}" for n, d in CASES])
def test_binary(name, dtype):
    fn, dtypes, kw = ARITH[name]
    binary_variants(fn, dtype, dtype == dtypes[0], **kw)


def test_binary_nan_and_signed_zero():
    x = rand(SHAPE)
    y = rand(SHAPE, seed=1)
    x.view(-1)[:3] = math.nan
    y.view(-1)[2:5] = math.nan
    x.view(-1)[5:8] = torch.tensor([math.inf, -math.inf, math.inf])
    y.view(-1)[5:8] = torch.tensor([math.inf, -math.inf, -math.inf])
    for fn in (torch.maximum, torch.minimum, torch.fmax, torch.fmin, torch.hypot, torch.xlogy,
               torch.logaddexp, torch.logaddexp2,
               torch.copysign, torch.atan2, torch.remainder, torch.fmod, torch.pow):
        check(fn, x, y)
    z = torch.tensor([0.0, -0.0, 5.0, -5.0, 7.5, -7.5])
    w = torch.tensor([2.0, 2.0, -2.0, 2.0, 0.0, -0.0])
    for mode in ("floor", "trunc"):
        check(lambda a, b, m=mode: torch.div(a, b, rounding_mode=m), z, w)
    check(torch.remainder, z, w)
    check(torch.copysign, w, z)
    check(lambda a: torch.xlogy(a, 0.0), z)


def test_int_tensor_float_scalar_promotion():
    xi = rand(SHAPE, torch.int32, -5, 5)
    check(lambda a: a * 2.5, xi)
    check(lambda a: a + 2.5, xi)


def test_binary_rsub_scalar_forms_and_promotion():
    x = rand(SHAPE)
    xi = rand(SHAPE, torch.int32, -5, 5)
    check(lambda a: 1.5 - a, x)
    check(lambda a, b: torch.rsub(a, b, alpha=2), x, rand(SHAPE, seed=2))
    check(lambda a: torch.rsub(a, 3, alpha=2), xi)
    check(lambda a: a / 3, xi)  # true division promotes
    check(lambda a, b: a + b, x, xi)  # mixed dtypes
    check(lambda a, b: a + b, x.to(torch.bfloat16), x)
    i8 = rand(SHAPE, torch.int8, -128, 127)
    check(lambda a: a + 300, i8)  # scalar wraps to int8
    check(lambda a, b: a * b, i8, rand(SHAPE, torch.int8, -128, 127, seed=3))
    check(lambda a: torch.pow(2.0, a), x)
    check(lambda a: torch.pow(a, 3), x)
    check(lambda a: torch.pow(a, 0.5), rand(SHAPE, torch.int32, 0, 9))
    check(lambda a: torch.pow(2, a), rand(SHAPE, torch.int64, 0, 10))
    check(torch.pow, rand(SHAPE, torch.int64, -3, 3), rand(SHAPE, torch.int64, -3, 3, seed=4))
    check(lambda a: torch.remainder(5.5, a), x)
    check(lambda a: torch.bitwise_and(12, a), rand(SHAPE, torch.int32, 0, 100))
    check(lambda a: torch.xlogy(2.0, a), x.abs())
    bf = rand(SHAPE, torch.bfloat16)
    check(lambda a: a < 0.1, bf)  # the scalar is rounded to bfloat16 first


SHIFT_TYPES = [torch.int8, torch.int32, torch.int64, torch.uint8]


@pytest.mark.parametrize("dtype", SHIFT_TYPES)
def test_shifts(dtype):
    lo = 0 if dtype == torch.uint8 else -100
    x = rand(SHAPE, dtype, lo, 100)
    y = rand(SHAPE, dtype, 0 if dtype == torch.uint8 else -2, 70, seed=1)
    check(torch.bitwise_left_shift, x, y)
    check(torch.bitwise_right_shift, x, y)
    check(lambda a, b: a << b, x, y)
    check(lambda a, b: a >> b, x, y)
    check(lambda a: a << 2, x)
    check(lambda a: a >> 1, x)


# ------------------------------------------------------------------ comparisons
CMPS = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.bool])
@pytest.mark.parametrize("name", sorted(CMPS))
def test_compare(name, dtype):
    fn = CMPS[name]
    x = rand(SHAPE, dtype, -2, 2)
    y = rand(SHAPE, dtype, -2, 2, seed=1)
    if dtype.is_floating_point:
        x.view(-1)[0] = math.nan
    check(fn, x, y)
    if dtype != torch.float32:
        return
    check(fn, x, y[1])
    check(lambda a: fn(a, 1), x)
    check(lambda a, b: fn(a, b, out=torch.empty(SHAPE, dtype=torch.bool, device=a.device)), x, y)
    check(lambda a: getattr(a.clone(), name + "_")(0), x)


# ------------------------------------------------------------------ ternary / clamp / where
@pytest.mark.parametrize("dtype", FLOATS)
def test_lerp_addcmul_addcdiv(dtype):
    s, e, w = rand(SHAPE, dtype), rand(SHAPE, dtype, seed=1), rand(SHAPE, dtype, -1, 2, seed=2)
    t1, t2 = rand(SHAPE, dtype, seed=3), rand(SHAPE, dtype, 0.5, 2, seed=4)
    check(torch.lerp, s, e, w)
    check(lambda a, b: torch.lerp(a, b, 0.7), s, e)
    check(lambda a, b: torch.lerp(a, b, 0.3), s, e[0])
    check(lambda a, b, c: torch.addcmul(a, b, c, value=0.3), s, t1, t2)
    check(lambda a, b, c: torch.addcdiv(a, b, c, value=-1.5), s, t1, t2)
    check(lambda a, b, c: a.clone().addcmul_(b, c), s, t1, t2[0])
    check(lambda a, b, c: torch.addcdiv(a, b, c, out=torch.empty_like(a)), s, t1, t2)


def test_addcmul_int():
    a, b, c = (rand(SHAPE, torch.int64, -5, 5, seed=i) for i in range(3))
    check(lambda x, y, z: torch.addcmul(x, y, z, value=3), a, b, c)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64, torch.bool])
def test_where(dtype):
    cnd = rand(SHAPE, torch.bool)
    x, y = rand(SHAPE, dtype), rand(SHAPE, dtype, seed=1)
    check(torch.where, cnd, x, y)
    check(torch.where, cnd[0], x, y[:, :1])
    if dtype != torch.bool:
        check(lambda c, a: torch.where(c, a, 2), cnd, x)
        check(lambda c, a: torch.where(c, 1.5, a), cnd, x)


def test_where_promotes():
    cnd = rand(SHAPE, torch.bool)
    check(lambda c, a: torch.where(c, a, 2.5), cnd, rand(SHAPE, torch.int8))
    check(torch.where, cnd, rand(SHAPE, torch.int32), rand(SHAPE, torch.float32))


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64])
def test_clamp(dtype):
    x = rand(SHAPE, dtype)
    if dtype.is_floating_point:
        x.view(-1)[:2] = math.nan
    lo, hi = rand(SHAPE, dtype, -3, 0, seed=1), rand(SHAPE, dtype, 0, 3, seed=2)
    check(torch.clamp, x, lo, hi)
    check(lambda a: torch.clamp(a, -1, 2), x)
    check(lambda a: torch.clamp(a, max=2), x)
    check(lambda a: torch.clamp(a, min=-1), x)
    check(lambda a, b: torch.clamp(a, min=b), x, lo)
    check(torch.clamp_min, x, lo)
    check(lambda a: torch.clamp_max(a, 1), x)
    check(lambda a: a.clone().clamp_min_(0), x)
    check(lambda a, b, c: torch.clamp(a, b[0], c, out=torch.empty_like(a)), x, lo, hi)


def test_clamp_promotion_and_crossed_bounds():
    check(lambda a: torch.clamp(a, 2.5, 7), rand(SHAPE, torch.int64, -5, 10))
    check(lambda a: torch.clamp(a, 2, -1), rand(SHAPE))


# ------------------------------------------------------------------ backwards
@pytest.mark.parametrize("dtype", FLOATS)
def test_activation_backwards(dtype):
    x, g = rand(SHAPE, dtype, -4, 4), rand(SHAPE, dtype, seed=1)
    loose = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else None
    check(lambda a, y: A.sigmoid_backward(a, torch.sigmoid(y)), g, x)
    check(lambda a, y: A.tanh_backward(a, torch.tanh(y)), g, x)
    check(lambda a, y: A.threshold_backward(a, y, 0.5), g, x)
    check(lambda y: A.threshold(y, 0.5, -7.0), x)
    check(lambda a, y: A.gelu_backward(a, y), g, x, tol=loose)
    check(lambda a, y: A.gelu_backward(a, y, approximate="tanh"), g, x, tol=loose)
    check(A.silu_backward, g, x)
    check(lambda a, y: A.hardtanh_backward(a, y, -1, 2), g, x)
    check(lambda a, y: A.leaky_relu_backward(a, y, 0.1, False), g, x)
    check(lambda a, y: A.elu_backward(a, 1.5, 1.1, 0.9, False, y), g, x)
    check(lambda a, y: A.elu_backward(a, 1.5, 1.1, 0.9, True, y), g, x)
    check(lambda a, y: A.softplus_backward(a, y, 2, 5), g, x)
    check(A.hardsigmoid_backward, g, x)
    check(A.hardswish_backward, g, x)
    check(A.mish_backward, g, x, tol=loose)
    check(lambda a, y: A.hardshrink_backward(a, y, 0.5), g, x)
    check(lambda a, y: A.softshrink_backward(a, y, 0.5), g, x)
    check(lambda a, y: A.log_sigmoid_backward(a, y, A.log_sigmoid_forward(y)[1]), g, x)
    xl = rand(SHAPE, dtype, -0.2, 1.2)
    check(A.logit_backward, g, xl)
    check(lambda a, y: A.logit_backward(a, y, 0.1), g, xl)


def test_autograd_through_activations():
    x = rand(SHAPE, torch.float32, -3, 3)
    for fn in (torch.sigmoid, torch.tanh, F.gelu, F.silu, torch.relu, F.softplus, F.elu, F.hardswish,
               F.logsigmoid, F.softshrink, F.celu):
        xc = x.detach().clone().requires_grad_()
        xd = x.detach().to(DEV).requires_grad_()
        fn(xc).sum().backward()
        fn(xd).sum().backward()
        assert_same(xd.grad, xc.grad, tol=dict(rtol=1e-4, atol=1e-5))
