"""One rank of tests/dist_pool.Pool: joins the process group once, then runs the cases it is sent.

Each case checks tpu results against PyTorch on the CPU in this process (every rank knows
every rank's inputs) and returns a small JSON-able summary.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_cases  # noqa: E402


def main() -> None:
    dist.init_process_group(timeout=datetime.timedelta(seconds=60))
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        if name == "exit":
            break
        try:
            fn = dist_cases.CASES[name]
            out = {"ok": True, "result": fn()}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        torch.tpu.synchronize()
        print("@@RESULT " + json.dumps(out, default=str), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
