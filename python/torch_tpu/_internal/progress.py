"""A progress line while XLA compiles keep the user waiting (a cold tiny-Llama `generate` makes ~140
compiles): shown on a TTY only, once compiles in a burst took over TORCH_TPU_PROGRESS_AFTER_S
(2 s) in total; TORCH_TPU_PROGRESS=0 silences it.

A daemon thread polls the compile-cache counters between ops (it needs the GIL, so it never runs
inside a compile); the line is tqdm's, cleared when compiles stop for a second.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

_POLL_S = 0.25
_IDLE_S = 1.0
_started = False


def _counters() -> tuple[int, float]:
    from torch_tpu import _C

    s = _C._cache_stats()
    return int(s["misses"]) + int(s["disk_hits"]), float(s["compile_ms"]) + float(s["disk_load_ms"])


def _run(after_s: float) -> None:
    bar: Any = None
    base_n, base_ms = _counters()
    prev_n, last_change = base_n, time.monotonic()
    while True:
        time.sleep(_POLL_S)
        n, ms = _counters()
        now = time.monotonic()
        if n != prev_n:
            prev_n, last_change = n, now
        if bar is None and n > base_n and ms - base_ms > after_s * 1000:
            from tqdm import tqdm

            bar = tqdm(desc="torch_tpu: compiling XLA programs", unit=" programs", file=sys.stderr,
                       leave=False, dynamic_ncols=True, bar_format="{desc}: {n} programs{postfix}")
        if bar is not None:
            bar.n = n - base_n
            bar.set_postfix_str(f"{(ms - base_ms) / 1000:.1f} s", refresh=True)
            if now - last_change > _IDLE_S:
                bar.close()
                bar = None
        if bar is None and now - last_change > _IDLE_S:
            base_n, base_ms = n, ms  # a new burst measures its own time


def install() -> None:
    """Starts the poller when stderr is a terminal and progress is not disabled (idempotent)."""
    global _started
    if _started or os.environ.get("TORCH_TPU_PROGRESS", "1") == "0":
        return
    force = os.environ.get("TORCH_TPU_PROGRESS") == "1"  # e.g. a notebook without a TTY
    if not force and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return
    try:
        after_s = float(os.environ.get("TORCH_TPU_PROGRESS_AFTER_S", "2"))
    except ValueError:
        after_s = 2.0
    _started = True
    threading.Thread(target=_run, args=(after_s,), name="torch_tpu-progress", daemon=True).start()
