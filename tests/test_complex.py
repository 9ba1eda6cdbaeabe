"""complex64 / complex128 tensors on tpu vs PyTorch on the CPU: factories, transfers, printing, the
ops complex rotary embeddings use (Qwen-Image, Z-Image, Llama4, DeepSeek-V2) in strict and fused
eager and under torch.compile, gradients, and writes through the view_as_real / .real views."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch_tpu

TPU = torch.device("tpu")


@pytest.fixture
def mode(strict_or_fused: str) -> str:  # conftest: each test in strict and fused eager, no fallback
    return strict_or_fused


def _c(*shape: int, dtype: torch.dtype = torch.complex64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _check(fn: Callable[..., torch.Tensor], *args: torch.Tensor, tol: float = 1e-6) -> None:
    want = fn(*args)
    got = fn(*(a.to(TPU) for a in args)).cpu()
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_factories_transfers_and_printing() -> None:
    torch_tpu.reset_fallback_stats()
    for dt in (torch.complex64, torch.complex128):
        x = _c(3, 4, dtype=dt)
        assert torch.equal(x.to(TPU).cpu(), x)
        assert torch.equal(torch.zeros(2, 3, dtype=dt, device=TPU).cpu(), torch.zeros(2, 3, dtype=dt))
        assert torch.equal(torch.ones(5, dtype=dt, device=TPU).cpu(), torch.ones(5, dtype=dt))
        assert torch.equal(torch.full((2, 2), 2.5, dtype=dt, device=TPU).cpu(), torch.full((2, 2), 2.5, dtype=dt))
        assert torch.empty(4, dtype=dt, device=TPU).dtype == dt
        assert torch.equal(x.to(TPU)[1:, ::2].cpu(), x[1:, ::2])  # a strided view read
    x = torch.tensor([1 + 2j, -0.5 - 1j], dtype=torch.complex64)
    assert repr(x.to(TPU)) == repr(x)[:-1] + ", device='tpu:0')"
    assert torch_tpu.fallback_stats() == {}


def test_elementwise_and_reductions(mode: str) -> None:
    torch.manual_seed(0)
    a, b, r = _c(4, 6), _c(4, 6), torch.randn(4, 6)
    _check(lambda a, b: a + b, a, b)
    _check(lambda a, b: a - 2.0 * b, a, b)
    _check(lambda a, b: a * b, a, b)
    _check(lambda a, b: a / b, a, b, tol=1e-5)
    _check(lambda a, r: a * r + r, a, r)  # complex x real promotes to complex
    _check(lambda a, r: r / a - a * 3.0, a, r, tol=1e-5)
    _check(lambda a: -a, a)
    _check(torch.exp, a, tol=1e-5)
    _check(torch.abs, a)
    _check(torch.angle, a)
    _check(lambda a: a.sum(), a, tol=1e-5)
    _check(lambda a: a.sum(0), a, tol=1e-5)
    _check(lambda a: a.mean(-1, keepdim=True), a, tol=1e-5)
    _check(lambda r: r.to(torch.complex64), r)
    _check(lambda a: a.to(torch.complex128), a)
    _check(lambda a, b: torch.complex(a.real, b.imag), a, b)
    _check(lambda r, s: torch.polar(r.abs(), s), r, torch.randn(4, 6), tol=1e-5)
    _check(lambda a: a.conj() * 2, a)
    _check(lambda a: torch.conj_physical(a), a)
    _check(lambda a: a.conj().resolve_conj(), a)
    _check(lambda a, b: torch.where(a.real > 0, a, b), a, b)
    _check(lambda a: a.masked_fill(a.imag > 0, 0.5), a)
    _check(torch.sgn, torch.cat([a, torch.zeros(1, 6, dtype=torch.complex64)]))
    # Python complex scalars are complex128 operands (promotion as in ATen).
    _check(lambda r: r * 1j - 0.5j, r)
    _check(lambda a: a * (2 + 3j) + a / 1j, a, tol=1e-6)
    _check(lambda a: (a == a[0]) | (a != 1j), a)
    _check(lambda r: torch.full((2, 3), 1 - 2j, device=r.device) + r[:2, :3], r)
    a2, b2 = _c(5, dtype=torch.complex128), _c(5, dtype=torch.complex128)
    _check(lambda a, b: (a * b - a / b).exp().sum(), a2, b2, tol=1e-12)


def test_views_and_shape_ops(mode: str) -> None:
    torch.manual_seed(1)
    a, b = _c(2, 3, 4), _c(2, 3, 4)
    x = torch.randn(2, 3, 8)
    _check(lambda x: torch.view_as_complex(x.reshape(2, 3, 4, 2)), x)
    _check(lambda a: torch.view_as_real(a).flatten(2), a)
    _check(lambda a: a.real * 2 + a.imag, a)
    _check(lambda a: a.reshape(6, 4).unsqueeze(0).flatten(0, 1), a)
    _check(lambda a, b: torch.cat([a, b], dim=1), a, b)
    _check(lambda a, b: torch.stack([a, b], dim=-1), a, b)
    _check(lambda a: a[:, 1:, ::2] + a[0, 0, 0], a)
    _check(lambda a: a[:, :1].expand(2, 3, 4).clone(), a)
    _check(lambda a: a[torch.tensor([1, 0, 1])], a)
    _check(lambda a: a.index_select(2, torch.tensor([3, 0])), a)


def test_view_write_through(mode: str) -> None:
    def run(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.view_as_real(c)
        r[..., 0].mul_(2.0)  # scales the real parts of c
        c.imag.add_(1.0)
        c[1].zero_()
        z = torch.view_as_complex(r)  # the same storage again
        z.mul_(torch.tensor(1j, dtype=torch.complex64).to(c.device))
        return c.clone(), r.clone()

    c = _c(3, 4)
    want = run(c.clone())
    got = run(c.to(TPU))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=1e-6, rtol=1e-6)


def _rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # diffusers transformer_qwenimage.apply_rotary_emb_qwen (use_real=False)
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_rotated * freqs_cis).flatten(3).type_as(x)


def _freqs(seq: int, dim: int) -> torch.Tensor:
    f = torch.outer(torch.arange(seq).float(), 1.0 / torch.pow(10000, torch.arange(0, dim, 2).float() / dim))
    return torch.polar(torch.ones_like(f), f)


def test_rotary_values_and_grads(mode: str) -> None:
    torch.manual_seed(2)
    x = torch.randn(2, 5, 3, 8)  # [B, S, H, D]
    freqs = _freqs(5, 8).unsqueeze(1)  # [S, 1, D/2]
    w = torch.randn(2, 5, 3, 8)
    xc = x.clone().requires_grad_()
    (_rotary(xc, freqs) * w).sum().backward()
    xt = x.to(TPU).requires_grad_()
    out = _rotary(xt, freqs.to(TPU))
    (out * w.to(TPU)).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), _rotary(x, freqs), atol=1e-6, rtol=1e-5)
    assert xt.grad is not None and xc.grad is not None
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, atol=1e-6, rtol=1e-5)
    # A complex leaf's gradient (the frequency table trained).
    fc = freqs.clone().requires_grad_()
    (_rotary(x, fc) * w).sum().backward()
    ft = freqs.to(TPU).requires_grad_()
    (_rotary(x.to(TPU), ft) * w.to(TPU)).sum().backward()
    assert ft.grad is not None and fc.grad is not None
    torch.testing.assert_close(ft.grad.cpu(), fc.grad, atol=1e-5, rtol=1e-5)
    # |z| and angle of complex leaves (their backward uses sgn and complex division).
    za, zb = _c(3, 4).requires_grad_(), _c(3, 4)
    (za * zb).abs().sum().add((za + zb).angle().sum()).backward()
    zt = za.detach().to(TPU).requires_grad_()
    (zt * zb.to(TPU)).abs().sum().add((zt + zb.to(TPU)).angle().sum()).backward()
    assert zt.grad is not None and za.grad is not None
    torch.testing.assert_close(zt.grad.cpu(), za.grad, atol=1e-5, rtol=1e-5)


def test_rotary_compiled() -> None:
    torch_tpu.reset_fallback_stats()
    torch.manual_seed(3)
    x, freqs = torch.randn(1, 6, 2, 16), _freqs(6, 16).unsqueeze(1)
    fn = torch.compile(_rotary, backend="tpu", fullgraph=True)
    got = fn(x.to(TPU), freqs.to(TPU)).cpu()
    torch.testing.assert_close(got, _rotary(x, freqs), atol=1e-6, rtol=1e-5)
    assert torch_tpu.fallback_stats() == {}


def test_unlowered_complex_op_runs_on_cpu_fallback() -> None:
    a = _c(3, 3)
    got = torch.sin(a.to(TPU)).cpu()  # no complex lowering: the CPU computes it, never a wrong number
    torch.testing.assert_close(got, torch.sin(a))


def test_tiny_qwen_image_transformer_forward() -> None:
    diffusers = pytest.importorskip("diffusers")
    torch_tpu.reset_fallback_stats()
    torch.manual_seed(4)
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6)).eval()
    img_shapes = [[(1, 4, 4)]]
    kw = {"hidden_states": torch.randn(1, 16, 16), "encoder_hidden_states": torch.randn(1, 5, 24),
          "encoder_hidden_states_mask": torch.ones(1, 5), "timestep": torch.tensor([0.5])}
    with torch.no_grad():
        want = model(img_shapes=img_shapes, **kw).sample
        model.to(TPU)
        got = model(img_shapes=img_shapes, **{k: v.to(TPU) for k, v in kw.items()}).sample.cpu()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch_tpu.fallback_stats() == {}
