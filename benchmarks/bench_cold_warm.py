"""Compile cache, cold vs disk-warm: a compile-bound workload run in two fresh processes sharing
an empty temporary TORCH_TPU_CACHE_DIR. The first compiles every program, the second loads them
from disk. Each child times only its workload and prints the result as JSON on its last line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench_common import fmt_ratio, median, ratio

NAME = "cold_warm"
PAIRS = 2  # cold+warm process pairs per workload, each pair with its own empty cache dir
CHILD_TIMEOUT_S = 300
GOAL_MIN_RATIO = 10.0
MLP_WIDTHS = (32, 48, 64, 80, 96, 112, 128, 144, 160)
MLP_BATCH = 8
MINILM_BATCH = 2


def _mlp_workload() -> tuple[Callable[[], None], Callable[[], object]]:
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for w_in, w_out in zip(MLP_WIDTHS, MLP_WIDTHS[1:], strict=False):
        layers += [torch.nn.Linear(w_in, w_out), torch.nn.LayerNorm(w_out), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(MLP_WIDTHS[-1], 10), torch.nn.Softmax(dim=-1)).eval()
    x = torch.randn(MLP_BATCH, MLP_WIDTHS[0])
    dev: dict[str, Any] = {}

    def setup() -> None:
        dev["model"], dev["x"] = model.to("tpu"), x.to("tpu")

    def work() -> object:
        with torch.no_grad():
            return dev["model"](dev["x"]).cpu()

    return setup, work


def _minilm_workload() -> tuple[Callable[[], None], Callable[[], object]]:
    import bench_minilm
    import torch

    model, batch = bench_minilm.load(MINILM_BATCH, None)
    dev: dict[str, Any] = {}

    def setup() -> None:
        dev["model"] = model.to("tpu")
        dev["batch"] = {k: v.to("tpu") for k, v in batch.items()}

    def work() -> object:
        with torch.no_grad():
            return dev["model"](**dev["batch"]).last_hidden_state.cpu()

    return setup, work


WORKLOADS: dict[str, Callable[[], tuple[Callable[[], None], Callable[[], object]]]] = {
    "mlp": _mlp_workload,
    "minilm": _minilm_workload,
}


def child(workload: str) -> None:
    """Runs in the subprocess: set up off the clock, then time the workload (compile + run + readback)."""
    import torch
    import torch_tpu

    t0 = time.perf_counter()
    # nn.Linear on tpu runs torch._decomp's addmm, whose first call imports torch._dynamo (~1-2 s,
    # the same in cold and warm processes, unrelated to the compile cache): import it off the clock.
    import torch._dynamo  # noqa: F401

    preimport_s = time.perf_counter() - t0
    setup, work = WORKLOADS[workload]()
    t0 = time.perf_counter()
    torch.tpu.init()  # type: ignore[attr-defined]
    setup()
    torch.tpu.synchronize()  # type: ignore[attr-defined]
    setup_s = time.perf_counter() - t0
    torch_tpu.reset_cache_stats()
    t0 = time.perf_counter()
    work()
    workload_s = time.perf_counter() - t0
    stats = {k: v for k, v in torch_tpu.cache_stats().items() if k != "cache_dir"}
    result = {"workload": workload, "preimport_s": preimport_s, "setup_s": setup_s, "workload_s": workload_s}
    print(json.dumps({**result, "cache": stats}))


def spawn(workload: str, cache_dir: str) -> dict[str, Any]:
    env = {**os.environ, "TORCH_TPU_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", workload],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{workload} child failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def measure(workload: str) -> dict[str, Any]:
    pairs = []
    for _ in range(PAIRS):
        with tempfile.TemporaryDirectory(prefix="torch_tpu_bench_cache_") as cache_dir:
            cold = spawn(workload, cache_dir)
            warm = spawn(workload, cache_dir)
        pairs.append({"cold": cold, "warm": warm})
    cold_s = median([p["cold"]["workload_s"] for p in pairs])
    warm_s = median([p["warm"]["workload_s"] for p in pairs])
    return {"cold_s": cold_s, "warm_s": warm_s, "ratio_cold_over_warm": cold_s / warm_s, "pairs": pairs}


def run() -> dict[str, Any]:
    from bench_common import finish  # imports torch: only the parent needs it at module level

    results = {name: measure(name) for name in WORKLOADS}
    ratios = [
        ratio(name, r["ratio_cold_over_warm"], GOAL_MIN_RATIO, higher_is_better=True)
        for name, r in results.items()
    ]
    parts = [f"{name} cold {r['cold_s']:.2f} s / warm {r['warm_s']:.3f} s" for name, r in results.items()]
    summary = f"{NAME}: " + ", ".join(parts) + " | cold/warm " + ", ".join(fmt_ratio(r) for r in ratios)
    return finish(
        NAME,
        {
            "description": (
                "workload = first forward + readback in a fresh process (interpreter start, imports incl. "
                "torch._dynamo, model build and .to('tpu') excluded); cold: empty TORCH_TPU_CACHE_DIR, "
                "warm: a second process on the same dir"
            ),
            "pairs_per_workload": PAIRS,
            "mlp_widths": list(MLP_WIDTHS),
            "mlp_batch": MLP_BATCH,
            "minilm_batch": MINILM_BATCH,
            "workloads": results,
            "ratios": ratios,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", choices=sorted(WORKLOADS), help="run one workload (internal)")
    args = parser.parse_args()
    if args.child:
        child(args.child)
    else:
        run()
