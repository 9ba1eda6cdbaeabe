"""`nn.Module.to("tpu")` / `.cpu()` / `.tpu()` that keep parameter identity (and so weight tying).

PyTorch moves a parameter in place (`param.data = moved`) only between backends listed in
`_has_compatible_shallow_copy_type` (CPU, CUDA, MPS, ...; not PrivateUse1). For a tpu move it
creates a new Parameter per module instead, which silently unties shared weights (GPT-2's LM head
and embedding would train as two tensors) and leaves optimizers built before the move pointing at
stale parameters. Swapping tensors in place keeps every Parameter object, as CUDA does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_installed = False


def _touches_tpu(module: torch.nn.Module, target: torch.device | None) -> bool:
    if target is not None and target.type == "tpu":
        return True
    if target is None:
        return False
    for t in module.parameters():
        return t.device.type == "tpu" and target.type != "tpu"
    for t in module.buffers():
        return t.device.type == "tpu" and target.type != "tpu"
    return False


def _holders(module: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    out: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, name))
    return out


def _move_keeping_identity(module: torch.nn.Module, move: Callable[[], Any]) -> Any:
    fut = torch.__future__
    if fut.get_swap_module_params_on_conversion():
        return move()  # already swapping (nested call, or the user opted in globally)
    shared = {k: v for k, v in _holders(module).items() if len(v) > 1}
    fut.set_swap_module_params_on_conversion(True)
    try:
        return move()
    except RuntimeError as e:
        # swap_tensors refuses a parameter with weakrefs or extra references: move the plain
        # way (new Parameters) and re-tie what was shared before.
        if "swap" not in str(e).lower():
            raise
        fut.set_swap_module_params_on_conversion(False)
        result = move()
        for group in shared.values():
            first_mod, first_name = group[0]
            for mod, name in group[1:]:
                mod._parameters[name] = first_mod._parameters[first_name]
        return result
    finally:
        fut.set_swap_module_params_on_conversion(False)


def install() -> None:
    """Wraps nn.Module.to/cpu/tpu once (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    cls = torch.nn.Module
    orig_to = cls.to

    @functools.wraps(orig_to)
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if not _touches_tpu(self, device):
            return orig_to(self, *args, **kwargs)
        return _move_keeping_identity(self, lambda: orig_to(self, *args, **kwargs))

    cls.to = to  # type: ignore[method-assign]

    orig_cpu = cls.cpu

    @functools.wraps(orig_cpu)
    def cpu(self: torch.nn.Module) -> Any:
        if not _touches_tpu(self, torch.device("cpu")):
            return orig_cpu(self)
        return _move_keeping_identity(self, lambda: orig_cpu(self))

    cls.cpu = cpu  # type: ignore[method-assign]

    orig_tpu = getattr(cls, "tpu", None)
    if orig_tpu is not None:
        @functools.wraps(orig_tpu)
        def tpu(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _move_keeping_identity(self, lambda: orig_tpu(self, *args, **kwargs))

        cls.tpu = tpu  # type: ignore[attr-defined]
