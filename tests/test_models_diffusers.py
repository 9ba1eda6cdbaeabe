"""Diffusers models and schedulers on tpu vs PyTorch on the CPU, with no CPU fallback.

Tiny seeded configs built in code (no Hub): UNet2DConditionModel, SD3 and Flux transformers,
AutoencoderKL (encode + decode), DDIM / FlowMatch Euler scheduler steps, a denoising loop, a
`pipe.to("tpu")` pipeline, and the float64 position-embedding paths (Flux RoPE, 2-D sin-cos).
Every check compares numbers with the CPU, asserts `fallbacks == {}` and counts host syncs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch_tpu
from model_harness import ModelReport, check_model, float_tensors, max_err, record, to_device

diffusers = pytest.importorskip("diffusers")

TPU = torch.device("tpu")


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread() -> Iterator[None]:
    """The CPU reference runs single-threaded: on this shared 2-core machine oversubscribed intra-op
    threads made it 10x slower than one thread (restored after the module)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _host_syncs() -> int:
    return int(torch_tpu.dispatch_stats()["host_syncs"])


def _print(rep: ModelReport) -> None:
    print(f"\n{rep.name}: fwd {rep.fwd_max_err:.2e} (ref {rep.fwd_max_ref:.2f}) grad {rep.grad_max_err:.2e} "
          f"(ref {rep.grad_max_ref:.2e}) curve {rep.loss_curve_max_dev:.2e} syncs/fwd {rep.host_syncs_per_forward} "
          f"fallbacks {rep.fallbacks}")


def _assert_report(rep: ModelReport, fwd_rel: float = 2e-5, grad_rel: float = 2e-5, curve_rel: float = 1e-4,
                   host_syncs: int = 0) -> None:
    """Float32 tolerances relative to the output / gradient / loss scale."""
    _print(rep)
    assert rep.fwd_max_err <= fwd_rel * max(1.0, rep.fwd_max_ref), rep
    assert rep.grad_max_err <= grad_rel * max(rep.grad_max_ref, 1e-3), rep
    loss_scale = max(1.0, max(abs(x) for x in rep.losses_cpu))
    assert rep.loss_curve_max_dev <= curve_rel * loss_scale, rep
    # The model learns on both devices alike (the curve is not flat).
    assert rep.losses_tpu[-1] < rep.losses_tpu[0], rep.losses_tpu
    assert rep.fallbacks == {}, f"CPU fallbacks: {rep.fallbacks}"
    assert rep.host_syncs_per_forward == host_syncs, rep.host_syncs_per_forward


def _mse_to(target: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """Diffusion-style loss: MSE of the model's `.sample` against a fixed target on its device."""
    def loss(out: Any) -> torch.Tensor:
        y = out.sample if hasattr(out, "sample") else out
        return F.mse_loss(y, target.to(y.device))
    return loss


# ------------------------------------------------------------------ tiny models
def tiny_unet(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


def unet_batch(batch: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"sample": torch.randn(batch, 4, 16, 16, generator=g),
            "timestep": torch.tensor([10, 500, 999, 3][:batch]),
            "encoder_hidden_states": torch.randn(batch, 7, 32, generator=g)}


def tiny_sd3(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=(0,))


def sd3_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"hidden_states": torch.randn(2, 4, 16, 16, generator=g),
            "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
            "pooled_projections": torch.randn(2, 16, generator=g),
            "timestep": torch.tensor([10.0, 500.0])}


def tiny_flux(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4), guidance_embeds=True)


def flux_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def flux_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"hidden_states": torch.randn(2, 16, 8, generator=g),
            "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
            "pooled_projections": torch.randn(2, 16, generator=g),
            "timestep": torch.tensor([0.1, 0.7]), "guidance": torch.tensor([3.5, 3.5]),
            "img_ids": flux_ids(4, 4), "txt_ids": torch.zeros(7, 3)}


class VaeRoundTrip(torch.nn.Module):
    """AutoencoderKL encode -> posterior mode -> decode, as one module for the harness."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.vae.encode(x).latent_dist.mode()
        return self.vae.decode(z).sample


def tiny_vae(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(32, 64), latent_channels=4,
        norm_num_groups=16, layers_per_block=1, sample_size=16)  # the UNet's widths: shared compiled programs


# ------------------------------------------------------------------ whole models
def test_unet2d_condition() -> None:
    batch = unet_batch()
    target = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(9))
    rep = check_model("diffusers_unet2d_condition", tiny_unet(), batch, _mse_to(target), steps=20, lr=1e-3)
    _assert_report(rep)


def test_sd3_transformer() -> None:
    target = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(9))
    rep = check_model("diffusers_sd3_transformer", tiny_sd3(), sd3_batch(), _mse_to(target), steps=20, lr=1e-3)
    _assert_report(rep)


def test_flux_transformer() -> None:
    target = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(9))
    rep = check_model("diffusers_flux_transformer", tiny_flux(), flux_batch(), _mse_to(target), steps=20, lr=1e-3)
    _assert_report(rep)


def test_autoencoder_kl() -> None:
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    rep = check_model("diffusers_autoencoder_kl", VaeRoundTrip(tiny_vae()), x, _mse_to(x), steps=20, lr=1e-3)
    _assert_report(rep)


def test_autoencoder_kl_sample_and_decoder_grads() -> None:
    """Posterior sampling with a CPU generator (as pipelines do) and decoder-only gradients."""
    vae = tiny_vae(1)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    dev = tiny_vae(1).to(TPU)
    torch_tpu.reset_fallback_stats()
    with torch.no_grad():
        post_c, post_d = vae.encode(x).latent_dist, dev.encode(x.to(TPU)).latent_dist
        zc = post_c.sample(torch.Generator().manual_seed(6))
        zd = post_d.sample(torch.Generator().manual_seed(6))
        kl_c, kl_d = post_c.kl(), post_d.kl()
    err, ref = max_err([zd, kl_d], [zc, kl_c])
    assert err <= 2e-5 * max(1.0, ref), (err, ref)
    z = zc.detach()
    vae.decode(z).sample.square().mean().backward()
    dev.decode(z.to(TPU)).sample.square().mean().backward()
    names = [n for n, p in vae.decoder.named_parameters()]
    gd = dict(dev.decoder.named_parameters())
    err, ref = max_err([gd[n].grad for n in names], [p.grad for p in vae.decoder.parameters()])
    assert err <= 2e-5 * ref, (err, ref)
    assert all(p.grad is None for p in dev.encoder.parameters())
    assert torch_tpu.fallback_stats() == {}


@pytest.mark.parametrize("name,dtype", [("flux", torch.bfloat16), ("vae", torch.float16)])
def test_half_precision_forward(name: str, dtype: torch.dtype) -> None:
    """Reduced-precision forward: the tpu's error against the float32 CPU model stays within the CPU's own."""
    make, batch = {"flux": (tiny_flux, flux_batch),
                   "vae": (lambda: VaeRoundTrip(tiny_vae()), lambda: {"x": torch.randn(2, 3, 16, 16)})}[name]
    m32, b32 = make(), batch()
    half = copy.deepcopy(m32).to(dtype)
    bh = {k: v.to(dtype) if v.is_floating_point() and not k.endswith("_ids") else v for k, v in b32.items()}
    dev = copy.deepcopy(half).to(TPU)
    torch_tpu.reset_fallback_stats()
    with torch.no_grad():
        ref = float_tensors(m32(**b32))
        cpu_half = float_tensors(half(**bh))
        out = float_tensors(dev(**to_device(bh, TPU)))
    assert all(o.dtype == dtype for o in out)
    cpu_err, scale = max_err(cpu_half, ref)
    tpu_err, _ = max_err(out, ref)
    print(f"\n{name} {dtype}: |tpu - f32| {tpu_err:.2e}, |cpu - f32| {cpu_err:.2e} (scale {scale:.2f})")
    assert tpu_err <= 2.0 * cpu_err + 1e-3 * scale, (tpu_err, cpu_err)
    assert torch_tpu.fallback_stats() == {}


# ------------------------------------------------------------------ schedulers
def _run_scheduler(make: Callable[[], Any], n_steps: int, device: torch.device, dtype: torch.dtype,
                   **step_kw: Any) -> tuple[list[torch.Tensor], int]:
    """A scheduler's loop with fixed per-step model outputs; returns every prev_sample and the loop's host syncs."""
    sched = make()
    sched.set_timesteps(n_steps, device=device)
    g = torch.Generator().manual_seed(7)
    sample = torch.randn(2, 4, 8, 8, generator=g, dtype=dtype).to(device)
    outs = [torch.randn(2, 4, 8, 8, generator=g, dtype=dtype).to(device) for _ in sched.timesteps]
    noise_gen = torch.Generator().manual_seed(8)
    if device.type == "tpu":
        torch_tpu.synchronize()
    before = _host_syncs()
    results = []
    for t, eps in zip(sched.timesteps, outs, strict=True):
        sample = sched.step(eps, t, sample, generator=noise_gen, **step_kw).prev_sample
        results.append(sample)
    syncs = _host_syncs() - before
    return [r.cpu() for r in results], syncs


def _check_scheduler(name: str, make: Callable[[], Any], n_steps: int, dtype: torch.dtype, tol: float,
                     max_loop_syncs: int, **step_kw: Any) -> None:
    torch_tpu.reset_fallback_stats()
    ref, _ = _run_scheduler(make, n_steps, torch.device("cpu"), dtype, **step_kw)
    out, syncs = _run_scheduler(make, n_steps, TPU, dtype, **step_kw)
    assert all(o.dtype == r.dtype for o, r in zip(out, ref, strict=True))
    err, scale = max_err(out, ref)
    # Table row: "host_syncs_per_forward" holds the syncs per scheduler step (rounded up).
    rep = ModelReport(name, fwd_max_err=err, fwd_max_ref=scale, fallbacks=dict(torch_tpu.fallback_stats()),
                      host_syncs_per_forward=math.ceil(syncs / n_steps))
    record(rep)
    print(f"\n{name}: max err {err:.2e} (ref {scale:.2f}) over {n_steps} steps, host syncs {syncs} in the loop")
    assert err <= tol * max(1.0, scale), (err, scale)
    assert rep.fallbacks == {}, rep.fallbacks
    assert syncs <= max_loop_syncs, syncs


# DDIM's step reads `alphas_cumprod[timestep]` (a CPU table indexed by a tpu timestep) twice and
# `alphas_cumprod[prev_timestep] if prev_timestep >= 0` twice (in step and _get_variance): 6 host
# reads per step in diffusers' own code, the same on CUDA.
@pytest.mark.parametrize("prediction_type,eta", [("epsilon", 0.0), ("v_prediction", 0.5), ("sample", 0.0)])
def test_ddim_scheduler_steps(prediction_type: str, eta: float) -> None:
    def make() -> Any:
        return diffusers.DDIMScheduler(num_train_timesteps=1000, prediction_type=prediction_type,
                                       clip_sample=prediction_type == "sample")
    _check_scheduler(f"diffusers_ddim_step_{prediction_type}_eta{eta}", make, 6, torch.float32, 1e-5,
                     max_loop_syncs=6 * 6, eta=eta)


# FlowMatch's first step looks its timestep up with `(timesteps == t).nonzero()` + `.item()` (documented
# host syncs: one read each);
# later steps use the cached step index and read nothing from the device.
@pytest.mark.parametrize("kwargs", [{"shift": 3.0}, {"shift": 1.0, "stochastic_sampling": True}])
def test_flow_match_euler_steps(kwargs: dict[str, Any]) -> None:
    def make() -> Any:
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **kwargs)
    tag = "_".join(f"{k}{v}" for k, v in kwargs.items())
    _check_scheduler(f"diffusers_flowmatch_step_{tag}", make, 6, torch.float32, 1e-5, max_loop_syncs=2)


def test_schedulers_float64() -> None:
    """float64 samples through both schedulers (DDIM keeps float64; FlowMatch upcasts to float32)."""
    _check_scheduler("diffusers_ddim_step_f64", lambda: diffusers.DDIMScheduler(), 4, torch.float64, 1e-6,
                     max_loop_syncs=6 * 4)
    _check_scheduler("diffusers_flowmatch_step_f64", lambda: diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
                     4, torch.float64, 1e-6, max_loop_syncs=2)


# ------------------------------------------------------------------ loops and pipelines
def _assert_loop_matches_cpu(loop: Callable[[torch.device], torch.Tensor], tol: float = 5e-5) -> None:
    """A sampling loop run on CPU and on tpu gives the same latents, with no CPU fallback."""
    torch_tpu.reset_fallback_stats()
    ref, out = loop(torch.device("cpu")), loop(TPU)
    err, scale = max_err([out], [ref])
    assert err <= tol * max(1.0, scale), (err, scale)
    assert torch_tpu.fallback_stats() == {}


def test_unet_ddim_loop_with_guidance() -> None:
    """A 3-step classifier-free-guidance DDIM loop with the tiny UNet, everything on tpu vs CPU."""
    def loop(device: torch.device) -> torch.Tensor:
        unet = tiny_unet(3).to(device).eval()
        sched = diffusers.DDIMScheduler(num_train_timesteps=1000)
        sched.set_timesteps(3, device=device)
        g = torch.Generator().manual_seed(11)
        latents = torch.randn(1, 4, 16, 16, generator=g).to(device) * sched.init_noise_sigma
        cond = torch.randn(2, 7, 32, generator=g).to(device)  # [uncond, cond]
        with torch.no_grad():
            for t in sched.timesteps:
                inp = sched.scale_model_input(torch.cat([latents] * 2), t)
                e_u, e_c = unet(inp, t, encoder_hidden_states=cond).sample.chunk(2)
                latents = sched.step(e_u + 5.0 * (e_c - e_u), t, latents).prev_sample
        return latents.cpu()

    # Guidance scale 5 amplifies float32 rounding of the two UNet passes (5x (e_c - e_u)) three
    # times; CPU conv accumulation order differs by CPU ISA (seen: 4.9e-5 on one host, 6.0e-5 on another).
    _assert_loop_matches_cpu(loop, tol=1.5e-4)


def test_sd3_flow_match_loop() -> None:
    """A 3-step FlowMatch Euler loop with the tiny SD3 transformer on tpu vs CPU."""
    def loop(device: torch.device) -> torch.Tensor:
        model = tiny_sd3(4).to(device).eval()
        sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
        sched.set_timesteps(3, device=device)
        b = {k: v.to(device) for k, v in sd3_batch().items() if k != "timestep"}
        latents = b.pop("hidden_states")
        with torch.no_grad():
            for t in sched.timesteps:
                v = model(hidden_states=latents, timestep=t.expand(2), **b).sample
                latents = sched.step(v, t, latents).prev_sample
        return latents.cpu()

    _assert_loop_matches_cpu(loop)


@pytest.mark.parametrize("kind", ["ddpm", "ddim"])
def test_pipeline_to_tpu(kind: str) -> None:
    """`pipe.to("tpu")` on a real diffusers pipeline (tiny UNet2DModel); noise from a CPU generator."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=16, attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    if kind == "ddpm":
        pipe = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=1000))
    else:
        pipe = diffusers.DDIMPipeline(unet=unet, scheduler=diffusers.DDIMScheduler(num_train_timesteps=1000))
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(batch_size=2, generator=torch.Generator().manual_seed(0), num_inference_steps=3, output_type="np").images
    torch_tpu.reset_fallback_stats()
    pipe.to("tpu")
    assert pipe.device.type == "tpu"
    out = pipe(batch_size=2, generator=torch.Generator().manual_seed(0), num_inference_steps=3, output_type="np").images
    assert out.shape == ref.shape == (2, 16, 16, 4)
    assert abs(out - ref).max() <= 5e-5, abs(out - ref).max()
    if kind == "ddpm":
        # A tpu generator: the noise is drawn on the device, reproducible per seed.
        def run(seed: int) -> Any:
            return pipe(batch_size=2, generator=torch.Generator("tpu").manual_seed(seed), num_inference_steps=3,
                        output_type="np").images
        a, b, c = run(0), run(0), run(1)
        assert abs(a - b).max() == 0.0
        assert abs(a - c).max() > 0.1
    assert torch_tpu.fallback_stats() == {}


# ------------------------------------------------------------------ float64 position embeddings
def test_flux_rope_float64() -> None:
    """Flux RoPE computes its angles in float64 on the device; large positions would expose float32 math."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    emb = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])
    ids = torch.stack([torch.zeros(64), torch.arange(64) * 61.0 + 3.0, torch.arange(64) * 127.0 + 1.0], dim=1)
    torch_tpu.reset_fallback_stats()
    cos_c, sin_c = emb(ids)
    cos_d, sin_d = emb(ids.to(TPU))
    assert cos_d.device.type == "tpu" and cos_d.dtype == cos_c.dtype == torch.float32
    err, _ = max_err([cos_d, sin_d], [cos_c, sin_c])
    assert err <= 1e-6, err
    # Sensitivity: the same angles computed in float32 are off by far more than the tolerance.
    f32 = torch.outer(ids[:, 2], 1.0 / (10000 ** (torch.arange(0, 6, 2, dtype=torch.float32) / 6))).cos()
    f64 = torch.outer(ids[:, 2].double(), 1.0 / (10000 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))).cos()
    assert (f32.double() - f64).abs().max().item() > 1e-5
    assert torch_tpu.fallback_stats() == {}


def test_sincos_pos_embed_float64() -> None:
    """SD3/PixArt 2-D sin-cos position embeddings: float64 on the device, directly and through PatchEmbed."""
    from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed

    torch_tpu.reset_fallback_stats()
    ref = get_2d_sincos_pos_embed(32, (6, 10), base_size=4, interpolation_scale=0.5, device=torch.device("cpu"))
    out = get_2d_sincos_pos_embed(32, (6, 10), base_size=4, interpolation_scale=0.5, device=TPU)
    assert out.device.type == "tpu" and out.dtype == ref.dtype == torch.float64
    err, _ = max_err([out], [ref])
    assert err <= 1e-12, err
    # PatchEmbed built for 8x8 and fed 12x12 computes its position embedding on the input's device.
    torch.manual_seed(0)
    pe = PatchEmbed(height=8, width=8, patch_size=2, in_channels=4, embed_dim=16, pos_embed_type="sincos")
    x = torch.randn(2, 4, 12, 12)
    with torch.no_grad():
        ref_pe = pe(x)
        out_pe = pe.to(TPU)(x.to(TPU))
    err, scale = max_err([out_pe], [ref_pe])
    assert err <= 1e-5 * max(1.0, scale), err
    assert torch_tpu.fallback_stats() == {}
