"""Bounded executable memory: run many distinct small shapes through strict eager (one new program per
shape) and record process RSS, open memory maps and the compile cache's programs/evictions along the
way. With LRU eviction RSS must stay flat after warm-up instead of growing with every shape.

Not part of run_all.py: each new shape is an XLA compile (~30-50 ms), so 50,000 shapes take ~30-45 min.
  python bench_cache_rss.py [--shapes 50000] [--warmup 3000] [--every 1000] [--deadline-s SECONDS]
The JSON is rewritten at every checkpoint, so a run stopped early still leaves its curve.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

# Every shape is new: writing 50,000 programs to the on-disk cache would only measure the disk.
os.environ.setdefault("TORCH_TPU_DISK_CACHE", "0")

import torch  # noqa: E402
import torch_tpu  # noqa: E402
from bench_common import TPU, machine_info, sync, write_result  # noqa: E402
from torch_tpu import EagerMode, set_eager_mode  # noqa: E402

NAME = "cache_rss"
GOAL_MAX_GROWTH_MB = 50.0  # RSS growth allowed from the end of warm-up to the end of the loop


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def checkpoint(shapes: int, start: float) -> dict[str, Any]:
    stats = torch_tpu.cache_stats()
    return {
        "shapes": shapes,
        "seconds": round(time.perf_counter() - start, 1),
        "rss_mb": round(rss_mb(), 1),
        "maps": map_count(),
        "programs": int(stats.get("programs", 0)),
        "program_bytes": int(stats.get("program_bytes", 0)),
        "evictions": int(stats.get("evictions", 0)),
        "misses": int(stats.get("misses", 0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=50_000)
    parser.add_argument("--warmup", type=int, default=3_000, help="shapes before the RSS baseline")
    parser.add_argument("--every", type=int, default=1_000, help="shapes between checkpoints")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="stop after this many seconds")
    args = parser.parse_args()

    set_eager_mode(EagerMode.DEFER_NEVER)
    base = torch.linspace(-1.0, 1.0, args.shapes, device=TPU)
    start = time.perf_counter()
    curve: list[dict[str, Any]] = [checkpoint(0, start)]
    ran = 0
    stopped_early = False

    def report() -> dict[str, Any]:
        warm = next((c for c in curve if c["shapes"] >= args.warmup), None)
        last = curve[-1]
        growth = None if warm is None or warm is last else round(last["rss_mb"] - warm["rss_mb"], 1)
        ok = growth is not None and growth <= GOAL_MAX_GROWTH_MB
        summary = (
            f"cache_rss: {ran} distinct shapes in {last['seconds']:.0f} s; rss "
            f"{warm['rss_mb'] if warm else 'n/a'} MB after {args.warmup} -> {last['rss_mb']} MB at {ran} "
            f"(growth {growth} MB, goal <= {GOAL_MAX_GROWTH_MB}); programs {last['programs']}, "
            f"evictions {last['evictions']}, maps {last['maps']}"
        )
        data = {
            "benchmark": NAME,
            "machine": machine_info(),
            "requested_shapes": args.shapes,
            "ran_shapes": ran,
            "stopped_early": stopped_early,
            "workload": "strict eager, y = base[:n] * 2.0 for n = 1..shapes (one new program per n)",
            "warmup_shapes": args.warmup,
            "rss_growth_after_warmup_mb": growth,
            "goal_max_growth_mb": GOAL_MAX_GROWTH_MB,
            "meets_goal": ok,
            "curve": curve,
            "summary": summary,
        }
        write_result(NAME, data)
        return data

    for n in range(1, args.shapes + 1):
        # One elementwise expression per shape: the slice is a view, the multiply is one new program
        # for each new length n (a cheap compile), and the sum checks the result against the CPU.
        y = base[:n] * 2.0
        ran = n
        if n % args.every == 0 or n == args.shapes:
            sync()
            expect = torch.linspace(-1.0, 1.0, args.shapes)[:n] * 2.0
            torch.testing.assert_close(y.cpu(), expect)
            curve.append(checkpoint(n, start))
            print(f"  {curve[-1]}", flush=True)
            report()
            if args.deadline_s and curve[-1]["seconds"] >= args.deadline_s:
                stopped_early = n < args.shapes
                break
    print(report()["summary"], flush=True)


if __name__ == "__main__":
    main()
