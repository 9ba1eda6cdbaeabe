"""Cached small-op dispatch latency: tpu eager vs PyTorch CPU eager on a 100-element tensor, vs the
raw PJRT launch floor (a C++ loop launching + awaiting a cached 4-element add through csrc/pjrt,
measured in the same run), and fused eager's amortized cost per op on a 50 x (a * c + b) chain of
16-element tensors ending in .item(). Also ops with tensor-list arguments and random ops (cat of
two small tensors, _foreach_add_ over 8 tensors, dropout), which take the dispatch cache too;
`--list-rng` times only those, with the dispatch cache on and off in the same process, and
prints them (no JSON written). `--typed-ab` times add, mixed and the fused chain with the typed
(unboxed) kernels of the hottest ops on and off in the same process (csrc/aten/unboxed_kernels.h;
off, every call is boxed as before), and prints them (no JSON written)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch_tpu
from bench_common import TPU, finish, fmt_ratio, interleaved, median, ratio, sync
from torch_tpu import EagerMode, get_eager_mode, set_eager_mode

NAME = "dispatch"
NUMEL = 100
ADD_ITERS = 20_000
MIXED_ITERS = 5_000  # 4 ops each: mul, add, relu, sum
WARMUP_ITERS = 200
REPEATS = 5
GOAL_MAX_RATIO = 2.0
GOAL_MAX_OVER_FLOOR = 1.6  # strict dispatch of a cached small op vs the raw launch floor
FLOOR_ITERS = 20_000
CHAIN_LEN = 50
CHAIN_NUMEL = 16
CHAIN_ITERS = 200
GOAL_FUSED_CHAIN_OVER_CPU = 1.0
LIST_RNG_ITERS = 5_000


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


def chain_loop(device: str, iters: int) -> Callable[[], object]:
    """50 x (a * c + b) then .item(); on tpu under DEFER_AND_FUSE (one program per chain)."""
    a0 = torch.linspace(-1.0, 1.0, CHAIN_NUMEL, device=device)
    b = torch.full((CHAIN_NUMEL,), 0.25, device=device)
    c = torch.full((CHAIN_NUMEL,), 0.5, device=device)

    def loop() -> float:
        total = 0.0
        with set_eager_mode(EagerMode.DEFER_AND_FUSE if device == TPU else get_eager_mode()):
            for _ in range(iters):
                a = a0
                for _ in range(CHAIN_LEN):
                    a = a * c + b
                total += a.sum().item()
        return total

    return loop


def cat_loop(device: str, iters: int) -> Callable[[], object]:
    a, b = torch.ones(NUMEL // 2, device=device), torch.zeros(NUMEL // 2, device=device)

    def loop() -> torch.Tensor:
        for _ in range(iters):
            y = torch.cat([a, b])
        if device == TPU:
            sync()
        return y

    return loop


def foreach_loop(device: str, iters: int) -> Callable[[], object]:
    xs = [torch.zeros(NUMEL // 4, device=device) for _ in range(8)]
    ys = [torch.full((NUMEL // 4,), 1e-3, device=device) for _ in range(8)]

    def loop() -> list[torch.Tensor]:
        for _ in range(iters):
            torch._foreach_add_(xs, ys)
        if device == TPU:
            sync()
        return xs

    return loop


def dropout_loop(device: str, iters: int) -> Callable[[], object]:
    x = torch.ones(NUMEL, device=device)

    def loop() -> torch.Tensor:
        for _ in range(iters):
            y = torch.nn.functional.dropout(x, 0.25, True)
        if device == TPU:
            sync()
        return y

    return loop


def measure_list_rng() -> dict[str, dict[str, Any]]:
    return {name: measure(make, LIST_RNG_ITERS, 1)
            for name, make in (("cat", cat_loop), ("foreach_add_8", foreach_loop), ("dropout", dropout_loop))}


def list_rng_summary(results: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{name} {r['tpu_us_per_op']:.2f} vs cpu {r['cpu_us_per_op']:.2f} us/op "
                     f"(dispatch cache {r['dispatch_cache_hits_during_timing']}/{r['ops'] * REPEATS})"
                     for name, r in results.items())


def measure(
    make: Callable[[str, int], Callable[[], object]], iters: int, ops_per_iter: int
) -> dict[str, Any]:
    for device in (TPU, "cpu"):
        make(device, WARMUP_ITERS)()  # compiles once on tpu; warms caches on both
    before = torch_tpu.cache_stats()
    served_before = torch_tpu._C._dispatch_cache_stats()["hits"]
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
        "dispatch_cache_hits_during_timing": torch_tpu._C._dispatch_cache_stats()["hits"] - served_before,
        "cpu_fallbacks_during_timing": sum(torch_tpu.fallback_stats().values()) - fb_before,
    }


def run() -> dict[str, Any]:
    add = measure(add_loop, ADD_ITERS, 1)
    mixed = measure(mixed_loop, MIXED_ITERS, 4)
    floor_us = median([torch_tpu._C._raw_launch_floor_us(FLOOR_ITERS) for _ in range(REPEATS)])
    # ops per chain: 2 per step + the sum (the .item() read is the sync)
    chain = measure(chain_loop, CHAIN_ITERS, 2 * CHAIN_LEN + 1)
    list_rng = measure_list_rng()
    ratios = [
        ratio("add", add["ratio_tpu_over_cpu"], GOAL_MAX_RATIO, higher_is_better=False),
        ratio("mixed", mixed["ratio_tpu_over_cpu"], GOAL_MAX_RATIO, higher_is_better=False),
        ratio("add/raw launch floor", add["tpu_us_per_op"] / floor_us, GOAL_MAX_OVER_FLOOR, higher_is_better=False),
        ratio("fused chain/cpu", chain["ratio_tpu_over_cpu"], GOAL_FUSED_CHAIN_OVER_CPU, higher_is_better=False),
    ]
    summary = (
        f"{NAME}: add {add['tpu_us_per_op']:.2f} vs cpu {add['cpu_us_per_op']:.2f} us/op, "
        f"mixed {mixed['tpu_us_per_op']:.2f} vs cpu {mixed['cpu_us_per_op']:.2f} us/op, "
        f"raw launch floor {floor_us:.2f} us, fused chain {chain['tpu_us_per_op']:.2f} vs cpu "
        f"{chain['cpu_us_per_op']:.2f} us/op, {list_rng_summary(list_rng)} | "
        + ", ".join(fmt_ratio(r) for r in ratios)
    )
    return finish(
        NAME,
        {
            "description": "x = x + 1 (numel 100) and relu(x*0.5+1).sum() loops; one synchronize per loop",
            "add": add,
            "mixed": mixed,
            "raw_launch_floor_us": floor_us,
            "fused_chain": chain,
            "list_and_random_ops": list_rng,
            "ratios": ratios,
            "summary": summary,
        },
    )


def typed_ab() -> None:
    for on in (True, False, True, False):
        torch.ops.torch_tpu._set_unboxed_fast_path(on)
        add, mixed = measure(add_loop, ADD_ITERS, 1), measure(mixed_loop, MIXED_ITERS, 4)
        chain = measure(chain_loop, CHAIN_ITERS, 2 * CHAIN_LEN + 1)
        served, boxed, _ = torch.ops.torch_tpu._unboxed_stats()
        print(f"{NAME} typed kernels {'on ' if on else 'off'}: add {add['tpu_us_per_op']:.2f} vs cpu "
              f"{add['cpu_us_per_op']:.2f}, mixed {mixed['tpu_us_per_op']:.2f} vs cpu {mixed['cpu_us_per_op']:.2f}, "
              f"fused chain {chain['tpu_us_per_op']:.2f} vs cpu {chain['cpu_us_per_op']:.2f} us/op "
              f"(typed calls so far: {served} served, {boxed} boxed)", flush=True)
    torch.ops.torch_tpu._set_unboxed_fast_path(True)


if __name__ == "__main__":
    if "--typed-ab" in sys.argv:
        typed_ab()
    elif "--list-rng" in sys.argv:
        for on in (True, False, True, False):
            torch_tpu._C._set_dispatch_cache_enabled(on)
            print(f"{NAME} list/random ops, dispatch cache {'on ' if on else 'off'}: "
                  f"{list_rng_summary(measure_list_rng())}", flush=True)
        torch_tpu._C._set_dispatch_cache_enabled(True)
    else:
        run()
