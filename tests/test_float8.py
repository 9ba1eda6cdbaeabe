"""float8_e4m3fn / float8_e5m2 on tpu: storage, copies, casts both ways and `_scaled_mm`, bit-exact
with PyTorch on the CPU (products within an f8 rounding step); Diffusers' layerwise casting."""

from __future__ import annotations

import pytest
import torch
import torch_tpu

F8 = [torch.float8_e4m3fn, torch.float8_e5m2]
VALUES = torch.tensor([0.0, -0.0, 0.1, -1.3, 3.14159, 300.0, 464.0, 500.0, 6e4, 1e5, -1e-3, 1e-9,
                       float("nan"), float("inf"), float("-inf")])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


@pytest.mark.parametrize("dt", F8, ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_cast_to_float8_on_device_is_bit_exact(dt: torch.dtype, src: torch.dtype) -> None:
    x = VALUES.to(src).abs()  # (NaN's sign does not survive XLA's bf16/f16 widening)
    assert torch.equal(_bits(x.to("tpu").to(dt)), _bits(x.to(dt)))


@pytest.mark.parametrize("dt", F8, ids=str)
def test_storage_copies_and_casts_back(dt: torch.dtype) -> None:
    ref = VALUES.to(dt)
    t = ref.to("tpu")
    assert t.dtype == dt and torch.equal(_bits(t), _bits(ref))  # upload / download
    assert torch.equal(_bits(t[3:9].clone()), _bits(ref[3:9]))  # views + device copies
    assert torch.equal(_bits(torch.cat([t, t[:2]])), _bits(torch.cat([ref, ref[:2]])))
    for to in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        if to == torch.int32:
            finite = torch.isfinite(ref.float())
            torch.testing.assert_close(t[finite.to("tpu")].to(to).cpu(), ref[finite].to(to))
        else:
            torch.testing.assert_close(t.to(to).cpu(), ref.to(to), equal_nan=True, rtol=0, atol=0)
    other = torch.float8_e5m2 if dt == torch.float8_e4m3fn else torch.float8_e4m3fn
    assert torch.equal(_bits(t.to(other)), _bits(ref.to(other)))
    z = torch.zeros(4, dtype=dt, device="tpu")
    z.copy_(torch.tensor([1.0, 2.0, 3.0, 1e6], device="tpu"))
    assert torch.equal(_bits(z), _bits(torch.tensor([1.0, 2.0, 3.0, 1e6]).to(dt)))


@pytest.mark.parametrize(("scales", "bias", "out_dtype"), [
    ("tensor", False, torch.float32), ("row", False, torch.bfloat16), ("tensor", True, torch.bfloat16),
    ("tensor", False, None)])
def test_scaled_mm_matches_cpu(scales: str, bias: bool, out_dtype: torch.dtype | None) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn).t()
    sa, sb = ((torch.rand((), generator=g), torch.rand((), generator=g)) if scales == "tensor"
              else (torch.rand(16, 1, generator=g), torch.rand(1, 32, generator=g)))
    bs = torch.randn(32, generator=g).bfloat16() if bias else None
    ref = torch._scaled_mm(a, b, sa, sb, bias=bs, out_dtype=out_dtype)
    torch_tpu.reset_fallback_stats()
    got = torch._scaled_mm(a.to("tpu"), b.to("tpu"), sa.to("tpu"), sb.to("tpu"),
                           bias=None if bs is None else bs.to("tpu"), out_dtype=out_dtype)
    assert torch_tpu.fallback_stats() == {}
    assert got.dtype == ref.dtype
    # f32 sums in another order; an f8 result may land one rounding step apart.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}.get(ref.dtype, 0.07)
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)


def test_diffusers_layerwise_casting_matches_cpu() -> None:
    diffusers = pytest.importorskip("diffusers")
    from test_models_diffusers import sd3_batch, tiny_sd3

    outs = []
    for dev in ("cpu", "tpu"):
        m = tiny_sd3().to(dev)
        m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        w = m.transformer_blocks[0].attn.to_q.weight
        assert w.dtype == torch.float8_e4m3fn and w.device.type == dev
        with torch.no_grad():
            outs.append(m(**{k: v.to(dev) for k, v in sd3_batch().items()}).sample.cpu())
    assert diffusers is not None
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
