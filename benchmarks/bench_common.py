"""Shared helpers for the torch_tpu benchmarks: timing, machine info, result files, ratio records."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402  (loads torch_tpu through the torch.backends entry point)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TPU = "tpu"
# The small Llama of bench_dynamic_generate and bench_train_step (bench_compile has its own, larger one).
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, INTERMEDIATE = 256, 2, 4, 2, 4096, 688


def small_llama(max_positions: int) -> Any:
    """That Llama with seed-0 weights, on the CPU (transformers imported on first use)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, vocab_size=VOCAB, intermediate_size=INTERMEDIATE,
                                   max_position_embeddings=max_positions)
    return transformers.LlamaForCausalLM(cfg)


def sync() -> None:
    """Wait for every launched tpu op (the async eager queue) to finish."""
    torch.tpu.synchronize()  # type: ignore[attr-defined]


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: core counts, load, versions, thread settings."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }
    try:
        info["tpu_device"] = torch.tpu.get_device_name()  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - recorded, never fatal
        info["tpu_device"] = f"unavailable: {e}"
    return info


def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes (`fn` synchronizes itself when it needs to)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Time each fn `repeats` times, alternating between them so machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_call(fn))
    return times


# Untimed runs of the same fn before each timed one (steady()).
SETTLE_S = 0.03


def steady(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Like interleaved, but each timed run follows SETTLE_S of untimed runs of the same fn. Timed
    straight after another variant, a fn pays for that variant's threads: PyTorch CPU's OpenMP team
    spins ~20 ms after each parallel region, holding the second core (3-5x the time of the call
    after it at load 7), and XLA's Eigen threads spin briefly. Each variant is timed in its own
    steady state, as a model calling it layer after layer runs it."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            while True:
                fn()
                if time.perf_counter() - t0 >= SETTLE_S:
                    break
            times[name].append(time_call(fn))
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def ratio(name: str, value: float | None, goal: float | None, higher_is_better: bool) -> dict[str, Any]:
    """One ratio with its goal; `met` is None when it was not measured or has no goal."""
    met = None if value is None or goal is None else (value >= goal if higher_is_better else value <= goal)
    return {
        "name": name,
        "value": value,
        "goal": None if goal is None else f"{'>=' if higher_is_better else '<='} {goal:g}",
        "higher_is_better": higher_is_better,
        "met": met,
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write `results/<name>.json` atomically (tmp file + rename) and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def finish(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """Stamp machine info on a result, write it, print its one-line summary, and return it."""
    data = {"benchmark": name, "machine": machine_info(), **data}
    data["file"] = str(write_result(name, data).relative_to(RESULTS_DIR.parent.parent))
    print(data["summary"], flush=True)
    return data


def fmt_ratio(r: dict[str, Any]) -> str:
    if r["value"] is None:
        return f"{r['name']} n/a"
    if r["goal"] is None:
        return f"{r['name']} {r['value']:.2f}x"
    mark = "ok" if r["met"] else "MISS"
    return f"{r['name']} {r['value']:.2f}x (goal {r['goal']}x, {mark})"


def one_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` with PyTorch's CPU intra-op pool at one thread: on a loaded shared machine OpenMP's
    spinning threads can make the default setting several times slower."""

    def wrapped() -> Any:
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(prev)

    return wrapped
