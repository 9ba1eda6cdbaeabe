"""torch.tpu.precision / torch.set_float32_matmul_precision -> StableHLO precision_config on every
contraction, in strict eager, fused eager and compiled graphs (one lowering table), and part of
each program's key. At "highest" (the default) results equal PyTorch CPU."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch_tpu
from torch_tpu import EagerMode, set_eager_mode

Precision = torch.tpu.Precision  # type: ignore[attr-defined]
_CONFIG = re.compile(r"precision_config = \[#stablehlo<precision (\w+)>, #stablehlo<precision (\w+)>\]")


@pytest.fixture
def dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Programs built from here on are written under the returned folder (read at each build)."""
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path))
    torch.set_float32_matmul_precision("highest")
    yield tmp_path
    torch.set_float32_matmul_precision("highest")
    torch.tpu.precision(None)  # type: ignore[attr-defined]


def _precisions(folder: Path, op: str) -> set[str]:
    """The precisions on the `op` ("dot_general" / "convolution") lines of the programs in `folder`."""
    found = set()
    for f in folder.glob("*.mlir"):
        for line in f.read_text().splitlines():
            if f"stablehlo.{op}" in line:
                m = _CONFIG.search(line)
                assert m is not None, line
                assert m.group(1) == m.group(2)
                found.add(m.group(1))
    return found


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(n)
    return torch.randn(n, 24), torch.randn(24, n + 1)  # a new shape per case: a new program


def test_eager_precision_in_program_and_key(dump: Path) -> None:
    a, b = _inputs(5)
    out = (a.to("tpu") @ b.to("tpu")).cpu()  # default: HIGHEST, equal to CPU
    torch.testing.assert_close(out, a @ b)
    assert torch.tpu.get_precision() is Precision.HIGHEST  # type: ignore[attr-defined]
    assert _precisions(dump, "dot_general") == {"HIGHEST"}
    before = torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"]
    with torch.tpu.precision(Precision.HIGH):  # type: ignore[attr-defined]
        assert torch.tpu.get_precision() is Precision.HIGH  # type: ignore[attr-defined]
        high = (a.to("tpu") @ b.to("tpu")).cpu()
    assert torch.tpu.get_precision() is Precision.HIGHEST  # type: ignore[attr-defined]
    # same op, same shapes: a different key, so a different program
    assert torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"] > before
    assert _precisions(dump, "dot_general") == {"HIGHEST", "HIGH"}
    torch.testing.assert_close(high, a @ b, rtol=1e-2, atol=1e-2)
    # torch's own setting, when no override is set: "medium" -> DEFAULT
    torch.set_float32_matmul_precision("medium")
    assert torch.tpu.get_precision() is Precision.DEFAULT  # type: ignore[attr-defined]
    torch.nn.functional.linear(a.to("tpu"), b.t().contiguous().to("tpu")).cpu()
    assert "DEFAULT" in _precisions(dump, "dot_general")


def test_fused_eager_keeps_the_precision_of_each_call(dump: Path) -> None:
    a, b = _inputs(6)
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        ta, tb = a.to("tpu"), b.to("tpu")
        with torch.tpu.precision("high"):  # type: ignore[attr-defined]
            x = ta @ tb  # recorded at HIGH; the fused program is built after the block
        y = x.sum(0) + (ta @ tb).sum(0)
        got = y.cpu()
    texts = [f.read_text() for f in dump.glob("*.mlir") if "fused graph" in f.read_text()]
    assert any("precision HIGH>" in t and "precision HIGHEST>" in t for t in texts), texts
    torch.testing.assert_close(got, (a @ b).sum(0) * 2, rtol=1e-4, atol=1e-4)


def test_convolution_carries_precision(dump: Path) -> None:
    # XLA's convolution (host kernels off; on the CPU plugin a float forward is otherwise PyTorch's
    # own CPU convolution, which has no precision setting). Shapes no other test uses, so the
    # programs are built here, on that path.
    torch.manual_seed(1)
    x, w = torch.randn(1, 3, 7, 5), torch.randn(4, 3, 3, 2)
    previous = torch_tpu.ops.host_kernels()
    torch_tpu.ops.host_kernels(False)
    try:
        out = F.conv2d(x.to("tpu"), w.to("tpu"), padding=1).cpu()
        torch.testing.assert_close(out, F.conv2d(x, w, padding=1), rtol=1e-5, atol=1e-5)
        with torch.tpu.precision(Precision.DEFAULT):  # type: ignore[attr-defined]
            F.conv2d(x.to("tpu"), w.to("tpu"), padding=1).cpu()
    finally:
        if previous == "on":
            torch_tpu.ops.host_kernels(True)
        elif previous == "always":
            torch_tpu.ops.host_kernels("always")
    assert _precisions(dump, "convolution") == {"HIGHEST", "DEFAULT"}


def test_host_gemm_is_float32_at_every_precision(dump: Path) -> None:
    # On the CPU plugin a large float32 product is PyTorch's CPU GEMM (tests/test_host_gemm.py), which
    # has no reduced-precision passes: at "medium" it computes what "highest" asks (never less precise
    # than requested), its program carries no precision, and one program serves every setting.
    if torch_tpu.ops.host_kernels() != "on":
        pytest.skip("no host kernels here")
    previous = torch_tpu.ops.host_kernels(None, kind="gemm")  # on by default (csrc/lowering/host_kernels.cc)
    torch_tpu.ops.host_kernels(True, kind="gemm")
    try:
        _host_gemm_at_every_precision(dump)
    finally:
        torch_tpu.ops.host_kernels(previous != "off", kind="gemm")


def _host_gemm_at_every_precision(dump: Path) -> None:
    torch.manual_seed(7)
    a, b = torch.randn(72, 100), torch.randn(100, 84)  # 604,800 multiply-adds: above the threshold
    with torch.tpu.precision("medium"):  # type: ignore[attr-defined]
        medium = (a.to("tpu") @ b.to("tpu")).cpu()
    torch.testing.assert_close(medium, a @ b, rtol=1e-5, atol=1e-5)
    texts = [f.read_text() for f in dump.glob("*.mlir")]
    assert any('"torch_tpu.gemm"' in t for t in texts) and not any("precision_config" in t for t in texts)
    before = torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"]
    highest = (a.to("tpu") @ b.to("tpu")).cpu()
    assert torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"] == before
    torch.testing.assert_close(highest, medium, rtol=0, atol=0)


def test_compiled_graph_builds_one_program_per_precision(dump: Path) -> None:
    torch.manual_seed(2)
    lin = torch.nn.Linear(24, 7)
    x = torch.randn(3, 24)
    with torch.no_grad():
        ref = lin(x)
        compiled = torch.compile(lin.to("tpu"), backend="tpu")
        out = compiled(x.to("tpu")).cpu()
        torch.testing.assert_close(out, ref)
        n = len(torch_tpu.compile_stats()["graph_tiers"])
        with torch.tpu.precision("medium"):  # type: ignore[attr-defined]
            compiled(x.to("tpu")).cpu()
            compiled(x.to("tpu")).cpu()  # the DEFAULT program is kept
        again = compiled(x.to("tpu")).cpu()
    tiers = torch_tpu.compile_stats()["graph_tiers"]
    assert len(tiers) == n + 1 and tiers[-1]["aot"] == "reused"  # one more program, no retrace
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    graphs = [f.read_text() for f in dump.glob("*.mlir") if f.read_text().startswith("// graph")]
    assert {m.group(1) for t in graphs for m in _CONFIG.finditer(t)} == {"HIGHEST", "DEFAULT"}


def test_bad_precision_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="Precision"):
        torch.tpu.precision("bf16")  # type: ignore[attr-defined]
    assert torch.tpu.get_precision() is Precision.HIGHEST  # type: ignore[attr-defined]
