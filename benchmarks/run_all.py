"""Run every torch_tpu benchmark (`make bench`): each writes benchmarks/results/<name>.json and prints
a one-line ratio summary; this script writes benchmarks/results/summary.json with all ratios."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench_* modules sit next to this file

from bench_common import machine_info, write_result  # noqa: E402

# Order: cheap first; cold_warm last (it spawns its own processes).
BENCHMARKS = {
    "dispatch": "bench_dispatch",
    "gemm": "bench_gemm",
    "minilm": "bench_minilm",
    "models_diffusers": "bench_models_diffusers",
    "compile": "bench_compile",
    "train_step": "bench_train_step",
    "dynamic_generate": "bench_dynamic_generate",
    "fused": "bench_fused",
    "grouped_mm": "bench_grouped_mm",
    "models_hf": "bench_models_hf",
    "distributed": "bench_distributed",
    "cold_warm": "bench_cold_warm",
}


def run_one(name: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        result = importlib.import_module(BENCHMARKS[name]).run()
    except Exception as e:  # noqa: BLE001 - one failing benchmark must not hide the others
        traceback.print_exc()
        print(f"{name}: FAILED: {e!r}", flush=True)
        return {"error": repr(e), "seconds": time.perf_counter() - t0}
    return {
        "seconds": time.perf_counter() - t0,
        "file": result["file"],
        "summary": result["summary"],
        "ratios": result["ratios"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "names", nargs="*", help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: all)"
    )
    names = parser.parse_args().names or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")  # noqa: UP017 - explicit on purpose
    t0 = time.perf_counter()
    machine = machine_info()
    print(
        f"torch {machine['torch_version']}, {machine['cpu_count']} CPUs (load {machine['loadavg_1m']:.1f}), "
        f"tpu = {machine['tpu_device']}",
        flush=True,
    )
    results = {name: run_one(name) for name in names}
    ratios = [r for res in results.values() for r in res.get("ratios", [])]
    summary = {
        "started": started,
        "total_s": time.perf_counter() - t0,
        "machine": machine,
        "benchmarks": results,
        "goals_met": sum(1 for r in ratios if r["met"] is True),
        "goals_missed": sum(1 for r in ratios if r["met"] is False),
        "errors": [name for name, res in results.items() if "error" in res],
    }
    path = write_result("summary", summary)
    print(
        f"total {summary['total_s']:.0f} s: {summary['goals_met']} goals met, {summary['goals_missed']} missed, "
        f"{len(summary['errors'])} errors -> {path}",
        flush=True,
    )
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
