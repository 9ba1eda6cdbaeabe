"""Bridges for Pallas kernels generated elsewhere (torch 2.13's Inductor imports
`torch_tpu._internal.pallas.tpu_torch_pallas`)."""

from torch_tpu.pallas import custom_jax_kernel, jax_op

__all__ = ["custom_jax_kernel", "jax_op"]
