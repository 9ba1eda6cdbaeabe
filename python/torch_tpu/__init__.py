"""torch_tpu: PyTorch on TPUs (and any PJRT device), eager by default.

`import torch` loads this package through the `torch.backends` entry point (set
TORCH_DEVICE_BACKEND_AUTOLOAD=0 to opt out); `import torch_tpu` works as well.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

__all__ = [
    "EagerMode",
    "explain",
    "mark_dynamic",
    "cache_stats",
    "compile_stats",
    "dispatch_stats",
    "fallback_stats",
    "reset_cache_stats",
    "reset_fallback_stats",
    "set_eager_mode",
    "get_eager_mode",
    "synchronize",
]

_loaded = False
_state: dict[str, Any] = {}


def _configure_plugin() -> None:
    from torch_tpu import _C, _plugin

    try:
        path, how = _plugin.find_plugin()
        _plugin.bind_process_chip(how)
    except RuntimeError as e:
        # Keep `import torch` working; the first tpu op raises, naming the path it tried.
        _C._configure(os.environ.get("TORCH_TPU_PJRT_PLUGIN", ""), _plugin.num_devices())
        _state["plugin_error"] = str(e)
        return
    _C._configure(path, _plugin.num_devices())



def _lazy_module(name: str) -> types.ModuleType:
    """`name` registered in sys.modules, executed when an attribute is first read."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)  # as the import system does for a loaded submodule
    return module


def _autoload() -> None:
    """Entry point called by `import torch` (and by `import torch_tpu`). Idempotent.

    Defined before this module imports torch: `import torch_tpu` first imports torch, whose
    autoload re-enters this (partially initialised) module and calls _autoload.
    """
    global _loaded
    if _loaded:
        return
    _loaded = True
    import torch as _torch  # local: this runs before the module-level `import torch`

    from torch_tpu import _C

    _configure_plugin()
    # Same step: C++ PrivateUse1 hooks, then the rename (torch.accelerator needs both).
    _C._register()
    _torch.utils.rename_privateuse1_backend("tpu")
    from torch_tpu import device as device_module

    _torch._register_device_module("tpu", device_module)
    _torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    backends = types.ModuleType("torch.backends.tpu")
    backends.is_available = device_module.is_available  # type: ignore[attr-defined]
    backends.is_built = lambda: True  # type: ignore[attr-defined]
    _torch.backends.tpu = backends  # type: ignore[attr-defined]
    sys.modules["torch.backends.tpu"] = backends

    # torch.tpu.pallas / torch.tpu.ops: loaded on first attribute access (neither imports JAX).
    for sub_name in ("pallas", "ops"):
        sub = _lazy_module(f"torch_tpu.{sub_name}")
        setattr(device_module, sub_name, sub)
        sys.modules[f"torch.tpu.{sub_name}"] = sub

    from torch_tpu._internal import compile as tpu_compile
    from torch_tpu._internal import execution_mode, integrations, meta_kernels, progress

    integrations.install()
    meta_kernels.install()
    progress.install()

    tpu_compile.install_default_backend_routing()
    execution_mode._init_from_env()
    # A fused-eager program is a whole program like a compiled graph: the same default XLA
    # options (512-bit vectors on AVX-512 hosts; docs/compile.md "Default options").
    from torch_tpu._internal import xla_options

    _C._set_fused_program_options(xla_options.encode(tpu_compile.graph_defaults()))

    # c10d backends "tpu_dist"/"tpu": cheap (torch.distributed is already imported by torch).
    if _torch.distributed.is_available():
        from torch_tpu.distributed import _backend as dist_backend

        dist_backend.register()
        import torch_tpu.distributed as tpu_distributed

        device_module.distributed = tpu_distributed  # type: ignore[attr-defined]
        sys.modules["torch.tpu.distributed"] = tpu_distributed


_autoload()

from torch_tpu import _C  # noqa: E402
from torch_tpu._internal.execution_mode import EagerMode, get_eager_mode, set_eager_mode  # noqa: E402
from torch_tpu._internal.explain import explain  # noqa: E402


def synchronize() -> None:
    _C._synchronize()


def cache_stats() -> dict[str, Any]:
    """Compile-cache counters: op-signature hits, program memory/disk hits, misses, compile ms."""
    return dict(_C._cache_stats())


def reset_cache_stats() -> None:
    _C._reset_cache_stats()
    dynamic = sys.modules.get("torch_tpu._internal.dynamic_shapes")
    if dynamic is not None:  # explain()'s bucket list restarts with the compile log
        dynamic.BUCKETS.clear()
    eager = sys.modules.get("torch_tpu._internal.eager_dynamic")
    if eager is not None:
        eager.reset_stats()


def mark_dynamic(tensor: Any, dim: int, *, min: int | None = None, max: int | None = None) -> Any:  # noqa: A002
    """Eager bounded dynamism (the TPU reference's eager API): `dim` of a tpu tensor becomes
    dynamic, so eager ops (strict and fused) build one program per size bucket (powers of two
    >= 16, at most `max`) instead of one per size; results along that dim stay dynamic. One
    dynamic dim per tensor; marks in place and returns the tensor (docs/compile.md)."""
    from torch_tpu._internal.eager_dynamic import mark_dynamic as mark

    return mark(tensor, dim, min=min, max=max)


def fallback_stats() -> dict[str, int]:
    """Calls per ATen op that ran on the CPU fallback (empty when everything was lowered)."""
    return dict(_C._fallback_stats())


def fallback_reasons() -> dict[str, str]:
    return dict(_C._fallback_reasons())


def reset_fallback_stats() -> None:
    _C._reset_fallback_stats()


def dispatch_stats() -> dict[str, int]:
    """Lowered op launches and device->host reads (host syncs) so far."""
    return dict(_C._dispatch_stats())


def lowered_ops() -> list[str]:
    return list(_C._lowered_ops())


def compile_stats() -> dict[str, Any]:
    """What the torch.compile backend did: FX graphs received, XLA programs built, graphs split
    into compiled pieces around eager nodes (and those nodes), graphs run op by op, graphs served
    by PyTorch's AOTAutogradCache (`aot_cache_hits`), the graph rewrites made before lowering
    (`ungrouped_kv`: HF repeat_kv copies of K/V no longer fed to the fused attention op;
    `cache_writes_at_offset`: static KV cache writes `index_copy` at `arange(n) + offset` turned
    into one dynamic_update_slice each), and `graph_tiers`: per program built, which
    tier served it ({"graph", "aot": "traced" | "aot_cache" | "reused", "xla": "xla_compiled" |
    "xla_disk" | "xla_memory"}; "reused": a graph built again for another contraction precision),
    and `dynamic`: per program built for a graph with symbolic sizes, the bucket it serves
    ({"graph", "kind": "padded" | "exact", "bucket": {symbol: size}, "reason", "program"};
    docs/compile.md, "Bounded dynamic shapes")."""
    from torch_tpu._internal import compile as tpu_compile
    from torch_tpu._internal import dynamic_shapes

    eager = sys.modules.get("torch_tpu._internal.eager_dynamic")
    return {**tpu_compile.STATS, "graph_tiers": [dict(t) for t in tpu_compile.GRAPH_TIERS],
            "dynamic": [dict(b) for b in dynamic_shapes.BUCKETS],
            "eager_dynamic": eager.stats() if eager is not None else {}}
