"""torch.fft on tpu (aten::_fft_r2c / _fft_c2r / _fft_c2c lowered to StableHLO fft, lowering/fft.cc)
vs PyTorch on the CPU: every norm, chosen and >3 dims, n= padding/cropping, odd and even sizes,
fftshift round trips, stft/istft, gradients, fused eager and torch.compile — none on the CPU fallback."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch_tpu

TPU = torch.device("tpu")
NORMS = (None, "ortho", "forward")


@pytest.fixture
def mode(strict_or_fused: str) -> str:  # conftest: each test in strict and fused eager, no fallback
    return strict_or_fused


def _check(fn: Callable[..., torch.Tensor], *args: torch.Tensor, tol: float = 2e-5) -> None:
    want = fn(*args)
    got = fn(*(a.to(TPU) for a in args)).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("norm", NORMS)
def test_one_and_two_dim_transforms(mode: str, norm: str | None) -> None:
    torch.manual_seed(0)
    x, z = torch.randn(3, 6, 5), torch.randn(3, 6, 5, dtype=torch.complex64)
    _check(lambda t: torch.fft.fft(t, norm=norm), z)
    _check(lambda t: torch.fft.ifft(t, dim=1, norm=norm), z)
    _check(lambda t: torch.fft.fft(t, norm=norm), x)  # real input: two-sided r2c
    _check(lambda t: torch.fft.rfft(t, norm=norm), x)  # odd size 5
    _check(lambda t: torch.fft.rfft(t, dim=1, norm=norm), x)  # even size 6
    _check(lambda t: torch.fft.irfft(t, norm=norm), z)
    _check(lambda t: torch.fft.fft2(t, norm=norm), z)
    _check(lambda t: torch.fft.ifft2(t, dim=(0, 2), norm=norm), z)
    _check(lambda t: torch.fft.rfftn(t, dim=(2, 0), norm=norm), x)  # halves the last dim listed
    _check(lambda t: torch.fft.irfftn(t, dim=(0, 1), norm=norm), z)
    _check(lambda t: torch.fft.fftn(t, norm=norm), z)


def test_sizes_many_dims_and_float64(mode: str) -> None:
    torch.manual_seed(1)
    x, z = torch.randn(4, 7), torch.randn(4, 7, dtype=torch.complex64)
    _check(lambda t: torch.fft.rfft(t, n=10), x)  # zero-padded
    _check(lambda t: torch.fft.rfft(t, n=4), x)  # cropped
    _check(lambda t: torch.fft.irfft(t, n=9), z)
    _check(lambda t: torch.fft.ifft(t, n=5), z)
    _check(lambda t: torch.fft.fftn(t, s=(6, 5)), z)  # complex constant_pad_nd / slice
    _check(lambda t: torch.nn.functional.pad(t, (1, -2, 0, 1), value=1.5), z, tol=0)
    x4 = torch.randn(2, 3, 4, 5)
    _check(lambda t: torch.fft.fftn(t, dim=(1, 2, 3)), x4.to(torch.complex64))  # 4-D, 3 dims
    _check(lambda t: torch.fft.rfftn(t, dim=(0, 2, 3)), x4)
    x5 = torch.randn(2, 3, 4, 5, 3, dtype=torch.float64)  # > 3 dims: several XLA transforms
    _check(lambda t: torch.fft.fftn(t), x5, tol=1e-10)
    _check(lambda t: torch.fft.rfftn(t), x5, tol=1e-10)
    _check(lambda t: torch.fft.irfftn(torch.fft.rfftn(t), s=t.shape, norm="ortho"), x5, tol=1e-10)


def test_fftshift_round_trip_and_fourier_filter(mode: str) -> None:
    torch.manual_seed(2)
    x = torch.randn(1, 2, 8, 6)

    def fourier_filter(t: torch.Tensor) -> torch.Tensor:  # diffusers FreeU's shape of the computation
        f = torch.fft.fftshift(torch.fft.fftn(t, dim=(-2, -1)), dim=(-2, -1))
        mask = torch.ones_like(f.real)
        mask[..., 3:5, 2:4] = 0.5
        f = torch.fft.ifftshift(f * mask, dim=(-2, -1))
        return torch.fft.ifftn(f, dim=(-2, -1)).real

    _check(fourier_filter, x)
    spec = torch.fft.fftn(x.to(TPU), dim=(-2, -1))
    shifted = torch.fft.fftshift(spec, dim=(-2, -1))
    torch.testing.assert_close(shifted.cpu(), torch.fft.fftshift(torch.fft.fftn(x, dim=(-2, -1)), dim=(-2, -1)))
    back = torch.fft.ifftn(torch.fft.ifftshift(shifted, dim=(-2, -1)), dim=(-2, -1)).cpu()
    torch.testing.assert_close(back.real, x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back.imag, torch.zeros_like(x), atol=1e-5, rtol=0)


def test_stft_istft(mode: str) -> None:
    torch.manual_seed(3)
    sig = torch.randn(2, 400)

    def spec(t: torch.Tensor) -> torch.Tensor:
        return torch.stft(t, 64, 16, window=torch.hann_window(64, device=t.device), return_complex=True)

    def round_trip(t: torch.Tensor) -> torch.Tensor:
        return torch.istft(spec(t), 64, 16, window=torch.hann_window(64, device=t.device), length=400)

    _check(spec, sig, tol=1e-4)
    _check(round_trip, sig, tol=1e-4)


def test_grads_vs_cpu() -> None:
    torch_tpu.reset_fallback_stats()
    torch.manual_seed(4)
    x = torch.randn(3, 10)
    for fn in (
        lambda t: torch.fft.rfft(t).abs().sum(),
        lambda t: torch.fft.irfft(torch.fft.fft(t, norm="ortho")).pow(2).sum(),
        lambda t: torch.fft.rfft2(t, norm="forward").real.sum(),
    ):
        a, b = x.clone().requires_grad_(), x.to(TPU).requires_grad_()
        fn(a).backward()
        fn(b).backward()
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-5, rtol=1e-5)
    assert torch_tpu.fallback_stats() == {}, torch_tpu.fallback_stats()


def test_compiled() -> None:
    torch_tpu.reset_fallback_stats()
    torch.manual_seed(5)
    x = torch.randn(2, 8, 6)

    def spectral_mix(t: torch.Tensor) -> torch.Tensor:  # FNet's token mixing
        return torch.fft.fftn(t, dim=(-2, -1)).real + torch.fft.irfft(torch.fft.rfft(t), n=6)

    fn = torch.compile(spectral_mix, backend="tpu", fullgraph=True)
    torch.testing.assert_close(fn(x.to(TPU)).cpu(), spectral_mix(x), atol=2e-5, rtol=2e-5)
    assert torch_tpu.fallback_stats() == {}, torch_tpu.fallback_stats()


def test_half_precision_matches_cpu_error() -> None:
    x = torch.randn(6, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as cpu_err:
        torch.fft.rfft(x)
    with pytest.raises(RuntimeError) as tpu_err:
        torch.fft.rfft(x.to(TPU))
    assert str(tpu_err.value).splitlines()[0] == str(cpu_err.value).splitlines()[0]


def test_tiny_fnet_forward() -> None:
    transformers = pytest.importorskip("transformers")
    torch_tpu.reset_fallback_stats()
    torch.manual_seed(6)
    cfg = transformers.FNetConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64
    )
    model = transformers.FNetModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        want = model(ids).last_hidden_state
        got = model.to(TPU)(ids.to(TPU)).last_hidden_state.cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch_tpu.fallback_stats() == {}, torch_tpu.fallback_stats()
