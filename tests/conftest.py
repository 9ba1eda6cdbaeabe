"""Shared test setup. Every test compares the tpu device with PyTorch on the CPU."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch_tpu  # (also loaded by `import torch` through the entry point)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# PyTorch's compile caches (AOTAutogradCache, FX graph cache, Dynamo packages) start empty in each
# test session, as on a clean machine: otherwise entries an earlier run left in
# /tmp/torchinductor_<user> serve the graphs, and tests that look at what the backend builds see
# nothing built. An explicit TORCHINDUCTOR_CACHE_DIR is kept; pytest-xdist workers inherit their
# controller's directory and take one each (else one worker's entries would serve the other's graphs).
_PREFIX = "torch_tpu_tests_inductor_"
_inherited = os.path.basename(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")).startswith(_PREFIX)
if not os.environ.get("TORCHINDUCTOR_CACHE_DIR") or (_inherited and os.environ.get("PYTEST_XDIST_WORKER")):
    _INDUCTOR_DIR = tempfile.mkdtemp(prefix=_PREFIX)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_DIR
    atexit.register(shutil.rmtree, _INDUCTOR_DIR, ignore_errors=True)


def run_python(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (for env vars read at startup, e.g. device count)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO
    )


@contextlib.contextmanager
def warn_always() -> Iterator[None]:
    """torch.set_warn_always(True) for the block: warnings PyTorch (and torch_tpu's fallback) give
    once per process fire again, whichever test in this worker process triggered them first."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        yield
    finally:
        torch.set_warn_always(before)


@pytest.fixture
def tpu() -> torch.device:
    return torch.device("tpu")


@pytest.fixture
def no_fallback() -> Iterator[None]:
    """The test must not run any op on the CPU fallback (use via pytestmark usefixtures)."""
    torch_tpu.reset_fallback_stats()
    yield
    assert torch_tpu.fallback_stats() == {}, torch_tpu.fallback_stats()


def to_dev(x: Any, device: str = "tpu") -> Any:
    """Tensors (also inside lists/tuples) moved to `device`; anything else unchanged."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(to_dev(v, device) for v in x)
    return x


def assert_same(got: Any, exp: Any, tol: dict[str, float] | None = None,
                table: dict[torch.dtype, dict[str, float]] | None = None) -> None:
    """`got` (a tpu result) equals the CPU result `exp`: lists/tuples element by element,
    non-tensors by ==; tensors on tpu with the same dtype and shape, floats within `tol`, else
    `table[dtype]` (rtol/atol for assert_close; exact when neither), everything else exactly."""
    if isinstance(exp, (tuple, list)):
        assert len(got) == len(exp)
        for g, e in zip(got, exp, strict=True):
            assert_same(g, e, tol, table)
        return
    if not isinstance(exp, torch.Tensor):
        assert got == exp
        return
    assert isinstance(got, torch.Tensor) and got.device.type == "tpu", got
    got = got.cpu()
    assert got.dtype == exp.dtype, (got.dtype, exp.dtype)
    assert got.shape == exp.shape, (got.shape, exp.shape)
    if exp.dtype.is_floating_point:
        tol = tol or (table or {}).get(exp.dtype) or dict(rtol=0, atol=0)
        torch.testing.assert_close(got, exp, equal_nan=True, **tol)
    else:
        assert torch.equal(got, exp), (got, exp)


@pytest.fixture(params=["strict", "fused"])
def strict_or_fused(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test in strict and in fused eager; it fails if any op took the CPU fallback."""
    torch_tpu.reset_fallback_stats()
    if request.param == "fused":
        with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
            yield request.param
    else:
        yield request.param
    assert torch_tpu.fallback_stats() == {}, torch_tpu.fallback_stats()
