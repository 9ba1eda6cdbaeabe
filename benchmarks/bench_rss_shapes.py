"""Bounded program memory: a loop over many distinct shapes (each a new eager program) must keep
process RSS flat once the program cache is full (TORCH_TPU_CACHE_MAX_PROGRAMS / _MB evict least
recently used). Prints RSS, memory maps and cache counters every --every shapes; the result is
RSS after warm-up (the first --warmup shapes) vs at the end. The disk cache is off (it would
otherwise store every program). Usage: python bench_rss_shapes.py [--shapes 50000]"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ["TORCH_TPU_DISK_CACHE"] = "0"

import torch  # noqa: E402
import torch_tpu  # noqa: E402
from bench_common import TPU, finish, fmt_ratio, ratio  # noqa: E402

NAME = "rss_shapes"
GOAL_MAX_GROWTH = 1.10  # RSS at the end / RSS after warm-up


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def run(shapes: int, warmup: int, every: int) -> dict[str, Any]:
    base = torch.arange(shapes + 1, dtype=torch.float32, device=TPU)
    samples: list[dict[str, Any]] = []
    after_warmup: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i in range(shapes):
        y = base[: i + 1] + 1.0  # a new element count: a new program
        if i + 1 == warmup or (i + 1) % every == 0 or i + 1 == shapes:
            torch_tpu.synchronize()
            assert float(y[-1].item()) == float(i + 1)
            stats = torch_tpu.cache_stats()
            s = {"shapes": i + 1, "rss_mb": rss_mb(), "maps": maps(), "programs": stats["programs"],
                 "program_bytes": stats["program_bytes"], "evictions": stats["evictions"],
                 "seconds": time.perf_counter() - t0}
            samples.append(s)
            print(s, flush=True)
            if i + 1 == warmup:
                after_warmup = s
    end = samples[-1]
    growth = end["rss_mb"] / after_warmup["rss_mb"]
    ratios = [ratio("rss end/after warm-up", growth, GOAL_MAX_GROWTH, higher_is_better=False)]
    summary = (f"{NAME}: {shapes} shapes, rss after {warmup} {after_warmup['rss_mb']:.0f} MB, at the end "
               f"{end['rss_mb']:.0f} MB, maps {after_warmup['maps']} -> {end['maps']}, programs "
               f"{end['programs']}, evictions {end['evictions']} | " + ", ".join(fmt_ratio(r) for r in ratios))
    return finish(NAME, {"description": __doc__, "samples": samples, "ratios": ratios, "summary": summary})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=50_000)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--every", type=int, default=2_000)
    a = ap.parse_args()
    run(a.shapes, a.warmup, a.every)
