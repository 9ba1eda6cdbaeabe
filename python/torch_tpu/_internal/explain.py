"""`torch_tpu.explain()`: every program the runtime had to build, why, and what it cost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_tpu import _C


@dataclass
class CompileRecord:
    op: str          # ATen op or compiled graph that needed the program
    reason: str      # first call / which input changed (old -> new) / new graph
    source: str      # "compile" (XLA ran), "disk" or "memory" (cache hit)
    ms: float


@dataclass
class Explanation:
    compiles: list[CompileRecord] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    dispatch: dict[str, int] = field(default_factory=dict)
    # Programs built for compiled graphs with symbolic sizes: the bucket each serves
    # (torch_tpu._internal.dynamic_shapes.BUCKETS).
    buckets: list[dict[str, Any]] = field(default_factory=list)
    # Eager bounded dynamism (torch_tpu.mark_dynamic): bucketed calls, gathers, declines and why.
    eager_dynamic: dict[str, Any] = field(default_factory=dict)

    @property
    def recompiles(self) -> list[CompileRecord]:
        """Programs built for an op that already had one (a shape or dtype changed)."""
        return [c for c in self.compiles if not c.reason.startswith("first call")]

    def __str__(self) -> str:
        c = self.cache
        lines = [
            f"torch_tpu: {len(self.compiles)} programs built: {c.get('misses', 0)} compiled by XLA "
            f"({c.get('compile_ms', 0.0):.0f} ms), {c.get('disk_hits', 0)} loaded from disk "
            f"({c.get('disk_load_ms', 0.0):.0f} ms), {c.get('memory_hits', 0)} found in memory; "
            f"{c.get('op_hits', 0)} dispatches reused a program",
        ]
        for r in self.compiles:
            lines.append(f"  [{r.source:7s} {r.ms:8.1f} ms] {r.op}: {r.reason}")
        if self.buckets:
            lines.append("dynamic-shape programs (bucket each serves):")
            for bk in self.buckets:  # the name carries the bucket: s<=B padded, s=v exact
                why = f" ({bk['reason']})" if bk["reason"] else ""
                lines.append(f"  {bk['graph']}: {bk['kind']}{why}")
        ed = self.eager_dynamic
        if ed and (ed.get("bucketed_calls") or ed.get("declined_calls")):
            lines.append(f"eager dynamic (mark_dynamic): {ed['bucketed_calls']} bucketed calls "
                         f"({ed.get('fast_calls', 0)} from the C++ fast path; programs named "
                         f"eager.<op>[s<=bucket] above), {ed['gathers']} runtime-offset reads, "
                         f"{ed['declined_calls']} calls ran at their exact size:")
            for op, why in ed.get("declined", {}).items():
                lines.append(f"  {op}: {why}")
        if self.fallbacks:
            lines.append("CPU fallbacks:")
            for op, n in sorted(self.fallbacks.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {n:6d} x {op}: {self.fallback_reasons.get(op, '')}")
        else:
            lines.append("CPU fallbacks: none")
        lines.append(f"host syncs: {self.dispatch.get('host_syncs', 0)}, launches: {self.dispatch.get('launches', 0)}")
        return "\n".join(lines)


def _buckets() -> list[dict[str, Any]]:
    import sys

    mod = sys.modules.get("torch_tpu._internal.dynamic_shapes")  # loaded with the compile backend
    return [dict(b) for b in mod.BUCKETS] if mod is not None else []


def _eager_dynamic() -> dict[str, Any]:
    import sys

    mod = sys.modules.get("torch_tpu._internal.eager_dynamic")  # loaded by torch_tpu.mark_dynamic
    return mod.stats() if mod is not None else {}


def explain(print_result: bool = True) -> Explanation:
    """Returns (and by default prints) the compile log since start or the last reset_cache_stats()."""
    e = Explanation(
        compiles=[CompileRecord(*ev) for ev in _C._compile_events()],
        cache=dict(_C._cache_stats()),
        fallbacks=dict(_C._fallback_stats()),
        fallback_reasons=dict(_C._fallback_reasons()),
        dispatch=dict(_C._dispatch_stats()),
        buckets=_buckets(),
        eager_dynamic=_eager_dynamic(),
    )
    if print_result:
        print(e)
    return e
