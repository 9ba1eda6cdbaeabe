"""tpu-moe: kernels-library layers for torch_tpu (variant `torch-tpu`).

`layers.MoEExperts` replaces Transformers' MoE experts (Qwen3-MoE, Mixtral: `gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I], `act_fn`) with two `torch.tpu.ops.ragged_dot` calls: tokens are
sorted by expert on the device, no host sync. `layers.RMSNorm` replaces an RMSNorm (`weight`,
`variance_epsilon`) with the same float32 math (one fused program in fused eager / compile).
"""

from . import layers

__all__ = ["layers"]
