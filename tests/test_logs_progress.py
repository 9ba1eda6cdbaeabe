"""Quiet start-up (no absl/plugin chatter unless TORCH_TPU_LOG_LEVEL=info), plugin errors naming the
path, and the compile progress line (TTY only, TORCH_TPU_PROGRESS=0 silences it)."""

from __future__ import annotations

import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import tempfile
import termios

from tests.conftest import REPO, run_python

FIRST_OP = "import torch; print(torch.ones(2, device='tpu').add(1).cpu().tolist())"


def test_no_plugin_chatter_by_default_and_shown_on_request() -> None:
    quiet = run_python(FIRST_OP, env={"TORCH_TPU_PROGRESS_AFTER_S": "0"})
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "[2.0, 2.0]"
    assert "absl::InitializeLog" not in quiet.stderr and "cpu_device_count" not in quiet.stderr, quiet.stderr
    assert "compiling XLA programs" not in quiet.stderr  # no progress line without a terminal
    # TF_CPP_MIN_LOG_LEVEL=0: importing jax (test_jax_op, same pytest process) sets it to 1, which
    # children inherit and which hides the plugin's INFO lines whatever TORCH_TPU_LOG_LEVEL says.
    loud = run_python(FIRST_OP, env={"TORCH_TPU_LOG_LEVEL": "info", "TF_CPP_MIN_LOG_LEVEL": "0"})
    assert loud.returncode == 0 and "cpu_device_count" in loud.stderr, loud.stderr


def test_missing_plugin_path_is_named() -> None:
    code = ("import torch\ntry:\n    torch.ones(1, device='tpu')\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    r = run_python(code, env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/dir/my_plugin.so"})
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "/nonexistent/dir/my_plugin.so" in r.stdout, r.stdout


PROGRESS = r"""
import torch
x = torch.ones(3, device="tpu")
for i in range(12):
    x = torch.cat([x, x[:1] * (i + 1)])  # a new shape each time: one compile per op
torch.tpu.synchronize()
import time; time.sleep(1.0)
print("done", x.shape[0])
"""


def _run_in_pty(env: dict[str, str]) -> str:
    """Runs PROGRESS with stdout/stderr on a pseudo-terminal; returns everything it wrote."""
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a sized terminal
    # A fresh cache dir: every program compiles.
    cache = tempfile.mkdtemp(prefix="torch_tpu_progress_")
    full = dict(os.environ, TORCH_TPU_PROGRESS_AFTER_S="0", TORCH_TPU_CACHE_DIR=cache, **env)
    try:
        p = subprocess.Popen([sys.executable, "-c", PROGRESS], stdout=sub, stderr=sub, env=full, cwd=REPO)
        os.close(sub)
        out = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        p.wait(timeout=120)
        os.close(main)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out.decode(errors="replace")


def test_progress_line_on_a_tty_only() -> None:
    shown = _run_in_pty({})
    assert "done 15" in shown and "torch_tpu: compiling XLA programs" in shown, shown[-2000:]
    silenced = _run_in_pty({"TORCH_TPU_PROGRESS": "0"})
    assert "done 15" in silenced and "compiling XLA programs" not in silenced, silenced[-2000:]
