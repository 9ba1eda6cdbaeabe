"""`torch_tpu.distributed` (also `torch.tpu.distributed`): multi-chip support.

One process per chip, each seeing its chip as `tpu:0` (what torchrun gives). `import torch`
registers the c10d backends "tpu_dist" and "tpu" for device "tpu", so
`init_process_group()` with no backend picks them in a tpu process. See docs/distributed.md.
"""

from __future__ import annotations

from torch_tpu.distributed._backend import BACKEND_NAMES, register
from torch_tpu.distributed.launch import free_port, spawn, transport

__all__ = ["BACKEND_NAMES", "free_port", "register", "spawn", "transport"]
