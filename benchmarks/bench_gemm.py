"""Square matmul throughput: `a @ b` on tpu vs `torch.mm` on the CPU, float32 and bfloat16; and the
float32 Linear products of bench_models_hf (hidden 256, FFN 1024, batch 4 x seq 128 tokens = 512 rows, ViT
4 x 145 = 580, T5's decoder 4 x 32 = 128, a few-row decode-size product) as F.linear on tpu (the host GEMM
for 2..128 rows, XLA's dot for more: csrc/lowering/matmul.cc) vs the CPU (the faster of default threads
and one thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bench_common import TPU, finish, fmt_ratio, interleaved, median, one_thread, ratio, sync, time_call

NAME = "gemm"
SIZES = (1024, 2048)
DTYPES = (torch.float32, torch.bfloat16)
REPEATS = 5
TARGET_REPEAT_S = 0.4  # iterations per repeat are chosen so one repeat takes about this long
MIN_ITERS = 2
MAX_ITERS = 50
CPU_BUDGET_S = 30.0  # skip a CPU baseline whose estimated total time exceeds this
GOAL_MIN_RATIO = 0.9
# (rows, in, out) of bench_models_hf's Linears: q/o and k/v (llama's 2 KV heads: 128), GPT-2's fused qkv,
# MLP up/down, at 512 / 580 / 128 rows, and a decode step's 16 rows
HF_LINEARS = ((512, 256, 256), (512, 256, 128), (512, 256, 768), (512, 256, 1024), (512, 1024, 256),
              (580, 256, 1024), (580, 1024, 256), (128, 256, 256), (128, 256, 1024), (128, 1024, 256),
              (16, 256, 1024))
HF_ITERS = 10


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


def hf_linear(m: int, k: int, n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(m + k + n)
    x_cpu, w_cpu, b_cpu = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x, w, b = x_cpu.to(TPU), w_cpu.to(TPU), b_cpu.to(TPU)

    def tpu_lin() -> torch.Tensor:
        return torch.nn.functional.linear(x, w, b)

    def cpu_lin() -> torch.Tensor:
        return torch.nn.functional.linear(x_cpu, w_cpu, b_cpu)

    fns = {TPU: batch_fn(tpu_lin, HF_ITERS, on_tpu=True), "cpu": batch_fn(cpu_lin, HF_ITERS, on_tpu=False)}
    fns["cpu_1thread"] = one_thread(fns["cpu"])
    for fn in fns.values():
        fn()
    ms = {d: median(t) / HF_ITERS * 1e3 for d, t in interleaved(fns, REPEATS).items()}
    cpu = min(ms["cpu"], ms["cpu_1thread"])
    return {"shape": f"[{m},{k}]x[{k},{n}]", "tpu_ms": ms[TPU], "cpu_ms": cpu, "cpu_default_threads_ms": ms["cpu"],
            "cpu_1thread_ms": ms["cpu_1thread"], "ratio_tpu_over_cpu": ms[TPU] / cpu}


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
    hf = [hf_linear(*shape) for shape in HF_LINEARS]
    summary = (
        f"{NAME}: GFLOP/s tpu/cpu "
        + ", ".join(parts)
        + " | ours/torch "
        + ", ".join(fmt_ratio(r) for r in ratios)
        + " | HF Linears ms tpu/cpu "
        + ", ".join(f"{c['shape']} {c['tpu_ms']:.2f}/{c['cpu_ms']:.2f}" for c in hf)
    )
    return finish(
        NAME,
        {
            "description": "square a @ b on tpu (synchronized) vs torch.mm on CPU; GFLOP/s = 2 n^3 / s; "
                           "bench_models_hf's float32 Linear shapes, F.linear, ms per call",
            "cases": cases,
            "hf_linears": hf,
            "ratios": ratios,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    run()
