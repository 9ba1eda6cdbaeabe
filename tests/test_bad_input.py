"""Bad input gets PyTorch's usual errors or a clear message; the process keeps working."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_python, warn_always


def test_cpu_and_tpu_mix_raises_device_error() -> None:
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="tpu") + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.ones(2, 2, device="tpu"), torch.ones(2, 2))
    # 0-d CPU tensors act as scalars, as on CUDA.
    assert (torch.ones(3, device="tpu") + torch.tensor(2.0)).cpu().tolist() == [3.0, 3.0, 3.0]


def test_shape_errors_match_cpu() -> None:
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.ones(3, device="tpu") + torch.ones(4, device="tpu")
    with pytest.raises(RuntimeError):
        torch.mm(torch.ones(2, 3, device="tpu"), torch.ones(2, 3, device="tpu"))
    assert torch.ones(2, device="tpu").sum().item() == 2.0


def test_unsupported_dtype_is_a_clear_error() -> None:
    # complex64/128 are device dtypes (tests/test_complex.py); complex32 is not.
    with pytest.raises(TypeError, match="does not support dtype"):
        torch.ones(2, dtype=torch.complex32).to("tpu")
    assert torch.ones(2, device="tpu").sum().item() == 2.0


def test_device_index_out_of_range() -> None:
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ones(2, device="tpu:7")


def test_missing_plugin_names_the_fix() -> None:
    r = run_python("import torch\ntorch.ones(2, device='tpu')", env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so"})
    assert r.returncode != 0
    assert "TORCH_TPU_PJRT_PLUGIN" in r.stderr
    r = run_python("import torch; print('import ok')", env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so"})
    assert r.returncode == 0 and "import ok" in r.stdout


def test_non_plugin_library_is_rejected(tmp_path: object) -> None:
    import ctypes.util

    libm = ctypes.util.find_library("m") or "libm.so.6"
    import os

    path = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6") if os.path.exists(p)), libm)
    r = run_python("import torch\ntorch.ones(2, device='tpu')", env={"TORCH_TPU_PJRT_PLUGIN": path})
    assert r.returncode != 0
    assert "not a PJRT plugin" in r.stderr or "cannot load" in r.stderr


def test_fallback_error_mode_names_the_op() -> None:
    code = "import torch\nx = torch.randn(4, 4, device='tpu')\ntorch.linalg.svd(x)"
    r = run_python(code, env={"TORCH_TPU_FALLBACK": "error"})
    assert r.returncode != 0
    assert "NotImplementedError" in r.stderr and "_linalg_svd" in r.stderr and "TORCH_TPU_FALLBACK" in r.stderr


def test_cpu_fallback_is_exact_counted_and_warned_once() -> None:
    import torch_tpu

    torch_tpu.reset_fallback_stats()
    c = torch.randn(5, 5)
    # Warned once per op and process; warn_always repeats it (an earlier test may have used svd).
    with pytest.warns(UserWarning, match="runs on the CPU"), warn_always():
        u, s, vh = torch.linalg.svd(c.to("tpu"))
    uc, sc, vhc = torch.linalg.svd(c)
    torch.testing.assert_close(u.cpu(), uc)
    torch.testing.assert_close(s.cpu(), sc)
    torch.testing.assert_close(vh.cpu(), vhc)
    torch.linalg.svd(c.to("tpu"))
    assert sum(v for k, v in torch_tpu.fallback_stats().items() if k.startswith("aten::_linalg_svd")) == 2
    # In-place through a view on the fallback path writes into the base.
    # (igamma/igammac have no lowering yet; whichever still falls back is used.)
    op = next(name for name in ("igamma", "igammac") if name not in torch_tpu.lowered_ops())
    base, other = c.abs() + 0.1, torch.rand(2, 5) + 0.5
    t = base.to("tpu")
    getattr(t[1:3], op + "_")(other.to("tpu"))
    cc = base.clone()
    getattr(cc[1:3], op + "_")(other)
    torch.testing.assert_close(t.cpu(), cc)
    torch_tpu.reset_fallback_stats()
    assert torch_tpu.fallback_stats() == {}


def test_compile_error_names_the_requester_and_the_plugin_message() -> None:
    import torch_tpu._C as C

    bad = 'module @m {\n  func.func public @main(%a: tensor<2xf32>) -> (tensor<3xf32>) {\n    "func.return"(%a) : (tensor<2xf32>) -> ()\n  }\n}\n'
    with pytest.raises(RuntimeError) as e:
        C._compile_mlir(bad, "aten::my_op")
    msg = str(e.value)
    assert "aten::my_op" in msg and "PJRT_Client_Compile" in msg and "---- program ----" in msg
    assert torch.ones(2, device="tpu").sum().item() == 2.0
