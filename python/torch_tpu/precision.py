"""`torch.tpu.Precision` / `torch.tpu.precision`: the precision of float contractions on tpu.

Every contraction the lowering table emits (matmul, linear, bmm, baddbmm, einsum, attention,
convolution, ...) carries a StableHLO `precision_config` on both operands:

- `Precision.HIGHEST`: full float32 arithmetic. The default here, so results match PyTorch CPU.
- `Precision.HIGH`: a faster mode where the backend has one (bf16x3 passes on TPU).
- `Precision.DEFAULT`: the backend's fastest (one bf16 pass on TPU).

XLA:CPU computes every precision in float32, so on the CPU plugin only the program text differs.

Without an override the precision follows `torch.set_float32_matmul_precision`: "highest" ->
HIGHEST, "high" -> HIGH, "medium" -> DEFAULT. `torch.tpu.precision(p)` overrides that for the
whole process. It takes effect at once, and restores the previous setting when it is used as a
context manager:

    with torch.tpu.precision(torch.tpu.Precision.HIGH):
        y = model(x)

The precision is part of every program's key. Eager ops take the precision in force when they
are called, even when fused eager runs them later. A compiled graph runs the program for the
precision in force at each call, and builds it on first use.
"""

from __future__ import annotations

import enum
from typing import Any

from torch_tpu import _C

__all__ = ["Precision", "get_precision", "precision"]


class Precision(enum.IntEnum):
    DEFAULT = 0
    HIGH = 1
    HIGHEST = 2


# torch.set_float32_matmul_precision's names
_TORCH_NAMES = {"highest": Precision.HIGHEST, "high": Precision.HIGH, "medium": Precision.DEFAULT}


def _coerce(p: Any) -> Precision:
    if isinstance(p, Precision):
        return p
    if isinstance(p, str):
        key = p.lower()
        if key in _TORCH_NAMES:
            return _TORCH_NAMES[key]
        if key.upper() in Precision.__members__:
            return Precision[key.upper()]
    raise ValueError(f"torch.tpu.precision: expected a torch.tpu.Precision (DEFAULT, HIGH, HIGHEST) or one of "
                     f"'highest', 'high', 'medium'; got {p!r}")


def get_precision() -> Precision:
    """The precision contractions get now (the override, else torch's float32 matmul precision)."""
    return Precision(_C._matmul_precision())


class precision:  # noqa: N801 - a setter that is also a context manager, like torch.set_grad_enabled
    """Sets the precision of tpu contractions now; `None` follows torch.set_float32_matmul_precision
    again. Used as a context manager, it restores the previous setting on exit."""

    def __init__(self, p: Precision | str | None) -> None:
        value = -1 if p is None else int(_coerce(p))
        self._previous = _C._precision_override()
        _C._set_precision_override(value)

    def __enter__(self) -> precision:
        return self

    def __exit__(self, *exc: object) -> None:
        _C._set_precision_override(self._previous)
