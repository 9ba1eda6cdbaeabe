"""Eager execution modes, spelled as Google's TorchTPU spells them.

DEFER_NEVER: strict eager (default) - each op launches asynchronously once PJRT accepts it.
DEFER_NEVER_AND_LAUNCH_BLOCKING: debug eager - waits for every op, so errors name their op.
DEFER_AND_FUSE: fused eager - ops are recorded into one pending program, launched at sync
points (host reads, synchronize, data-dependent ops, size limit); the same semantics as strict.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from contextlib import contextmanager

from torch_tpu import _C


class EagerMode(enum.Enum):
    DEFER_NEVER = 0
    DEFER_NEVER_AND_LAUNCH_BLOCKING = 1
    DEFER_AND_FUSE = 2


def get_eager_mode() -> EagerMode:
    return EagerMode(_C._get_eager_mode())


def _apply(mode: EagerMode) -> None:
    if not isinstance(mode, EagerMode):
        raise TypeError(f"expected a torch_tpu EagerMode, got {mode!r}")
    _C._set_eager_mode(mode.value)


class set_eager_mode:  # noqa: N801 - mirrors TorchTPU's spelling; usable as call or context manager
    """`set_eager_mode(m)` switches the mode; `with set_eager_mode(m):` restores it afterwards."""

    def __init__(self, mode: EagerMode) -> None:
        import torch

        if torch.compiler.is_compiling():
            raise RuntimeError("set_eager_mode cannot be called inside torch.compile: a compiled graph is one "
                               "program whatever the eager mode; switch modes outside the compiled function")
        self._prev = get_eager_mode()
        _apply(mode)

    def __enter__(self) -> set_eager_mode:
        return self

    def __exit__(self, *exc: object) -> None:
        _C._set_eager_mode(self._prev.value)


@contextmanager
def eager_mode(mode: EagerMode) -> Iterator[None]:
    with set_eager_mode(mode):
        yield


def _init_from_env() -> None:
    if os.environ.get("TORCH_TPU_DEFER_AND_FUSE") == "1":
        _apply(EagerMode.DEFER_AND_FUSE)
    if os.environ.get("TPU_LAUNCH_BLOCKING") == "1":
        _apply(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)
