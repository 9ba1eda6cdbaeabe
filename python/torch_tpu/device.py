"""`torch.tpu`: the device module PyTorch and Hugging Face libraries look up by device name."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu import _C, compiler, optimizers  # noqa: F401 (torch.tpu.compiler, torch.tpu.optimizers)
from torch_tpu.precision import Precision, get_precision, precision  # noqa: F401 (torch.tpu.precision)

_initialized = False
_DeviceLike = int | str | torch.device | None


def _index(device: _DeviceLike = None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "tpu":
        raise ValueError(f"expected a tpu device, got {d}")
    return d.index if d.index is not None else current_device()


def is_available() -> bool:
    try:
        return _C._device_count() > 0
    except RuntimeError:
        return False


def device_count() -> int:
    try:
        return _C._device_count()
    except RuntimeError:
        return 0


def is_initialized() -> bool:
    return _initialized


def _lazy_init() -> None:
    global _initialized
    _C._init()
    _initialized = True


def init() -> None:
    _lazy_init()


def current_device() -> int:
    return torch._C._accelerator_getDeviceIndex() if _accel_is_tpu() else 0


def _accel_is_tpu() -> bool:
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "tpu"


def _process_chip(idx: int) -> int:
    """Under torchrun each process owns one chip, seen as tpu:0: launchers and DeviceMesh call
    set_device(LOCAL_RANK), which names that same chip."""
    local = os.environ.get("LOCAL_RANK")
    if local is not None and idx == int(local) and idx > 0 and device_count() == 1:
        return 0
    return idx


def set_device(device: _DeviceLike) -> None:
    idx = _index(device)
    if idx < 0:
        return
    idx = _process_chip(idx)
    _lazy_init()
    torch.accelerator.set_device_index(idx)


class device:  # noqa: N801 - same spelling as torch.cuda.device
    """Context manager that makes `device` the current tpu device."""

    def __init__(self, device: _DeviceLike) -> None:
        self.idx = _index(device) if device is not None else -1
        self.prev = -1

    def __enter__(self) -> device:
        if self.idx >= 0:
            self.prev = current_device()
            set_device(self.idx)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.idx >= 0:
            set_device(self.prev)


def synchronize(device: _DeviceLike = None) -> None:
    _C._synchronize()


def get_device_name(device: _DeviceLike = None) -> str:
    p = _C._platform()
    info = _C._device_info(_index(device))
    return f"{info['kind']} ({p['platform_name']} via PJRT {p['pjrt_api_version']})"


@dataclass(frozen=True)
class _DeviceProperties:
    name: str
    platform_name: str
    platform_version: str
    pjrt_api_version: str
    plugin_path: str
    id: int
    total_memory: int


def get_device_properties(device: _DeviceLike = None) -> _DeviceProperties:
    idx = _index(device)
    p = _C._platform()
    info = _C._device_info(idx)
    return _DeviceProperties(
        name=get_device_name(idx),
        platform_name=p["platform_name"],
        platform_version=p["platform_version"],
        pjrt_api_version=p["pjrt_api_version"],
        plugin_path=p["plugin_path"],
        id=info["id"],
        total_memory=_C._mem_get_info(idx)[1],
    )


def get_device_capability(device: _DeviceLike = None) -> tuple[int, int]:
    return (0, 0)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- RNG
def manual_seed(seed: int) -> None:
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    _C._manual_seed(current_device(), seed)


def manual_seed_all(seed: int) -> None:
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    for i in range(max(device_count(), 1)):
        _C._manual_seed(i, seed)


def seed() -> None:
    _C._seed(current_device())


def seed_all() -> None:
    s = _C._seed(0)
    for i in range(1, device_count()):
        _C._manual_seed(i, s)


def initial_seed() -> int:
    return _C._initial_seed(current_device())


def get_rng_state(device: _DeviceLike = "tpu") -> torch.Tensor:
    raw = _C._get_rng_state(_index(device))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def set_rng_state(new_state: torch.Tensor, device: _DeviceLike = "tpu") -> None:
    data = new_state.detach().to("cpu", torch.uint8).contiguous()
    _C._set_rng_state(_index(device), bytes(data.numpy().tobytes()))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, s in enumerate(new_states):
        set_rng_state(s, i)


_in_bad_fork = False


def _after_fork_in_child() -> None:
    global _in_bad_fork
    if _C._initialized():  # the parent's PJRT client does not survive fork (C++ raises on use)
        _in_bad_fork = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _is_in_bad_fork() -> bool:
    return _in_bad_fork


# ---------------------------------------------------------------- memory
def memory_stats(device: _DeviceLike = None) -> dict[str, Any]:
    return torch.accelerator.memory_stats(_index(device))


def memory_allocated(device: _DeviceLike = None) -> int:
    return torch.accelerator.memory_allocated(_index(device))


def max_memory_allocated(device: _DeviceLike = None) -> int:
    return torch.accelerator.max_memory_allocated(_index(device))


def memory_reserved(device: _DeviceLike = None) -> int:
    return torch.accelerator.memory_reserved(_index(device))


def max_memory_reserved(device: _DeviceLike = None) -> int:
    return torch.accelerator.max_memory_reserved(_index(device))


def reset_peak_memory_stats(device: _DeviceLike = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: _DeviceLike = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


def mem_get_info(device: _DeviceLike = None) -> tuple[int, int]:
    return tuple(_C._mem_get_info(_index(device)))  # type: ignore[return-value]


def memory_summary(device: _DeviceLike = None, abbreviated: bool = False) -> str:
    """A readable table of the allocator's statistics, like `torch.cuda.memory_summary()`."""
    idx = _index(device)
    stats = memory_stats(idx)
    free, total = mem_get_info(idx)

    def size(n: int) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if abs(n) < 1024 or unit == "GiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
            n /= 1024  # type: ignore[assignment]
        return str(n)

    rows = [("Allocated memory", "allocated_bytes", size), ("Active memory", "active_bytes", size),
            ("Requested memory", "requested_bytes", size), ("Allocations", "allocation", str),
            ("Active allocs", "active", str)]
    line = "=" * 79
    out = [line, f" torch_tpu memory summary, device tpu:{idx} ({get_device_name(idx)})".ljust(79), line,
           f" {'Metric':<25}| {'Cur Usage':>11} | {'Peak Usage':>11} | {'Tot Alloc':>11} | {'Tot Freed':>9}",
           "-" * 79]
    for label, key, fmt in rows:
        v = {k: int(stats.get(f"{key}.all.{k}", 0)) for k in ("current", "peak", "allocated", "freed")}
        out.append(f" {label:<25}| {fmt(v['current']):>11} | {fmt(v['peak']):>11} | "
                   f"{fmt(v['allocated']):>11} | {fmt(v['freed']):>9}")
    out += ["-" * 79, f" Device capacity: {size(total)}   free: {size(free)}   "
            f"OOMs: {int(stats.get('num_ooms', 0))}", line]
    return "\n".join(out) + "\n"


def empty_cache() -> None:
    """Device buffers are freed as soon as their tensors die; on XLA:CPU the process keeps the freed
    host memory for reuse (csrc/pjrt/pjrt.cc), and this returns it to the system."""
    torch.accelerator.empty_cache()


# ---------------------------------------------------------------- streams / events
class Stream:
    """The single in-order stream of a tpu device (PJRT orders work by data dependencies)."""

    def __init__(self, device: _DeviceLike = None, priority: int = 0) -> None:
        self.device = torch.device("tpu", _index(device))

    def synchronize(self) -> None:
        synchronize()

    def query(self) -> bool:
        """Whether all work launched on the device has finished; never waits (the guard's
        queryStream, as torch.Stream.query)."""
        return torch.Stream(device=self.device).query()

    def wait_stream(self, stream: Stream) -> None:
        return None

    def wait_event(self, event: Event) -> None:
        return None

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._recorded = False
        self._timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._recorded = True
        if self._timing:  # the host clock once the work launched so far is done (one in-order stream)
            synchronize()
            self._time = time.perf_counter()

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event and `end_event` (both recorded with enable_timing=True)."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True and recorded")
        return (end_event._time - self._time) * 1000.0

    def synchronize(self) -> None:
        synchronize()

    def query(self) -> bool:
        """Whether the work recorded so far has finished (a recorded event marks everything
        launched); never waits."""
        return torch.Stream(device="tpu").query()

    def wait(self, stream: Stream | None = None) -> None:
        return None


def current_stream(device: _DeviceLike = None) -> Stream:
    return Stream(device)


def default_stream(device: _DeviceLike = None) -> Stream:
    return Stream(device)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    yield


def set_stream(s: Stream) -> None:
    """One in-order stream per device: nothing to switch."""


def device_of(obj: Any) -> device:
    """Context manager making `obj`'s device current when it is a tpu tensor (as torch.cuda.device_of)."""
    return device(obj.get_device() if isinstance(obj, torch.Tensor) and obj.device.type == "tpu" else None)


# Eager modes as the TPU reference spells them on torch.tpu: EagerMode, set_eager_mode(mode)
# (a call or a context manager), get_eager_mode() and the settable property torch.tpu.eager_mode.
from torch_tpu._internal.execution_mode import EagerMode, get_eager_mode, set_eager_mode  # noqa: E402, F401


class _DeviceModule(types.ModuleType):
    @property
    def eager_mode(self) -> EagerMode:
        return get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        set_eager_mode(mode)


sys.modules[__name__].__class__ = _DeviceModule
