"""Shared test setup. Every test compares the tpu device with PyTorch on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch_tpu  # noqa: F401  (also loaded by `import torch` through the entry point)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (for env vars read at startup, e.g. device count)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO
    )


@pytest.fixture
def tpu() -> torch.device:
    return torch.device("tpu")
