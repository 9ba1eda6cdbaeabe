"""The two places where Hugging Face libraries name devices explicitly and know no tpu.

- `accelerate.utils.modeling.get_max_memory()` (behind `device_map="auto"/"balanced"/...`) asks
  each vendor module it knows (`torch.cuda`, `torch.npu`, ...) for free memory; with a tpu it
  would see no device and place every weight on the CPU. With no `max_memory` given and tpu the
  current accelerator, it reports `torch.tpu.mem_get_info(i)[0]` per chip (integer keys, as for
  CUDA) plus the CPU's free memory; everything else (`max_memory=...`, placement, dispatch) is
  Accelerate's own code.
- `safetensors.torch.load_file(path, device="tpu")` is refused by safetensors' Rust device parser
  (Diffusers' disk group offloading calls it); a tpu device loads on the CPU, then moves each tensor.

Both are wrapped only when (and if) the library is imported: an import hook patches the module
right after it executes, so `import torch_tpu` imports neither.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch


def _tpu_is_accelerator() -> bool:
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "tpu"


def _patch_accelerate(mod: ModuleType) -> None:
    orig = mod.get_max_memory

    @functools.wraps(orig)
    def get_max_memory(max_memory: dict[Any, Any] | None = None) -> dict[Any, Any]:
        if max_memory is not None or not _tpu_is_accelerator():
            return orig(max_memory)
        import psutil

        out: dict[Any, Any] = {i: int(torch.tpu.mem_get_info(i)[0]) for i in range(torch.tpu.device_count())}
        out["cpu"] = psutil.virtual_memory().available
        return out

    mod.get_max_memory = get_max_memory


def _is_tpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "tpu"
    return isinstance(device, str) and (device == "tpu" or device.startswith("tpu:"))


def _patch_safetensors(mod: ModuleType) -> None:
    orig = mod.load_file

    @functools.wraps(orig)
    def load_file(filename: Any, device: Any = "cpu", *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        if not _is_tpu(device):
            return orig(filename, device, *args, **kwargs)
        return {k: v.to(device) for k, v in orig(filename, "cpu", *args, **kwargs).items()}

    mod.load_file = load_file


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "accelerate.utils.modeling": _patch_accelerate,
    "safetensors.torch": _patch_safetensors,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


def install() -> None:
    for name, patch in _PATCHES.items():
        if name in sys.modules:  # imported before torch_tpu
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
