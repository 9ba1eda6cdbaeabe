"""Shared checks for whole models on the tpu device against the same model on the CPU.

A model test builds a seeded model on the CPU, copies it to `tpu`, and calls `check_model`:
forward outputs, one-step gradients, an AdamW loss curve, CPU fallbacks and host syncs per forward
are measured in one place so every model is held to the same rules. Each result row can be
appended to a JSON table (TORCH_TPU_MODEL_TABLE=path) for the issue notes / benchmarks.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch_tpu

Batch = Mapping[str, Any]


@dataclass
class ModelReport:
    name: str
    fwd_max_err: float = math.nan      # max |tpu - cpu| over the forward outputs (float tensors)
    fwd_max_ref: float = math.nan      # max |cpu| of those outputs, for scale
    grad_max_err: float = math.nan     # max |g_tpu - g_cpu| over all parameter grads
    grad_max_ref: float = math.nan     # max |g_cpu|
    loss_curve_max_dev: float = math.nan  # max |loss_tpu[i] - loss_cpu[i]| over the AdamW steps
    losses_cpu: list[float] = field(default_factory=list)
    losses_tpu: list[float] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)
    host_syncs_per_forward: int = -1
    extra: dict[str, Any] = field(default_factory=dict)  # model-specific checks (e.g. bf16 forward error)


def to_device(obj: Any, device: str | torch.device) -> Any:
    """Moves tensors nested in dicts/lists/tuples to `device` (other leaves unchanged)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def float_tensors(obj: Any) -> list[torch.Tensor]:
    """Floating tensors in a model output (ModelOutput, dict, tuple, tensor), in a stable order."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, Mapping):
        return [t for k in obj for t in float_tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in float_tensors(v)]
    if hasattr(obj, "to_tuple"):
        return float_tensors(obj.to_tuple())
    if hasattr(obj, "sample"):  # diffusers outputs (e.g. DecoderOutput.sample)
        return float_tensors(obj.sample)
    return []


def module_to(model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """`model.to(...)`, the user's path: torch_tpu keeps tied parameters tied across tpu moves."""
    return model.to(*args, **kwargs)


def max_err(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, float]:
    assert len(a) == len(b), f"output count differs: {len(a)} vs {len(b)}"
    err, ref = 0.0, 0.0
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape, f"shape differs: {tuple(x.shape)} vs {tuple(y.shape)}"
        x, y = x.detach().cpu().double(), y.detach().cpu().double()
        err = max(err, (x - y).abs().max().item() if x.numel() else 0.0)
        ref = max(ref, y.abs().max().item() if y.numel() else 0.0)
    return err, ref


def _call(model: torch.nn.Module, batch: Batch | Sequence[Any] | torch.Tensor) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, torch.Tensor):
        return model(batch)
    return model(*batch)


def check_model(
    name: str,
    model: torch.nn.Module,
    batch: Batch | Sequence[Any] | torch.Tensor,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    steps: int = 20,
    lr: float = 1e-3,
    train_batch: Batch | Sequence[Any] | torch.Tensor | None = None,
) -> ModelReport:
    """Runs forward (eval, no_grad), one-step grads and `steps` AdamW steps on CPU and tpu.

    `model` lives on the CPU with its final weights; `loss_fn(output) -> scalar` turns an output
    into a training loss. `train_batch` (default: `batch`) is used for gradients and training.
    The caller asserts tolerances on the returned report (they depend on the model and dtype).
    """
    rep = ModelReport(name)
    cpu = model
    dev = module_to(copy.deepcopy(model), "tpu")
    tb = batch if train_batch is None else train_batch
    batch_d, tb_d = to_device(batch, "tpu"), to_device(tb, "tpu")

    # Forward in eval mode: outputs, fallbacks, host syncs of exactly one forward (after a warm-up).
    cpu.eval()
    dev.eval()
    torch_tpu.reset_fallback_stats()
    with torch.no_grad():
        ref = float_tensors(_call(cpu, batch))
        _call(dev, batch_d)
        torch_tpu.synchronize()
        before = torch_tpu.dispatch_stats()["host_syncs"]
        out = _call(dev, batch_d)
        torch_tpu.synchronize()
        rep.host_syncs_per_forward = torch_tpu.dispatch_stats()["host_syncs"] - before
        rep.fwd_max_err, rep.fwd_max_ref = max_err(float_tensors(out), ref)

    # One-step gradients (train mode; models under test use dropout 0 so both sides agree).
    cpu.train()
    dev.train()
    loss_fn(_call(cpu, tb)).backward()
    loss_fn(_call(dev, tb_d)).backward()
    names = [n for n, p in cpu.named_parameters() if p.grad is not None]
    dev_params = dict(dev.named_parameters())
    missing = [n for n in names if dev_params[n].grad is None]
    assert not missing, f"no tpu gradient for {missing[:5]}"
    rep.grad_max_err, rep.grad_max_ref = max_err(
        [dev_params[n].grad for n in names], [dict(cpu.named_parameters())[n].grad for n in names])

    # AdamW loss curve (default foreach path on both devices), starting from the same weights.
    rep.losses_cpu = train_losses(copy.deepcopy(cpu), tb, loss_fn, steps=steps, lr=lr)
    rep.losses_tpu = train_losses(module_to(copy.deepcopy(cpu), "tpu"), tb_d, loss_fn, steps=steps, lr=lr)
    rep.loss_curve_max_dev = max((abs(a - b) for a, b in zip(rep.losses_cpu, rep.losses_tpu, strict=True)),
                                 default=0.0)
    rep.fallbacks = dict(torch_tpu.fallback_stats())
    record(rep)
    return rep


def train_losses(
    model: torch.nn.Module,
    data: Batch | Sequence[Any] | torch.Tensor,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    steps: int,
    lr: float,
    autocast_dtype: torch.dtype | None = None,
) -> list[float]:
    """`steps` AdamW steps (default foreach path) of `model` on `data`, in train mode; the losses.

    With `autocast_dtype` the forward and loss run under `torch.autocast(<model's device type>)`.
    """
    device_type = next(model.parameters()).device.type
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = loss_fn(_call(model, data))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def forward_outputs(
    model: torch.nn.Module, batch: Batch | Sequence[Any] | torch.Tensor, *, dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, int]]:
    """Eval-mode no-grad forward of `model` (on the CPU) and of a tpu copy, both cast to `dtype`
    if given (floating inputs too); returns (cpu outputs, tpu outputs on the CPU, CPU fallbacks
    of the tpu forward)."""

    def cast(obj: Any) -> Any:
        if dtype is None:
            return obj
        if isinstance(obj, torch.Tensor):
            return obj.to(dtype) if obj.is_floating_point() else obj
        if isinstance(obj, Mapping):
            return {k: cast(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cast(v) for v in obj)
        return obj

    cpu = copy.deepcopy(model).eval()
    if dtype is not None:
        cpu = cpu.to(dtype)
    dev = module_to(copy.deepcopy(cpu), "tpu")
    data = cast(batch)
    torch_tpu.reset_fallback_stats()
    with torch.no_grad():
        ref = float_tensors(_call(cpu, data))
        out = [t.cpu() for t in float_tensors(_call(dev, to_device(data, "tpu")))]
    return ref, out, dict(torch_tpu.fallback_stats())


def compare_generate(
    model: torch.nn.Module, inputs: Batch, **generate_kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int], int]:
    """`model.generate(**inputs, **generate_kwargs)` on the CPU and on a tpu copy.

    Returns (cpu tokens, tpu tokens on the CPU, CPU fallbacks, host syncs) of the tpu run.
    """
    cpu = copy.deepcopy(model).eval()
    dev = module_to(copy.deepcopy(cpu), "tpu")
    with torch.no_grad():
        ref = cpu.generate(**inputs, **generate_kwargs)
        torch_tpu.reset_fallback_stats()
        torch_tpu.synchronize()
        before = torch_tpu.dispatch_stats()["host_syncs"]
        out = dev.generate(**to_device(inputs, "tpu"), **generate_kwargs)
        torch_tpu.synchronize()
        syncs = torch_tpu.dispatch_stats()["host_syncs"] - before
    return ref, out.cpu(), dict(torch_tpu.fallback_stats()), syncs


def record(rep: ModelReport) -> None:
    """Merges the report into the JSON table named by TORCH_TPU_MODEL_TABLE (if set)."""
    path = os.environ.get("TORCH_TPU_MODEL_TABLE")
    if not path:
        return
    p = Path(path)
    table = json.loads(p.read_text()) if p.exists() else {}
    row = asdict(rep)
    table[rep.name] = row
    p.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
