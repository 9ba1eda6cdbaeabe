"""`pip install <repo>` into a fresh virtualenv that has the CPU torch builds and installs the backend.

The full build compiles the extension from scratch (~10+ min on 2 cores), too slow for `make test`:
it runs with TORCH_TPU_TEST_INSTALL=1 (README "Installing as a package" records a run). The
metadata checks below always run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO


def test_package_metadata_builds_without_manual_steps() -> None:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    build_requires = meta["build-system"]["requires"]
    # pip's isolated build env must have torch's headers and pjrt_c_api.h (from xla-cpu-pjrt).
    assert "torch==2.13.0" in build_requires and "xla-cpu-pjrt==0.0.1" in build_requires
    deps = meta["project"]["dependencies"]
    assert "torch==2.13.0" in deps and any(d.startswith("accelerate") for d in deps)
    assert meta["project"]["entry-points"]["torch.backends"]["torch_tpu"] == "torch_tpu:_autoload"
    assert meta["project"]["entry-points"]["torch_dynamo_backends"]["tpu"].startswith("torch_tpu.")
    assert meta["project"]["optional-dependencies"]["jax"]
    # setup.py imports torch: it must not autoload an installed (possibly stale) torch_tpu.
    code = "import os, runpy, sys; sys.argv = ['setup.py', '--name']; runpy.run_path('setup.py')"
    env = dict(os.environ, TORCH_TPU_SKIP_EXT="1")
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "torch_tpu" in r.stdout, r.stderr[-2000:]


@pytest.mark.skipif(os.environ.get("TORCH_TPU_TEST_INSTALL") != "1", reason="slow: TORCH_TPU_TEST_INSTALL=1")
def test_pip_install_into_fresh_venv(tmp_path: os.PathLike) -> None:
    venv = os.path.join(str(tmp_path), "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=1200)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    subprocess.run([*pip, REPO], check=True, timeout=3600, env=env)
    code = ("import torch; x = torch.ones(3, device='tpu') + 1; print(x.cpu().tolist(), "
            "torch.compile(lambda a: a * 2, backend='tpu')(x).cpu().tolist())")
    r = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[2.0, 2.0, 2.0] [4.0, 4.0, 4.0]"
