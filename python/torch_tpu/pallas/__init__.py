"""`torch.tpu.pallas`: JAX and Pallas functions as torch ops on tpu tensors.

`jax_op("ns::name", fn)` registers a custom op whose tpu kernel is the JAX function's StableHLO,
spliced into our programs (strict eager, fused eager, torch.compile graphs). Importing this
module does not import JAX; registering an op does (pip install 'torch_tpu[jax]').
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch_tpu.pallas._jax_op import jax_op

__all__ = ["jax_op", "custom_jax_kernel", "get_pallas_mesh"]


def custom_jax_kernel(name: str, fn: Callable[..., Any] | None = None, /, **kwargs: Any) -> Any:
    """Deprecated name of `jax_op` (kept for scripts written for the reference API)."""
    warnings.warn("custom_jax_kernel is deprecated; use torch.tpu.pallas.jax_op", DeprecationWarning, stacklevel=2)
    return jax_op(name, fn, **kwargs)


def get_pallas_mesh(axis_names: Sequence[str], mesh_shape: Sequence[int] | None = None,
                    process_group: Any = None) -> Any:
    """A JAX mesh whose position i is rank i of the process group (one chip per process), for
    jax_op(mesh=...) and jax.shard_map inside jax_op functions; see torch_tpu/pallas/_sharded.py."""
    from torch_tpu.pallas._sharded import get_pallas_mesh as impl

    return impl(axis_names, mesh_shape, process_group)
