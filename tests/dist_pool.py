"""A pool of N real processes (launched like torchrun) that run named test cases on demand.

Starting a process costs seconds (import torch, transformers, the PJRT client, gloo
rendezvous), so tests/test_distributed*.py start one pool and send it many cases: each case
name goes to every rank on stdin; each rank answers with one `@@RESULT {json}` line.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_TPU_DIST_TEST_WORKER="1")
    env.pop("TORCH_TPU_NUM_DEVICES", None)
    env.update(extra or {})
    return env


class Pool:
    def __init__(self, world: int, extra_env: dict[str, str] | None = None) -> None:
        self.world = world
        port = free_port()
        self.procs = [
            subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "dist_worker.py")], cwd=REPO,
                             env=rank_env(r, world, port, extra_env), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)
        ]
        self.queues: list[queue.Queue[str]] = [queue.Queue() for _ in range(world)]
        self.logs: list[list[str]] = [[] for _ in range(world)]
        for r, p in enumerate(self.procs):
            threading.Thread(target=self._read, args=(r, p), daemon=True).start()

    def _read(self, r: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("@@RESULT "):
                self.queues[r].put(line[len("@@RESULT "):])
            else:
                self.logs[r].append(line)
        self.queues[r].put("")  # EOF: the process ended

    def run(self, case: str, timeout: float = 120) -> list[dict[str, Any]]:
        """Runs `case` on every rank; returns each rank's {"ok", "result" | "error"}."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(case + "\n")
            p.stdin.flush()
        out = []
        for r in range(self.world):
            try:
                line = self.queues[r].get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"rank {r} gave no answer to {case} in {timeout}s:\n" +
                                   "".join(self.logs[r][-30:])) from None
            if not line:
                raise RuntimeError(f"rank {r} exited during {case}:\n" + "".join(self.logs[r][-40:]))
            out.append(json.loads(line))
        return out

    def ok(self, case: str, timeout: float = 120) -> list[Any]:
        res = self.run(case, timeout)
        errors = [f"rank {r}: {x['error']}\n{x.get('tb', '')}" for r, x in enumerate(res) if not x["ok"]]
        assert not errors, f"{case} failed:\n" + "\n".join(errors)
        return [x["result"] for x in res]

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write("exit\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
