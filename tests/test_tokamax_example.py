"""A Tokamax kernel wrapped with jax_op (the example of docs/kernels.md): Tokamax's Pallas Mosaic-TPU
ragged dot runs on the CPU plugin in interpret mode, equal to the per-group loop on the CPU.
Skipped when tokamax (not in make test's environment: it pulls flax, orbax, tensorstore) is missing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokamax")
jax = pytest.importorskip("jax")


def test_tokamax_ragged_dot_through_jax_op() -> None:
    import tokamax
    from absl import flags
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu
    from torch_tpu.pallas import jax_op

    flags.FLAGS.mark_as_parsed()  # Tokamax reads absl flags, which would parse pytest's command line

    class AnyDevice(pallas_mosaic_tpu.PallasMosaicTpuRaggedDot):
        """Tokamax refuses non-TPU devices even with interpret=True; jax_op interprets it."""

        def supported_on(self, device: object) -> bool:
            return True

    kernel = AnyDevice(interpret=True)

    @jax_op("tokamax_example::ragged_dot")
    def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=[kernel])

    g = torch.Generator().manual_seed(0)
    lhs = torch.randn(256, 128, generator=g)  # Tokamax's TPU kernel needs every dim >= 128
    rhs = torch.randn(4, 128, 256, generator=g) / 128**0.5
    sizes = [100, 0, 60, 80]  # an empty group; 16 rows past the groups (Tokamax leaves them unwritten)
    out = ragged_dot(lhs.to("tpu"), rhs.to("tpu"), torch.tensor(sizes, dtype=torch.int32).to("tpu")).cpu()
    start = 0
    for e, n in enumerate(sizes):
        torch.testing.assert_close(out[start:start + n], lhs[start:start + n] @ rhs[e], atol=1e-4, rtol=1e-4)
        start += n
