"""`torch.tpu.ops`: tpu kernels beyond ATen (ragged_dot for MoE)."""

from __future__ import annotations

__all__: list[str] = []
