"""Diffusers' group offloading (block / leaf level, streams, disk) on tpu: outputs equal the
non-offloaded model on tpu and on the CPU, and weights go back to the CPU between calls."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("diffusers")

from tests.test_models_diffusers import sd3_batch, tiny_sd3  # noqa: E402

_ref: dict[str, torch.Tensor] = {}


def _reference(dev: str) -> torch.Tensor:
    if dev not in _ref:
        m = tiny_sd3().to(dev)
        with torch.no_grad():
            _ref[dev] = m(**{k: v.to(dev) for k, v in sd3_batch().items()}).sample.cpu()
    return _ref[dev]


@pytest.mark.parametrize("kw", [
    {"offload_type": "block_level", "num_blocks_per_group": 1},
    {"offload_type": "leaf_level"},
    {"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": True},
    {"offload_type": "leaf_level", "use_stream": True},
    {"offload_type": "block_level", "num_blocks_per_group": 1, "disk": True},
    {"offload_type": "leaf_level", "use_stream": True, "disk": True},
], ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_group_offload_matches(kw: dict[str, Any]) -> None:
    kw = dict(kw)
    if kw.pop("disk", False):
        kw["offload_to_disk_path"] = tempfile.mkdtemp()
    m = tiny_sd3()
    m.enable_group_offload(onload_device=torch.device("tpu"), offload_device=torch.device("cpu"), **kw)
    with torch.no_grad():
        for _ in range(2):  # second call: onloads again after the offload
            out = m(**{k: v.to("tpu") for k, v in sd3_batch().items()}).sample
            assert out.device.type == "tpu"
            assert all(p.device.type == "cpu" for p in m.parameters())
            torch.testing.assert_close(out.cpu(), _reference("tpu"), rtol=0, atol=0)
            torch.testing.assert_close(out.cpu(), _reference("cpu"), rtol=1e-5, atol=1e-5)
