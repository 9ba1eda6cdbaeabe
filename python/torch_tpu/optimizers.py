"""`torch.tpu.optimizers` / `torch_tpu.optimizers`: training helpers.

`SingleTraceTrainer(model, optimizer, loss_fn)`: forward, backward and the optimizer update of a
step as ONE program (see `_internal/train_step.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_tpu._internal.train_step import SingleTraceTrainer

__all__ = ["SingleTraceTrainer"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the trainer pulls in the compile stack (sympy, FX symbolic shapes),
    # ~1.4 s that `import torch` (which autoloads torch_tpu) must not pay.
    if name == "SingleTraceTrainer":
        from torch_tpu._internal.train_step import SingleTraceTrainer

        return SingleTraceTrainer
    raise AttributeError(f"module 'torch_tpu.optimizers' has no attribute {name!r}")
