"""The calling convention of torch 2.13's Inductor Pallas codegen
(`torch/_inductor/codegen/pallas.py`): a kernel is exported with `jax.export` and registered by
(name, key) with its serialized module; calls pass tpu input tensors and empty tensors giving
each output's shape and dtype, and get fresh result tensors back. The module runs through the
same `jax_call` path as `jax_op` (compiled once, memory + disk cache, on the device buffers).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torch_tpu.pallas import _foreign

_lock = threading.Lock()
_kernels: dict[tuple[str, str], _foreign.Kernel] = {}


def lookup_custom_kernel(name: str, key: str) -> bool:
    """Whether kernel `name` is registered under `key` (its shape signature)."""
    with _lock:
        return (name, key) in _kernels


def register_custom_kernel(name: str, key: str, serialized_mlir_module: bytes | str) -> None:
    """Registers a module (jax.export's `mlir_module_serialized`, MLIR bytecode or text). A module
    the device's platform cannot run (a Mosaic TPU kernel on the CPU plugin) raises here."""
    if not isinstance(serialized_mlir_module, (bytes, bytearray, str)):
        raise TypeError(f"register_custom_kernel({name!r}): serialized_mlir_module must be bytes or str, "
                        f"got {type(serialized_mlir_module).__name__}")
    k = _foreign.register_module(f"pallas::{name}", serialized_mlir_module, _foreign.device_platform())
    with _lock:
        _kernels[(name, key)] = k


def call_custom_kernel(name: str, key: str, inputs: Sequence[torch.Tensor], output_shapes: Sequence[torch.Tensor],
                       donate_argnums: Sequence[int] | None = None,
                       input_output_aliases: Mapping[int, int] | None = None,
                       device_assignment: Any = None) -> list[torch.Tensor]:
    """Runs registered kernel (name, key) on tpu tensors `inputs`; `output_shapes` are tensors with
    each result's shape and dtype. Returns fresh result tensors (donation lets the kernel reuse
    the donated inputs' memory; the caller copies results into aliased buffers itself)."""
    with _lock:
        k = _kernels.get((name, key))
    if k is None:
        raise KeyError(f"call_custom_kernel: no kernel {name!r} registered under key {key!r}; "
                       "call register_custom_kernel first")
    op = f"pallas::{name}"
    inputs = list(inputs)
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.device.type != "tpu":
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: input {i} must be a tpu tensor, got {where}")
    if len(inputs) != len(k.in_types):
        raise ValueError(f"{op}: the kernel takes {len(k.in_types)} inputs, got {len(inputs)}")
    for i, (t, (elem, shape)) in enumerate(zip(inputs, k.in_types, strict=True)):
        if tuple(t.shape) != shape or _foreign.mlir_elem(t.dtype, op, f"input {i}") != elem:
            raise ValueError(f"{op}: input {i} is {t.dtype}{list(t.shape)}, the kernel was exported for "
                             f"{elem}{list(shape)}")
    if len(output_shapes) != len(k.out_types):
        raise ValueError(f"{op}: the kernel returns {len(k.out_types)} outputs, output_shapes lists "
                         f"{len(output_shapes)}")
    for i, (t, (_elem, shape), d) in enumerate(zip(output_shapes, k.out_types, k.out_dtypes(), strict=True)):
        if tuple(t.shape) != shape or t.dtype != d:
            raise ValueError(f"{op}: output {i} is {d}{list(shape)}, output_shapes gives "
                             f"{t.dtype}{list(t.shape)}")
    donated = list(donate_argnums if donate_argnums is not None else (input_output_aliases or {}).keys())
    for i in donated:
        if not 0 <= int(i) < len(inputs):
            raise ValueError(f"{op}: donated input index {i} is out of range for {len(inputs)} inputs")
    return list(torch.ops.torch_tpu.jax_call(inputs, k.key))
