"""pow(Tensor, Scalar) at the exponents ATen's CPU kernel special-cases (sqrt, rsqrt, 1/x, 1/(x*x),
x*x, x*x*x): the program constants make them ATen's forms, so the bits equal CPU's (0.5 and -0.5:
up to XLA:CPU's sqrt rounding)."""

import pytest
import torch
import torch_tpu  # noqa: F401

EXPONENTS = [0.5, -0.5, -1.0, -2.0, 2.0, 3.0, -2, -1, 2, 3, 0.25]


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(61, generator=g, dtype=torch.float64) * 3
    special = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-30, 1e30, -4.0]
    )
    return torch.cat([x, special.double()]).to(dtype)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Bitwise equality, nan payloads aside: same values, signs of zeros, nans in the same places."""
    same = (got == want) & (torch.signbit(got) == torch.signbit(want))
    return same | (torch.isnan(got) & torch.isnan(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_bitwise(dtype: torch.dtype) -> None:
    x = _inputs(dtype)
    xd = x.to("tpu")
    for e in EXPONENTS:
        want = torch.pow(x, e)
        got = torch.pow(xd, e).cpu()
        assert got.dtype == want.dtype
        same = _same_bits(got, want)
        if e in (0.5, -0.5, 0.25):
            # XLA:CPU's sqrt and rsqrt are within ~1 ulp, not correctly rounded (torch.sqrt on tpu
            # as well); the special values (-0, -inf, nan: sqrt's, not pow's) are exact.
            torch.testing.assert_close(got, want, equal_nan=True)
            if e != 0.25:  # 0, -0, 1, -1, inf, -inf, nan
                assert bool(same[-10:-3].all()), (e, got[-10:-3], want[-10:-3])
        else:
            assert bool(same.all()), (e, x[~same], got[~same], want[~same])
    # x ** 0.5 through the Python operator, and an in-place form
    assert bool(_same_bits((xd**0.5).cpu()[-10:-3], (x**0.5)[-10:-3]).all())
    y = xd.clone()
    y.pow_(-2.0)
    assert bool(_same_bits(y.cpu(), x.pow(-2.0)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_special_values(dtype: torch.dtype) -> None:
    # bf16: CPU's sqrt/rsqrt forms; f16: CPU's pow, at 0, -0, 1, -1, inf, -inf, nan.
    x = _inputs(dtype)[-10:-3]
    for e in [0.5, -0.5, -1.0]:
        assert bool(_same_bits(torch.pow(x.to("tpu"), e).cpu(), torch.pow(x, e)).all()), (dtype, e)


def test_int_tensor_unchanged() -> None:
    x = torch.arange(-4, 5, dtype=torch.int64)
    xd = x.to("tpu")
    for e in [0, 1, 2, 3]:
        assert torch.equal(torch.pow(xd, e).cpu(), torch.pow(x, e))
    for e in [0.5, -0.5, -2.0]:  # a float exponent makes a float result
        torch.testing.assert_close(torch.pow(xd, e).cpu(), torch.pow(x, e), equal_nan=True)
    for e in [-1, -2]:
        with pytest.raises(RuntimeError, match="negative integer powers"):
            torch.pow(xd, e).cpu()  # a device-side check: raises at the sync
    one = torch.tensor([1, -1, 2], dtype=torch.int32)
    assert torch.equal(torch.pow(one.to("tpu"), 2).cpu(), torch.pow(one, 2))
