"""Convolutions on tpu vs CPU (csrc/lowering/convolution.cc, csrc/aten/convolution_meta.cc).

conv1d/2d/3d and conv_transpose1d/2d/3d reach the tpu as aten::convolution_overrideable (and
autograd as aten::convolution_backward_overrideable). Every case compares with PyTorch on the
CPU, and asserts that nothing ran on the CPU fallback.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_tpu

DEV = "tpu"


def _fallbacks() -> dict:
    st = torch_tpu.fallback_stats()
    return dict(st) if isinstance(st, dict) else {k: 1 for k in st}


@pytest.fixture(autouse=True)
def no_fallback():
    before = _fallbacks()
    yield
    after = _fallbacks()
    new = {k: v for k, v in after.items() if before.get(k) != v}
    assert not new, f"ops ran on the CPU fallback: {new}"


TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
}


def _close(got, ref, dtype=torch.float32):
    assert got.device.type == DEV
    assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    got = got.cpu()
    if dtype in (torch.bfloat16, torch.float16):
        scale = ref.float().abs().max().item() + 1e-6
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= 2e-2 * scale, (err, scale)
    else:
        torch.testing.assert_close(got, ref, **TOL[dtype])


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


# (fn, input shape, weight shape, has bias, kwargs)
FWD = [
    # conv1d
    (F.conv1d, (2, 4, 17), (6, 4, 3), True, {}),
    (F.conv1d, (2, 4, 17), (6, 4, 3), False, dict(stride=2, padding=1)),
    (F.conv1d, (2, 4, 17), (6, 2, 4), True, dict(stride=3, padding=2, dilation=2, groups=2)),
    (F.conv1d, (3, 4, 16), (4, 1, 5), True, dict(padding="same", groups=4)),
    (F.conv1d, (3, 4, 16), (8, 4, 4), False, dict(padding="same", dilation=3)),
    (F.conv1d, (3, 4, 16), (8, 4, 4), True, dict(padding="valid")),
    (F.conv1d, (4, 13), (5, 4, 3), True, dict(padding=1)),  # unbatched
    # conv2d
    (F.conv2d, (2, 3, 10, 9), (5, 3, 3, 3), True, {}),
    (F.conv2d, (2, 3, 10, 9), (5, 3, 3, 2), False, dict(stride=(2, 1), padding=(1, 2))),
    (F.conv2d, (2, 4, 11, 12), (6, 2, 3, 3), True, dict(stride=2, padding=1, dilation=(1, 2), groups=2)),
    (F.conv2d, (2, 6, 9, 9), (6, 1, 3, 3), True, dict(padding=1, groups=6)),  # depthwise
    (F.conv2d, (2, 6, 9, 9), (12, 1, 3, 3), False, dict(stride=2, groups=6)),  # depthwise x2
    (F.conv2d, (2, 3, 8, 10), (4, 3, 3, 5), True, dict(padding="same")),
    (F.conv2d, (2, 3, 8, 10), (4, 3, 2, 4), True, dict(padding="same", dilation=(2, 1))),
    (F.conv2d, (2, 3, 8, 10), (4, 3, 3, 3), True, dict(padding="valid", dilation=2)),
    (F.conv2d, (1, 2, 5, 5), (3, 2, 1, 1), True, dict(stride=2)),
    (F.conv2d, (2, 3, 7, 7), (4, 3, 7, 7), True, {}),  # kernel == input
    (F.conv2d, (2, 3, 6, 6), (4, 3, 2, 2), True, dict(padding=4)),  # padding > kernel
    (F.conv2d, (3, 9, 8), (4, 3, 3, 3), True, dict(padding=1)),  # unbatched
    # conv3d
    (F.conv3d, (2, 3, 6, 7, 5), (4, 3, 3, 3, 3), True, dict(padding=1)),
    (F.conv3d, (2, 4, 7, 6, 8), (6, 2, 2, 3, 2), False, dict(stride=(1, 2, 2), dilation=(2, 1, 1), groups=2)),
    (F.conv3d, (1, 2, 5, 5, 5), (3, 2, 3, 3, 3), True, dict(padding="same")),
    # conv_transpose1d: weight [Cin, Cout/G, k]
    (F.conv_transpose1d, (2, 4, 9), (4, 3, 3), True, {}),
    (F.conv_transpose1d, (2, 4, 9), (4, 3, 3), False, dict(stride=2, padding=1, output_padding=1)),
    (
        F.conv_transpose1d,
        (2, 4, 9),
        (4, 2, 4),
        True,
        dict(stride=3, padding=2, output_padding=2, groups=2, dilation=2),
    ),
    (F.conv_transpose1d, (2, 4, 9), (4, 3, 2), True, dict(padding=3)),  # padding > dilation*(k-1)
    # conv_transpose2d
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 3), True, {}),
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 2), False, dict(stride=2, padding=1, output_padding=1)),
    (
        F.conv_transpose2d,
        (2, 4, 5, 6),
        (4, 2, 3, 3),
        True,
        dict(stride=(2, 3), padding=(0, 1), output_padding=(1, 2), groups=2),
    ),
    (F.conv_transpose2d, (2, 6, 5, 5), (6, 1, 3, 3), True, dict(stride=2, padding=1, groups=6)),
    (
        F.conv_transpose2d,
        (2, 4, 5, 6),
        (4, 3, 3, 3),
        True,
        dict(stride=2, padding=2, dilation=2, output_padding=1),
    ),
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 2, 2), True, dict(stride=2, padding=3)),
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 3), True, dict(stride=1, dilation=3, output_padding=2)),
    # conv_transpose3d
    (
        F.conv_transpose3d,
        (1, 4, 3, 4, 3),
        (4, 2, 3, 2, 3),
        True,
        dict(stride=2, padding=1, output_padding=(1, 0, 1), groups=2),
    ),
]


def _ids(case):
    fn, xs, ws, bias, kw = case
    return f"{fn.__name__}-{'x'.join(map(str, xs))}-{'x'.join(map(str, ws))}-{'b' if bias else 'nb'}-{kw}"


@pytest.mark.parametrize("case", FWD, ids=[_ids(c) for c in FWD])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward(case, dtype):
    fn, xs, ws, has_bias, kw = case
    torch.manual_seed(0)
    x, w = _rand(*xs, dtype=dtype), _rand(*ws, dtype=dtype)
    cout = ws[1] * kw.get("groups", 1) if "transpose" in fn.__name__ else ws[0]
    b = _rand(cout, dtype=dtype) if has_bias else None
    if dtype == torch.bfloat16:
        ref = fn(x.float(), w.float(), None if b is None else b.float(), **kw).to(dtype)
    else:
        ref = fn(x, w, b, **kw)
    got = fn(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), **kw)
    _close(got, ref, dtype)


def test_forward_float64():
    torch.manual_seed(0)
    x, w, b = (
        _rand(2, 3, 9, 8, dtype=torch.float64),
        _rand(4, 3, 3, 3, dtype=torch.float64),
        _rand(4, dtype=torch.float64),
    )
    _close(
        F.conv2d(x.to(DEV), w.to(DEV), b.to(DEV), stride=2, padding=1),
        F.conv2d(x, w, b, stride=2, padding=1),
        torch.float64,
    )
    wt = _rand(3, 2, 3, 3, dtype=torch.float64)
    _close(
        F.conv_transpose2d(x.to(DEV), wt.to(DEV), stride=2, output_padding=1),
        F.conv_transpose2d(x, wt, stride=2, output_padding=1),
        torch.float64,
    )


def test_forward_float16():
    torch.manual_seed(0)
    x, w = _rand(2, 3, 9, 8, dtype=torch.float16), _rand(4, 3, 3, 3, dtype=torch.float16)
    ref = F.conv2d(x.float(), w.float(), padding=1).half()
    _close(F.conv2d(x.to(DEV), w.to(DEV), padding=1), ref, torch.float16)


def _programs(dump):
    return "".join(open(os.path.join(dump, f)).read() for f in sorted(os.listdir(dump)))


@pytest.fixture
def restore_host_kernels():
    yield
    torch_tpu.ops.host_kernels(True)


def test_host_conv_in_strict_and_fused_programs(tmp_path, monkeypatch, restore_host_kernels):
    # On the CPU plugin a float convolution forward is PyTorch's own CPU convolution run as the
    # host kernel "torch_tpu.conv" (csrc/aten/ffi_conv.cc) inside strict and fused programs
    # (compiled: test_compile_whole_graph).
    if torch_tpu.ops.host_kernels() != "on":
        pytest.skip("no host kernels here")
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 11, 7), torch.randn(6, 5, 3, 2), torch.randn(6)  # shapes no other test uses
    xd, wd, bd = x.to(DEV), w.to(DEV), b.to(DEV)
    kw = dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2))
    ref = F.conv2d(x, w, b, **kw)
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path / "strict"))
    _close(F.conv2d(xd, wd, bd, **kw), ref)
    assert '"torch_tpu.conv"' in _programs(str(tmp_path / "strict"))
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path / "fused"))
    with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
        got = (F.conv2d(xd * 2, wd, bd, **kw) + 1).cpu()
    torch.testing.assert_close(got, F.conv2d(x * 2, w, b, **kw) + 1)
    assert '"torch_tpu.conv"' in _programs(str(tmp_path / "fused"))
    # Switched off: new programs take XLA's convolution (the backward passes always do).
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path / "off"))
    assert torch_tpu.ops.host_kernels(False) == "off"
    _close(F.conv2d(xd[:2], wd, bd, **kw), F.conv2d(x[:2], w, b, **kw))
    text = _programs(str(tmp_path / "off"))
    assert "stablehlo.convolution" in text and "custom_call" not in text


# The XLA forward path (host kernels off, or a platform without them): a few of FWD's cases with a
# batch no other test uses, so the programs are built fresh on that path.
XLA_FWD = [FWD[i] for i in (2, 8, 10, 16, 19, 22, 26, 33)]


def test_forward_xla_path(restore_host_kernels):
    torch_tpu.ops.host_kernels(False)
    torch.manual_seed(0)
    for fn, xs, ws, has_bias, kw in XLA_FWD:
        xs = (xs[0] + 3,) + tuple(xs[1:])
        x, w = _rand(*xs), _rand(*ws)
        cout = ws[1] * kw.get("groups", 1) if "transpose" in fn.__name__ else ws[0]
        b = _rand(cout) if has_bias else None
        _close(fn(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), **kw), fn(x, w, b, **kw))


# Backward: (fn, input shape, weight shape, has bias, kwargs)
BWD = [
    (F.conv2d, (2, 3, 10, 9), (5, 3, 3, 3), True, dict(padding=1)),
    (F.conv2d, (2, 4, 11, 12), (6, 2, 3, 3), True, dict(stride=2, padding=1, dilation=(1, 2), groups=2)),
    (F.conv2d, (2, 3, 8, 9), (4, 3, 3, 2), False, dict(stride=(2, 3))),  # trailing input unused
    (F.conv2d, (2, 6, 9, 9), (6, 1, 3, 3), True, dict(padding=1, groups=6)),  # depthwise
    (F.conv2d, (2, 6, 9, 9), (12, 2, 3, 3), True, dict(stride=2, padding=2, groups=3)),
    (F.conv2d, (2, 3, 6, 6), (4, 3, 2, 2), True, dict(padding=4, dilation=2)),  # padding > d*(k-1)
    (F.conv2d, (2, 3, 8, 10), (4, 3, 2, 4), True, dict(padding="same")),
    (F.conv1d, (2, 4, 17), (6, 2, 4), True, dict(stride=3, padding=2, dilation=2, groups=2)),
    (F.conv3d, (2, 4, 6, 5, 7), (6, 2, 2, 3, 2), True, dict(stride=(1, 2, 2), padding=1, groups=2)),
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 3), True, {}),
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 2), False, dict(stride=2, padding=1, output_padding=1)),
    (
        F.conv_transpose2d,
        (2, 4, 5, 6),
        (4, 2, 3, 3),
        True,
        dict(stride=(2, 3), padding=(0, 1), output_padding=(1, 2), groups=2),
    ),
    (F.conv_transpose2d, (2, 6, 5, 5), (6, 1, 3, 3), True, dict(stride=2, padding=1, groups=6)),
    (
        F.conv_transpose2d,
        (2, 4, 5, 6),
        (4, 3, 3, 3),
        True,
        dict(stride=2, padding=2, dilation=2, output_padding=1),
    ),
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 2, 2), True, dict(stride=2, padding=3)),
    (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 3), True, dict(stride=1, dilation=3, output_padding=2)),
    (
        F.conv_transpose1d,
        (2, 4, 9),
        (4, 2, 4),
        True,
        dict(stride=3, padding=2, output_padding=2, groups=2, dilation=2),
    ),
    (
        F.conv_transpose3d,
        (1, 4, 3, 4, 3),
        (4, 2, 3, 2, 3),
        True,
        dict(stride=2, padding=1, output_padding=(1, 0, 1), groups=2),
    ),
]


def _grads(fn, x, w, b, g, kw):
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    out = fn(x, w, b, **kw)
    return out, torch.autograd.grad(out, leaves, g)


@pytest.mark.parametrize("case", BWD, ids=[_ids(c) for c in BWD])
def test_backward(case):
    fn, xs, ws, has_bias, kw = case
    torch.manual_seed(0)
    x, w = _rand(*xs), _rand(*ws)
    cout = ws[1] * kw.get("groups", 1) if "transpose" in fn.__name__ else ws[0]
    b = _rand(cout) if has_bias else None
    ref_out = fn(x, w, b, **kw)
    g = torch.randn_like(ref_out)
    cpu = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    dev = [t.to(DEV).requires_grad_() if t is not None else None for t in (x, w, b)]
    ref_out, ref = _grads(fn, *cpu, g, kw)
    out, got = _grads(fn, *dev, g.to(DEV), kw)
    _close(out, ref_out)
    assert len(got) == len(ref)
    for a, r in zip(got, ref, strict=True):
        _close(a, r)


@pytest.mark.parametrize("mask", ["x", "w", "b", "xb"])
def test_backward_output_mask(mask):
    torch.manual_seed(0)
    x, w, b = _rand(2, 4, 9, 8), _rand(6, 2, 3, 3), _rand(6)
    kw = dict(stride=2, padding=1, groups=2)
    ts = dict(x=x, w=w, b=b)
    cpu = {k: v.clone().requires_grad_(k in mask) for k, v in ts.items()}
    dev = {k: v.to(DEV).requires_grad_(k in mask) for k, v in ts.items()}
    ref = torch.autograd.grad(F.conv2d(cpu["x"], cpu["w"], cpu["b"], **kw).sum(), [cpu[k] for k in mask])
    got = torch.autograd.grad(F.conv2d(dev["x"], dev["w"], dev["b"], **kw).sum(), [dev[k] for k in mask])
    for a, r in zip(got, ref, strict=True):
        _close(a, r)


def test_backward_bfloat16():
    torch.manual_seed(0)
    x, w, b = (_rand(*s, dtype=torch.bfloat16) for s in [(2, 4, 9, 8), (6, 2, 3, 3), (6,)])
    kw = dict(stride=2, padding=1, groups=2)
    cpu = [t.float().requires_grad_() for t in (x, w, b)]
    dev = [t.to(DEV).requires_grad_() for t in (x, w, b)]
    ref = torch.autograd.grad(F.conv2d(*cpu, **kw).square().sum(), cpu)
    got = torch.autograd.grad(F.conv2d(*dev, **kw).square().sum(), dev)
    for a, r in zip(got, ref, strict=True):
        _close(a, r.bfloat16(), torch.bfloat16)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.c3 = nn.Conv1d(4, 2, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.c1(x))
        h = torch.relu(self.c2(h))
        h = self.up(h)  # [N, 4, H, W]
        n, c, hh, ww = h.shape
        return self.c3(h.reshape(n, c, hh * ww))


def test_small_cnn_training_step():
    torch.manual_seed(0)
    ref = SmallCNN()
    dev = SmallCNN()
    dev.load_state_dict(ref.state_dict())
    dev = dev.to(DEV)
    x = torch.randn(2, 3, 8, 8)
    ref(x).square().mean().backward()
    out = dev(x.to(DEV))
    out.square().mean().backward()
    _close(out, ref(x))
    for (name, p), (_, q) in zip(dev.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None, name
        _close(p.grad, q.grad)


INT_CASES = [
    (F.conv1d, (2, 2, 9), (3, 2, 2), dict(stride=2, padding=1)),
    (F.conv2d, (2, 4, 7, 7), (4, 2, 3, 3), dict(groups=2, padding=1)),
    (F.conv3d, (1, 2, 4, 4, 4), (3, 2, 2, 2, 2), {}),
]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8])
def test_integer(dtype):
    # CPU convolves integers in their own type (wrapping); so does the lowering.
    torch.manual_seed(0)
    lo = 0 if dtype == torch.uint8 else -100
    cases = INT_CASES + (
        [(F.conv_transpose2d, (1, 2, 5, 5), (2, 3, 2, 2), dict(stride=2))] if dtype == torch.int64 else []
    )
    for fn, xs, ws, kw in cases:
        x, w = torch.randint(lo, 100, xs).to(dtype), torch.randint(lo, 100, ws).to(dtype)
        got = fn(x.to(DEV), w.to(DEV), **kw)
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), fn(x, w, **kw)), fn.__name__


def test_compile_whole_graph(tmp_path, monkeypatch):
    # torch.compile graphs carry aten.convolution / convolution_backward (graph-only lowerings).
    import copy
    import warnings

    import torch._dynamo

    # Earlier tests compiled the same nn.Module code with other shapes; start from a clean Dynamo
    # so this graph is traced with static shapes (a symbolic graph would run op by op).
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.ConvTranspose2d(8, 4, 2, stride=2, padding=1),
        nn.Flatten(1),
    )
    x = torch.randn(2, 3, 9, 8)
    ref = m(x)
    ref.square().sum().backward()
    md = copy.deepcopy(m).to(DEV)
    md.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "runs op by op in eager mode" would raise
        f = torch.compile(md, backend="tpu")
        monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path))
        out = f(x.to(DEV))
        out.square().sum().backward()
    _close(out, ref)
    if torch_tpu.ops.host_kernels() == "on":  # the forward convolutions run as the host kernel
        assert _programs(str(tmp_path)).count('"torch_tpu.conv"') == 3
    for p, q in zip(md.parameters(), m.parameters(), strict=True):
        _close(p.grad, q.grad)


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                dict(kernel_size=3, stride=2, ceil_mode=True),
                                dict(kernel_size=(2, 3), stride=(1, 2), dilation=(2, 1))])
def test_max_pool2d_values_indices_and_grad(kw):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 9, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    y, i = F.max_pool2d(x, return_indices=True, **kw)
    yt, it = F.max_pool2d(xt, return_indices=True, **kw)
    g = torch.randn_like(y)
    y.backward(g)
    yt.backward(g.to("tpu"))
    assert torch.equal(yt.detach().cpu(), y.detach()) and torch.equal(it.cpu(), i)
    torch.testing.assert_close(xt.grad.cpu(), x.grad)
