"""What a user hits from outside: mistakes, odd inputs and models not covered elsewhere, vs PyTorch CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch_tpu


@pytest.mark.parametrize("call", ["add", "mm"])
def test_caller_shape_mistake_is_pytorchs_error_not_a_fallback(call: str) -> None:
    """A call the CPU refuses too raises PyTorch's error; no 'runs on the CPU' warning, no fallback count."""
    a, b = (torch.randn(3), torch.randn(4)) if call == "add" else (torch.randn(2, 3), torch.randn(4, 2))
    fn = torch.add if call == "add" else torch.mm
    with pytest.raises(RuntimeError) as cpu_err:
        fn(a, b)
    torch_tpu.reset_fallback_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError) as tpu_err:
            fn(a.to("tpu"), b.to("tpu"))
    assert str(tpu_err.value) == str(cpu_err.value)
    assert not [w for w in caught if "runs on the CPU" in str(w.message)]
    assert torch_tpu.fallback_stats() == {}


def test_shape_mistake_under_fallback_error_names_the_shape_problem() -> None:
    code = (
        "import torch\n"
        "try:\n"
        "    torch.randn(3, device='tpu') + torch.randn(4, device='tpu')\n"
        "except RuntimeError as e:\n"
        "    print(type(e).__name__, '|', e)\n"
    )
    env = dict(os.environ, TORCH_TPU_FALLBACK="error")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused its arguments" in out.stdout and "broadcast" in out.stdout, out.stdout
    assert "no tpu lowering" not in out.stdout and "At:" not in out.stdout, out.stdout
