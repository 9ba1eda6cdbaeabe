"""Finds the PJRT plugin: TORCH_TPU_PJRT_PLUGIN, then libtpu on a TPU host, then xla-cpu-pjrt."""

from __future__ import annotations

import glob
import importlib.util
import os


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _tpu_present() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def find_plugin() -> tuple[str, str]:
    """Returns (path, how it was found). Raises RuntimeError naming what to install or set."""
    env = os.environ.get("TORCH_TPU_PJRT_PLUGIN")
    if env:
        if not os.path.isfile(env):
            raise RuntimeError(
                f"TORCH_TPU_PJRT_PLUGIN={env!r} does not name a file; point it at a PJRT plugin "
                "shared library (e.g. .../xla_cpu_pjrt.so) or unset it"
            )
        return env, "TORCH_TPU_PJRT_PLUGIN"
    libtpu = _package_dir("libtpu")
    if libtpu and _tpu_present():
        path = os.path.join(libtpu, "libtpu.so")
        if os.path.isfile(path):
            return path, "libtpu"
    cpu = _package_dir("xla_plugins.xla_cpu_pjrt")
    if cpu:
        path = os.path.join(cpu, "xla_cpu_pjrt.so")
        if os.path.isfile(path):
            return path, "xla-cpu-pjrt"
    raise RuntimeError(
        "torch_tpu found no PJRT plugin: `pip install xla-cpu-pjrt==0.0.1` (CPU, emulated chips), "
        "`pip install libtpu` on a TPU VM, or set TORCH_TPU_PJRT_PLUGIN=/path/to/plugin.so"
    )


def num_devices() -> int:
    raw = os.environ.get("TORCH_TPU_NUM_DEVICES", "1")
    try:
        n = int(raw)
    except ValueError:
        raise RuntimeError(f"TORCH_TPU_NUM_DEVICES must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise RuntimeError(f"TORCH_TPU_NUM_DEVICES must be a positive integer, got {n}")
    return n


def bind_process_chip(how: str) -> None:
    """Under torchrun-style launches (LOCAL_RANK, LOCAL_WORLD_SIZE > 1) each process owns one chip,
    seen as tpu:0. The CPU plugin already gives every process its own client (one device unless
    TORCH_TPU_NUM_DEVICES says otherwise); on a TPU host libtpu is told, before its client
    starts, to expose only chip LOCAL_RANK as a one-chip slice (the libtpu environment variables
    JAX and torch_xla use for one process per chip). Settings the user made are kept.
    Not exercised on this CPU-only CI; see docs/distributed.md."""
    local, local_world = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if how != "libtpu" or local is None or local_world is None or int(local_world) <= 1:
        return
    os.environ.setdefault("TPU_VISIBLE_CHIPS", local)
    os.environ.setdefault("TPU_CHIPS_PER_PROCESS_BOUNDS", "1,1,1")
    os.environ.setdefault("TPU_PROCESS_BOUNDS", "1,1,1")
    os.environ.setdefault("TPU_PROCESS_PORT", str(8476 + int(local)))
