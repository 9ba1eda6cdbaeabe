"""Square matmul throughput: `a @ b` on tpu vs `torch.mm` on the CPU, float32 and bfloat16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bench_common import TPU, finish, fmt_ratio, interleaved, median, ratio, sync, time_call

NAME = "gemm"
SIZES = (1024, 2048)
DTYPES = (torch.float32, torch.bfloat16)
REPEATS = 5
TARGET_REPEAT_S = 0.4  # iterations per repeat are chosen so one repeat takes about this long
MIN_ITERS = 2
MAX_ITERS = 50
CPU_BUDGET_S = 30.0  # skip a CPU baseline whose estimated total time exceeds this
GOAL_MIN_RATIO = 0.9


def gflops(n: int, seconds: float) -> float:
    return 2.0 * n**3 / seconds / 1e9


def batch_fn(mm: Callable[[], torch.Tensor], iters: int, on_tpu: bool) -> Callable[[], object]:
    def loop() -> torch.Tensor:
        c = mm()
        for _ in range(iters - 1):
            c = mm()
        if on_tpu:
            sync()
        return c

    return loop


def iters_for(single_s: float) -> int:
    """Calls per repeat so that one repeat takes about TARGET_REPEAT_S (at least MIN_ITERS)."""
    return max(MIN_ITERS, min(MAX_ITERS, int(TARGET_REPEAT_S / max(single_s, 1e-9))))


def side(iters: int, times: list[float]) -> dict[str, Any]:
    per_call = [t / iters for t in times]
    return {"iterations": iters, "repeats": len(times), "s_per_call": median(per_call), "times_s": per_call}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def one_case(n: int, dtype: torch.dtype, cpu_est_s: float | None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    a_cpu = torch.randn(n, n, generator=g).to(dtype)
    b_cpu = torch.randn(n, n, generator=g).to(dtype)
    a, b = a_cpu.to(TPU), b_cpu.to(TPU)

    def tpu_mm() -> torch.Tensor:
        return a @ b

    def cpu_mm() -> torch.Tensor:
        return torch.mm(a_cpu, b_cpu)

    first = time_call(lambda: (tpu_mm(), sync()))  # compiles (or loads from the cache)
    single = time_call(lambda: (tpu_mm(), sync()))
    ref = torch.mm(a_cpu.float(), b_cpu.float())
    case: dict[str, Any] = {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "tpu_first_call_s": first,
        "tpu_rel_err_vs_cpu_f32": rel_err(tpu_mm().cpu(), ref),
    }
    tpu_iters = iters_for(single)
    fns: dict[str, Callable[[], object]] = {TPU: batch_fn(tpu_mm, tpu_iters, on_tpu=True)}
    cpu_times: list[float] = []
    cpu_iters = 0
    if cpu_est_s is not None and cpu_est_s > CPU_BUDGET_S:
        case["cpu"] = {
            "skipped": f"estimated {cpu_est_s:.1f} s per call, over the {CPU_BUDGET_S:.0f} s budget"
        }
    else:
        cpu_single = time_call(cpu_mm)  # warm-up call, also the estimate for the loop
        if cpu_single * MIN_ITERS * REPEATS > CPU_BUDGET_S:
            cpu_iters, cpu_times = 1, [cpu_single]  # slow baseline: that one call is the measurement
        else:
            cpu_iters = iters_for(cpu_single)
            fns["cpu"] = batch_fn(cpu_mm, cpu_iters, on_tpu=False)
    times = interleaved(fns, REPEATS)
    case["tpu"] = side(tpu_iters, times[TPU])
    case["tpu_gflops"] = gflops(n, case["tpu"]["s_per_call"])
    case["cpu_gflops"] = case["ratio_ours_over_torch"] = None
    if cpu_iters:
        case["cpu"] = side(cpu_iters, times.get("cpu", cpu_times))
        case["cpu_gflops"] = gflops(n, case["cpu"]["s_per_call"])
        case["ratio_ours_over_torch"] = case["tpu_gflops"] / case["cpu_gflops"]
    return case


def run() -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    for dtype in DTYPES:
        cpu_s_per_call: float | None = None
        prev_n = 0
        for n in SIZES:
            # O(n^3): estimate this size's CPU call from the previous size of the same dtype.
            est = None if cpu_s_per_call is None else cpu_s_per_call * (n / prev_n) ** 3
            case = one_case(n, dtype, est)
            cases.append(case)
            if "s_per_call" in case["cpu"]:
                cpu_s_per_call, prev_n = case["cpu"]["s_per_call"], n
    ratios = [
        ratio(f"{c['dtype']}@{c['n']}", c["ratio_ours_over_torch"], GOAL_MIN_RATIO, higher_is_better=True)
        for c in cases
    ]
    parts = []
    for c in cases:
        cpu = f"{c['cpu_gflops']:.1f}" if c["cpu_gflops"] is not None else "skipped"
        parts.append(f"{c['dtype']}@{c['n']} {c['tpu_gflops']:.1f}/{cpu}")
    summary = (
        f"{NAME}: GFLOP/s tpu/cpu "
        + ", ".join(parts)
        + " | ours/torch "
        + ", ".join(fmt_ratio(r) for r in ratios)
    )
    return finish(
        NAME,
        {
            "description": "square a @ b on tpu (synchronized) vs torch.mm on CPU; GFLOP/s = 2 n^3 / s",
            "cases": cases,
            "ratios": ratios,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    run()
