"""Pooling and upsampling on tpu vs PyTorch on the CPU: values, indices and gradients.

Every case also asserts that nothing ran on the CPU fallback (the ops are lowered).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

DEV = "tpu"
LOW = (torch.bfloat16, torch.float16)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.device.type == DEV
    got = got.detach().cpu()
    if dtype in LOW:
        torch.testing.assert_close(got.float(), want.detach().float(), rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(got, want.detach())


def _check(fn: Callable[[torch.Tensor], object], x: torch.Tensor, dtype: torch.dtype, grad: bool = True) -> None:
    """fn on CPU and on tpu; outputs (and the input gradient for a random upstream gradient) must
    match and no op may run on the CPU fallback. Low-precision dtypes compare with the float32
    CPU result (tpu computes in float32 like CUDA; the CPU kernels partly round in the dtype)."""
    ref_dtype = torch.float32 if dtype in LOW else dtype
    xc = x.to(dtype).to(ref_dtype).clone().requires_grad_(grad)
    try:
        fn(x.to(dtype))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"not supported on CPU: {e}")
    xt = x.to(dtype).to(DEV).detach().requires_grad_(grad)
    torch_tpu.reset_fallback_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = fn(xc)
        out = fn(xt)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    for o, r in zip(outs, refs, strict=True):
        if r.dtype in (torch.int64, torch.int32):
            assert torch.equal(o.cpu(), r)
        else:
            assert o.dtype == dtype
            _close(o, r, dtype)
    if grad:
        g = torch.randn(refs[0].shape, dtype=torch.float64).to(dtype)
        refs[0].backward(g.to(ref_dtype))
        outs[0].backward(g.to(DEV))
        assert xt.grad.dtype == dtype
        _close(xt.grad, xc.grad, dtype)
    assert torch_tpu.fallback_stats() == {}, torch_tpu.fallback_stats()


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64)


# ---------------------------------------------------------------- average pooling
AVG2D = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 1), divisor_override=5),
]


@pytest.mark.parametrize("kw", AVG2D)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_avg_pool2d(kw, dtype):
    _check(lambda t: F.avg_pool2d(t, **kw), _x(2, 3, 7, 9), dtype)


def test_avg_pool2d_int64_and_3d_input():
    x = torch.randint(-50, 50, (2, 3, 7, 9))
    _check(lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True), x, torch.int64, grad=False)
    _check(lambda t: F.avg_pool2d(t, 2, padding=1, count_include_pad=False), _x(3, 6, 5), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_avg_pool1d(dtype):
    _check(lambda t: F.avg_pool1d(t, 3, stride=2, padding=1, count_include_pad=False), _x(2, 3, 10), dtype)


@pytest.mark.parametrize("kw", [dict(kernel_size=2),
                                dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                                dict(kernel_size=(1, 2, 3), stride=(1, 2, 2), divisor_override=3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_avg_pool3d(kw, dtype):
    _check(lambda t: F.avg_pool3d(t, **kw), _x(2, 2, 5, 6, 7), dtype)


def test_avg_pool2d_channels_last():
    x = _x(2, 4, 6, 6).to(memory_format=torch.channels_last)
    _check(lambda t: F.avg_pool2d(t, 3, 1, 1), x, torch.float32)


# ---------------------------------------------------------------- adaptive pooling
@pytest.mark.parametrize("shape,out", [((2, 3, 7, 9), (3, 4)), ((2, 3, 8, 8), 4), ((2, 3, 5, 5), 1),
                                       ((3, 3, 5), (5, 7)), ((2, 3, 6, 10), (None, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_adaptive_avg_pool2d(shape, out, dtype):
    _check(lambda t: F.adaptive_avg_pool2d(t, out), _x(*shape), dtype)


@pytest.mark.parametrize("out", [(2, 3, 4), 1, (4, 6, 8)])
def test_adaptive_avg_pool3d(out):
    _check(lambda t: F.adaptive_avg_pool3d(t, out), _x(2, 2, 5, 6, 7), torch.float32)


def test_adaptive_avg_pool1d_and_area_interpolate():
    _check(lambda t: F.adaptive_avg_pool1d(t, 4), _x(2, 3, 9), torch.float32)
    _check(lambda t: F.interpolate(t, size=(3, 5), mode="area"), _x(1, 2, 7, 8), torch.float32)


@pytest.mark.parametrize("shape,out", [((2, 3, 7, 9), (3, 4)), ((2, 3, 8, 8), 4), ((3, 5, 5), 1), ((2, 2, 3, 4), (5, 6))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_adaptive_max_pool2d(shape, out, dtype):
    _check(lambda t: F.adaptive_max_pool2d(t, out, return_indices=True), _x(*shape), dtype)


@pytest.mark.parametrize("out", [(2, 3, 4), 2])
def test_adaptive_max_pool3d(out):
    _check(lambda t: F.adaptive_max_pool3d(t, out, return_indices=True), _x(2, 2, 5, 6, 7), torch.float32)


def test_adaptive_max_pool1d():
    _check(lambda t: F.adaptive_max_pool1d(t, 4, return_indices=True), _x(2, 3, 9), torch.float32)


def test_max_pools_nan_and_ties_match_cpu():
    # CPU scans each window with `val > max || isnan(val)`: first maximum, last NaN.
    x = torch.tensor([[[[1.0, 3.0, 3.0, float("nan")], [float("nan"), 2.0, 3.0, float("nan")],
                        [-math.inf, -math.inf, 0.0, 5.0], [-math.inf, -math.inf, 5.0, 5.0]]]])
    for fn in (lambda t: F.adaptive_max_pool2d(t, 2, return_indices=True),
               lambda t: F.adaptive_max_pool2d(t, 3, return_indices=True),
               lambda t: F.max_pool2d(t, 2, return_indices=True),
               lambda t: F.max_pool2d(t, 3, 1, return_indices=True)):
        v, i = fn(x)
        vt, it = fn(x.to(DEV))
        torch.testing.assert_close(vt.cpu(), v, equal_nan=True)
        assert torch.equal(it.cpu(), i)


# ---------------------------------------------------------------- max pooling 3-d
@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                dict(kernel_size=(2, 3, 2), stride=(1, 2, 2), dilation=(2, 1, 1), ceil_mode=True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pool3d(kw, dtype):
    _check(lambda t: F.max_pool3d(t, return_indices=True, **kw), _x(2, 2, 5, 6, 7), dtype)


# ---------------------------------------------------------------- upsampling
INTERP = [
    dict(scale_factor=2),
    dict(size=(7, 4)),
    dict(scale_factor=1.7),
    dict(scale_factor=(0.6, 1.5), recompute_scale_factor=False),
]


def _interp(mode: str, nsp: int, kw: dict, **extra: object) -> Callable[[torch.Tensor], torch.Tensor]:
    kw = dict(kw)
    if "size" in kw:
        kw["size"] = ((5, 7, 4) if nsp == 3 else kw["size"])[:nsp] if nsp > 1 else kw["size"][1]
    if isinstance(kw.get("scale_factor"), tuple):
        kw["scale_factor"] = (kw["scale_factor"] * 2)[:nsp] if nsp > 1 else kw["scale_factor"][0]
    return lambda t: F.interpolate(t, mode=mode, **kw, **extra)


SHAPES = {1: (2, 3, 6), 2: (2, 3, 5, 6), 3: (1, 2, 3, 4, 5)}


@pytest.mark.parametrize("kw", INTERP)
@pytest.mark.parametrize("mode,nsp", [("nearest", 1), ("nearest", 2), ("nearest", 3), ("nearest-exact", 1),
                                      ("nearest-exact", 2), ("nearest-exact", 3)])
def test_interpolate_nearest(mode, nsp, kw):
    _check(_interp(mode, nsp, kw), _x(*SHAPES[nsp]), torch.float32)


@pytest.mark.parametrize("kw,align_corners", [(kw, False) for kw in INTERP] + [(INTERP[0], True), (INTERP[1], True)])
@pytest.mark.parametrize("mode,nsp", [("linear", 1), ("bilinear", 2), ("bicubic", 2), ("trilinear", 3)])
def test_interpolate_linear_cubic(mode, nsp, kw, align_corners):
    _check(_interp(mode, nsp, kw, align_corners=align_corners), _x(*SHAPES[nsp]), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode,nsp", [("nearest", 2), ("nearest-exact", 2), ("bilinear", 2), ("bicubic", 2),
                                      ("trilinear", 3)])
def test_interpolate_dtypes(mode, nsp, dtype):
    _check(_interp(mode, nsp, dict(size=(7, 4))), _x(*SHAPES[nsp]), dtype)


def test_interpolate_uint8_nearest_and_channels_last():
    x = torch.randint(0, 255, (2, 3, 5, 6), dtype=torch.uint8)
    _check(lambda t: F.interpolate(t, scale_factor=2), x, torch.uint8, grad=False)
    _check(lambda t: F.interpolate(t, size=(3, 9), mode="nearest-exact"), x, torch.uint8, grad=False)
    xl = _x(2, 4, 5, 6).to(memory_format=torch.channels_last)
    _check(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), xl, torch.float32)


def test_upsample_modules_unet_style():
    # Diffusers-style decoder block: nearest 2x upsample then conv; plus a VAE-style avg-pool.
    torch.manual_seed(0)
    up = torch.nn.Upsample(scale_factor=2, mode="nearest")
    _check(lambda t: F.avg_pool2d(up(t), 2), _x(1, 4, 8, 8), torch.float32)


@pytest.mark.parametrize("size", [(3, 4), (9, 5), (2, 11)])
@pytest.mark.parametrize("mode,align_corners,dtype", [("bilinear", False, torch.float32), ("bicubic", False, torch.float32),
                                                      ("bilinear", True, torch.float32), ("bicubic", False, torch.float64)])
def test_interpolate_antialias(size, mode, align_corners, dtype):
    _check(lambda t: F.interpolate(t, size=size, mode=mode, antialias=True, align_corners=align_corners),
           _x(2, 3, 7, 8), dtype)


# ---------------------------------------------------------------- max unpooling
@pytest.mark.parametrize("nsp", [1, 2, 3])
def test_max_unpool(nsp):
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nsp - 1]
    unpool = (F.max_unpool1d, F.max_unpool2d, F.max_unpool3d)[nsp - 1]
    x = _x(*((2, 3) + (6, 5, 4)[:nsp]))
    _, idx = pool(x, 2, return_indices=True)
    _check(lambda t: unpool(t, idx.to(t.device), 2, output_size=x.shape[2:]), pool(x, 2), torch.float32)


def test_max_unpool2d_repeated_indices_keep_last_write():
    # Overlapping windows (stride 1) repeat indices; the CPU kernel's last write wins.
    x = _x(1, 2, 5, 5)
    v, idx = F.max_pool2d(x, 3, 1, return_indices=True)
    vals = torch.randn(v.shape, dtype=torch.float32)
    ref = F.max_unpool2d(vals, idx, 3, 1, output_size=(5, 5))
    out = F.max_unpool2d(vals.to(DEV), idx.to(DEV), 3, 1, output_size=(5, 5))
    assert torch.equal(out.cpu(), ref)


def test_compiled_graph_matches_cpu():
    # torch.compile(backend="tpu"): the graph (decomposed or not) must lower without eager fallback.
    def f(x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(x, scale_factor=2, mode="nearest")
        z = F.interpolate(x, size=(5, 7), mode="bilinear")
        return F.avg_pool2d(y, 2).sum() + z.square().sum() + F.adaptive_avg_pool2d(x, (3, 3)).sum()

    torch._dynamo.reset()
    x = _x(1, 2, 6, 6).float()
    xc = x.clone().requires_grad_()
    xt = x.to(DEV).requires_grad_()
    ref = f(xc)
    ref.backward()
    torch_tpu.reset_fallback_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "runs op by op in eager mode" would raise
        out = torch.compile(f, backend="tpu")(xt)
        out.backward()
    _close(out, ref, torch.float32)
    _close(xt.grad, xc.grad, torch.float32)
    assert torch_tpu.fallback_stats() == {}
