"""The ragged dot as a Pallas kernel, run through torch.tpu.pallas.jax_op: Mosaic on TPUs, interpret
mode (plain StableHLO) on other PJRT devices. Grid (row tiles, groups); a (tile, group) step
multiplies only when the group overlaps the tile and keeps the rows the group owns. The
backward uses the lowered ragged_dot ops. Importing this module imports JAX."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_tpu.pallas import jax_op

_TM = 128  # rows per tile (fewer when M is small)


def _kernel(ends_ref: Any, x_ref: Any, w_ref: Any, o_ref: Any, acc_ref: Any, *, tm: int) -> None:
    i, g = pl.program_id(0), pl.program_id(1)

    @pl.when(g == 0)
    def _init() -> None:
        acc_ref[...] = jnp.zeros_like(acc_ref)

    end = ends_ref[g]
    start = jnp.where(g == 0, 0, ends_ref[jnp.maximum(g - 1, 0)])
    row0 = i * tm

    @pl.when((start < row0 + tm) & (end > row0) & (end > start))
    def _compute() -> None:
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (rows >= start) & (rows < end)
        y = jnp.dot(x_ref[...], w_ref[0], preferred_element_type=jnp.float32)
        acc_ref[...] += jnp.where(mine, y, 0.0)

    @pl.when(g == pl.num_programs(1) - 1)
    def _store() -> None:
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    m, k = lhs.shape
    g, _, n = rhs.shape
    tm = min(_TM, -(-m // 8) * 8)
    mp = -(-m // tm) * tm
    x = jnp.pad(lhs, ((0, mp - m), (0, 0))) if mp > m else lhs
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    import functools

    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm),
        grid=(mp // tm, g),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec((tm, k), lambda i, gi: (i, 0)),
            pl.BlockSpec((1, k, n), lambda i, gi: (gi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((tm, n), lambda i, gi: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((mp, n), lhs.dtype),
        scratch_shapes=[pltpu.VMEM((tm, n), jnp.float32)],
    )(ends, x, rhs)
    return out[:m]


@jax_op("torch_tpu::ragged_dot_pallas")
def ragged_dot_pallas(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return _ragged_dot(lhs, rhs, group_sizes)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    lhs, rhs, gs = ctx.saved_tensors
    return (torch.ops.torch_tpu.ragged_dot(grad, rhs.transpose(1, 2), gs),
            torch.ops.torch_tpu.ragged_dot_weight_grad(lhs, grad, gs), None)


ragged_dot_pallas.register_autograd(_backward, setup_context=_setup)


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return ragged_dot_pallas(lhs, rhs, group_sizes.to(torch.int32))
