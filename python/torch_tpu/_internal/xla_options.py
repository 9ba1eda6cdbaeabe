"""XLA compile options for compiled graphs: `torch.compile(..., options={...})` and
`torch_tpu.compiler.custom_compiler_options({...})` (the TPU reference's name).

Options become serialized `xla.CompileOptionsProto` fields merged over the runtime's defaults
(protobuf concatenation = merge; hand-encoded, no protobuf dependency):
  - `xla_optimization_level` / `xla_memory_fitting_level`: "O0".."O3" (or 0..3) ->
    ExecutableBuildOptionsProto fields 24 / 25 (EffortLevel: O0=9, O1=19, O2=29, O3=39);
  - every other `xla_*` key: an XLA debug option by its flag name (e.g. `xla_cpu_enable_fast_math`,
    `xla_backend_optimization_level`), sent as `env_option_overrides` (field 7, a map of
    OptionOverrideProto: string 1, bool 2, int64 3, double 4). The plugin rejects unknown names.
The bytes are part of the compile-cache key, so programs built with other options never mix.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Mapping
from typing import Any

_EFFORT = {"O0": 9, "O1": 19, "O2": 29, "O3": 39}
_LEVEL_FIELDS = {"xla_optimization_level": 24, "xla_memory_fitting_level": 25}

_active: list[dict[str, Any]] = []  # custom_compiler_options() stack


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: two's complement, 10 bytes when negative
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _override(value: Any) -> bytes:
    if isinstance(value, bool):
        return _varint(2 << 3) + _varint(int(value))
    if isinstance(value, int):
        return _varint(3 << 3) + _varint(value)
    if isinstance(value, float):
        return _varint(4 << 3 | 1) + struct.pack("<d", value)
    if isinstance(value, str):
        return _field(1, value.encode())
    raise TypeError(f"XLA option values are bool, int, float or str; got {type(value).__name__}")


def _effort(name: str, value: Any) -> int:
    key = f"O{value}" if isinstance(value, int) and not isinstance(value, bool) else str(value).upper()
    if key not in _EFFORT:
        raise ValueError(f"{name} must be one of O0, O1, O2, O3 (or 0..3); got {value!r}")
    return _EFFORT[key]


def validate(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Checks option names and values; returns them as a plain dict."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if not isinstance(name, str) or not name.startswith("xla_"):
            raise ValueError(f"torch_tpu: unknown compile option {name!r}: options are XLA options named "
                             "xla_* (e.g. xla_optimization_level='O3', xla_cpu_enable_fast_math=False)")
        if name in _LEVEL_FIELDS:
            _effort(name, value)
        else:
            _override(value)
        out[name] = value
    return out


def encode(options: Mapping[str, Any] | None) -> bytes:
    """The CompileOptionsProto bytes for `options` (empty for none)."""
    options = validate(options)
    build = b""
    overrides = b""
    for name in sorted(options):
        value = options[name]
        if name in _LEVEL_FIELDS:
            build += _varint(_LEVEL_FIELDS[name] << 3) + _varint(_effort(name, value))
        else:
            overrides += _field(7, _field(1, name.encode()) + _field(2, _override(value)))
    return (_field(3, build) if build else b"") + overrides


def current() -> dict[str, Any]:
    """Options of the innermost custom_compiler_options() block (merged outward-in)."""
    merged: dict[str, Any] = {}
    for layer in _active:
        merged.update(layer)
    return merged


@contextlib.contextmanager
def custom_compiler_options(options: Mapping[str, Any]) -> Iterator[None]:
    """XLA options for every graph compiled inside the block (they are read when a graph is
    built, i.e. at the first call of a compiled function)."""
    _active.append(validate(options))
    try:
        yield
    finally:
        _active.pop()
