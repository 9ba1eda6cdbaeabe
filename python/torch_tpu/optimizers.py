"""`torch.tpu.optimizers` / `torch_tpu.optimizers`: training helpers.

`SingleTraceTrainer(model, optimizer, loss_fn)`: forward, backward and the optimizer update of a
step as ONE program (see `_internal/train_step.py`).
"""

from __future__ import annotations

from torch_tpu._internal.train_step import SingleTraceTrainer

__all__ = ["SingleTraceTrainer"]
