"""Cached small-op dispatch latency: tpu eager vs PyTorch CPU eager on a 100-element tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch_tpu
from bench_common import TPU, finish, fmt_ratio, interleaved, median, ratio, sync

NAME = "dispatch"
NUMEL = 100
ADD_ITERS = 20_000
MIXED_ITERS = 5_000  # 4 ops each: mul, add, relu, sum
WARMUP_ITERS = 200
REPEATS = 5
GOAL_MAX_RATIO = 2.0


def add_loop(device: str, iters: int) -> Callable[[], object]:
    x0 = torch.zeros(NUMEL, device=device)

    def loop() -> torch.Tensor:
        x = x0
        for _ in range(iters):
            x = x + 1
        if device == TPU:
            sync()
        return x

    return loop


def mixed_loop(device: str, iters: int) -> Callable[[], object]:
    x0 = torch.linspace(-1.0, 1.0, NUMEL, device=device)

    def loop() -> torch.Tensor:
        x, s = x0, x0
        for _ in range(iters):
            x = torch.relu(x * 0.5 + 1)  # stays bounded (fixed point 2)
            s = x.sum()
        if device == TPU:
            sync()
        return s

    return loop


def measure(
    make: Callable[[str, int], Callable[[], object]], iters: int, ops_per_iter: int
) -> dict[str, Any]:
    for device in (TPU, "cpu"):
        make(device, WARMUP_ITERS)()  # compiles once on tpu; warms caches on both
    before = torch_tpu.cache_stats()
    fb_before = sum(torch_tpu.fallback_stats().values())
    times = interleaved({TPU: make(TPU, iters), "cpu": make("cpu", iters)}, REPEATS)
    after = torch_tpu.cache_stats()
    n_ops = iters * ops_per_iter
    us = {dev: median(ts) / n_ops * 1e6 for dev, ts in times.items()}
    return {
        "iterations": iters,
        "ops": n_ops,
        "repeats": REPEATS,
        "tpu_us_per_op": us[TPU],
        "cpu_us_per_op": us["cpu"],
        "ratio_tpu_over_cpu": us[TPU] / us["cpu"],
        "tpu_times_s": times[TPU],
        "cpu_times_s": times["cpu"],
        "compile_misses_during_timing": after["misses"] - before["misses"],
        "op_hits_during_timing": after["op_hits"] - before["op_hits"],
        "cpu_fallbacks_during_timing": sum(torch_tpu.fallback_stats().values()) - fb_before,
    }


def run() -> dict[str, Any]:
    add = measure(add_loop, ADD_ITERS, 1)
    mixed = measure(mixed_loop, MIXED_ITERS, 4)
    ratios = [
        ratio("add", add["ratio_tpu_over_cpu"], GOAL_MAX_RATIO, higher_is_better=False),
        ratio("mixed", mixed["ratio_tpu_over_cpu"], GOAL_MAX_RATIO, higher_is_better=False),
    ]
    summary = (
        f"{NAME}: add {add['tpu_us_per_op']:.2f} vs cpu {add['cpu_us_per_op']:.2f} us/op, "
        f"mixed {mixed['tpu_us_per_op']:.2f} vs cpu {mixed['cpu_us_per_op']:.2f} us/op | tpu/cpu "
        + ", ".join(fmt_ratio(r) for r in ratios)
    )
    return finish(
        NAME,
        {
            "description": "x = x + 1 (numel 100) and relu(x*0.5+1).sum() loops; one synchronize per loop",
            "add": add,
            "mixed": mixed,
            "ratios": ratios,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    run()
