"""Layers for kernels.kernelize: no __init__, the forward signature of the layer they replace."""

from __future__ import annotations

import torch
import torch_tpu.ops


def _kn(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """Expert weights [E, N, K] (nn.Linear layout) as the [E, K, N] operand of ragged_dot.

    float32 inference keeps a contiguous [E, K, N] copy (one extra copy of the weights, refreshed
    when the parameter is replaced or changed in place): XLA:CPU's batched float32 GEMM over the
    [E, N, K] layout is 3-4x slower (benchmarks/bench_grouped_mm.py, "hf layout"). bfloat16 and
    float16 GEMMs are as fast in either layout, and training needs the view for the weight's
    gradient, so they use the transposed view."""
    w: torch.Tensor = getattr(layer, name)
    if w.dtype != torch.float32 or (torch.is_grad_enabled() and w.requires_grad) or torch.compiler.is_compiling():
        return w.transpose(1, 2)
    cache: dict[str, tuple[torch.Tensor, tuple[object, ...], torch.Tensor]] = layer.__dict__.setdefault(
        "_tpu_kn_cache", {})
    key = (w._version, w.data_ptr(), w.device, w.shape)  # .to() / .data = ... keep the Parameter object
    hit = cache.get(name)
    if hit is None or hit[0] is not w or hit[1] != key:
        hit = (w, key, w.detach().transpose(1, 2).contiguous())
        cache[name] = hit
    return hit[2]


class MoEExperts(torch.nn.Module):
    """Transformers' experts (forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]))."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    num_experts: int

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        t, h = hidden_states.shape
        k = top_k_index.shape[1]
        e = self.gate_up_proj.shape[0]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        token = order // k
        # tokens per expert without a host read (bincount's length would need one)
        sizes = torch.zeros(e, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        x = hidden_states[token]
        gate_up = torch_tpu.ops.ragged_dot(x, _kn(self, "gate_up_proj"), sizes)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch_tpu.ops.ragged_dot(self.act_fn(gate) * up, _kn(self, "down_proj"), sizes)
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, token, y.to(out.dtype)).reshape(t, h)


class RMSNorm(torch.nn.Module):
    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)
