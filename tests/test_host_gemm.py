"""The host GEMM (csrc/aten/ffi_gemm.cc, csrc/lowering/host_gemm.h): on the CPU plugin float32
mm / addmm / bmm / baddbmm of 2..128 rows from a measured size on are PyTorch's CPU GEMM run as the XLA FFI
custom call "torch_tpu.gemm" inside strict and fused programs (and, from 2 to 512 rows, in compiled graphs); transposed operands go in as
the arrays they transpose, with a flag. Every case compares with PyTorch CPU and checks which path
the program took. Shapes are unique to this file, so each program is built here, on the path the
test switched to."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from tests.conftest import run_python

DEV = "tpu"
TARGET = '"torch_tpu.gemm"'
_CALL = re.compile(r'"stablehlo.custom_call"\((%v\d+), (%v\d+), (%v\d+)\).*call_target_name = "torch_tpu.gemm"'
                   r".*backend_config = \{([^}]*)\}")


@pytest.fixture
def host() -> Iterator[None]:
    if torch_tpu.ops.host_kernels() != "on":
        pytest.skip("no host kernels here")  # test_ragged_dot.py::test_host_kernels_registered says why
    previous = torch_tpu.ops.host_kernels(None, kind="gemm")
    torch_tpu.ops.host_kernels(True, kind="gemm")
    yield
    torch_tpu.ops.host_kernels(True)
    torch_tpu.ops.host_kernels(previous != "off", kind="gemm")


@pytest.fixture
def dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """dump(name): programs built from here on go to a folder per name; returns the text of the
    programs of the previous name (so each step's programs are read separately)."""
    folders: list[Path] = []

    def switch(name: str) -> str:
        text = "".join(_programs(folders[-1])) if folders else ""
        folders.append(tmp_path / name)
        monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(folders[-1]))
        return text

    return switch


def _programs(folder: Path) -> list[str]:
    return [f.read_text() for f in sorted(folder.glob("*.mlir"))]


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-4)


def _configs(text: str) -> list[str]:
    return [m.group(4) for m in _CALL.finditer(text)]


def _cfg(trans_a: int, trans_b: int, has_c: int, alpha: float = 1.0, beta: float = 0.0) -> str:
    return (f"trans_a = {trans_a} : i64, trans_b = {trans_b} : i64, has_c = {has_c} : i64, "
            f"alpha = {alpha:.17e} : f64, beta = {beta:.17e} : f64")


def test_linear_program_is_one_host_gemm(host: None, dump: Callable[[str], str]) -> None:
    # nn.Linear's addmm(bias, x, weight.t()): one call, the weight passed as stored ([N, K], trans_b),
    # bias as the addend; no XLA dot. 96 x 160 x 144 = 2.2M multiply-adds, above the threshold.
    x, w, bias = _rand(96, 160), _rand(144, 160), _rand(144)
    dump("linear")
    _close(F.linear(x.to(DEV), w.to(DEV), bias.to(DEV)), F.linear(x, w, bias))
    text = dump("next")
    assert _configs(text) == [_cfg(0, 1, 1, 1.0, 1.0)]
    assert "stablehlo.dot_general" not in text
    call = _CALL.search(text)
    assert call is not None
    weight_arg = call.group(2)  # the weight's [N, K] array itself, not a transpose of it
    assert not re.search(rf"{weight_arg} = \"stablehlo.transpose\"", text)


def test_small_products_stay_xla_dots(host: None, dump: Callable[[str], str]) -> None:
    a, b = _rand(7, 33), _rand(33, 9)
    dump("small")
    _close(a.to(DEV) @ b.to(DEV), a @ b)
    text = dump("next")
    assert TARGET not in text and "stablehlo.dot_general" in text


@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_mm_transposed_operands(host: None, dump: Callable[[str], str], ta: bool, tb: bool) -> None:
    m, k, n = 72 + 2 * ta + tb, 136, 232
    a = _rand(k, m).t() if ta else _rand(m, k)
    b = _rand(n, k, seed=1).t() if tb else _rand(k, n, seed=1)
    dump("mm")
    _close(torch.mm(a.to(DEV), b.to(DEV)), torch.mm(a, b))
    assert _configs(dump("next")) == [_cfg(int(ta), int(tb), 0)]


def test_addmm_beta_alpha(host: None, dump: Callable[[str], str]) -> None:
    a, b = _rand(80, 128), _rand(128, 224, seed=2)
    for self_shape in [(80, 224), (224,), (1, 224), (80, 1)]:
        s = _rand(*self_shape, seed=3)
        for beta, alpha in [(1, 1), (0.5, -2.0), (0, 3)]:
            dump("addmm")
            got = torch.addmm(s.to(DEV), a.to(DEV), b.to(DEV), beta=beta, alpha=alpha)
            _close(got, torch.addmm(s, a, b, beta=beta, alpha=alpha))
            text = dump("next")
            assert TARGET in text and "stablehlo.dot_general" not in text
    # beta == 0 ignores self, NaN included, as on the CPU
    s = torch.full((80, 224), float("nan"))
    _close(torch.addmm(s.to(DEV), a.to(DEV), b.to(DEV), beta=0), torch.addmm(s, a, b, beta=0))


def test_addmm_scalar_operands(host: None, dump: Callable[[str], str]) -> None:
    # alpha/beta that are runtime operands (not program constants): the call is the product, the
    # scaling an XLA epilogue; a new value reuses the program.
    a, b, s = _rand(88, 120), _rand(120, 216, seed=4), _rand(216, seed=5)
    dump("scalars")
    for beta, alpha in [(0.37, 1.7), (-1.25, 0.3)]:
        got = torch.addmm(s.to(DEV), a.to(DEV), b.to(DEV), beta=beta, alpha=alpha)
        _close(got, torch.addmm(s, a, b, beta=beta, alpha=alpha))
    assert _configs(dump("next")) == [_cfg(0, 0, 0)]


def test_bmm_baddbmm(host: None, dump: Callable[[str], str]) -> None:
    q, k, v = _rand(6, 96, 40), _rand(6, 104, 40, seed=6), _rand(6, 104, 56, seed=7)
    dump("bmm")
    scores = torch.bmm(q.to(DEV), k.to(DEV).transpose(1, 2))  # attention's q @ k^T: k as stored
    _close(scores, torch.bmm(q, k.transpose(1, 2)))
    _close(torch.bmm(scores, v.to(DEV)), torch.bmm(torch.bmm(q, k.transpose(1, 2)), v))
    assert sorted(_configs(dump("next"))) == sorted([_cfg(0, 1, 0), _cfg(0, 0, 0)])
    s = _rand(6, 1, 104, seed=8)
    got = torch.baddbmm(s.to(DEV), q.to(DEV), k.to(DEV).transpose(1, 2), beta=0.5, alpha=2)
    _close(got, torch.baddbmm(s, q, k.transpose(1, 2), beta=0.5, alpha=2))
    assert _configs(dump("next2")) == [_cfg(0, 1, 1, 2.0, 0.5)]


def test_non_contiguous_operands(host: None) -> None:
    # strided slices and offsets: read through their views (copied), then the GEMM
    a, b = _rand(100, 300), _rand(400, 200, seed=9)
    ga, gb = a[3:, ::2], b[::2, 1:]  # [97, 150] x [200, 199] -> take [97,150] x [150,199]
    gb = gb[:150]
    _close(ga.to(DEV) @ gb.to(DEV), ga @ gb)
    out = torch.empty(199, 97, device=DEV).t()  # a transposed out= buffer
    torch.mm(ga.to(DEV), gb.to(DEV), out=out)
    _close(out, ga @ gb)


def test_fused_and_compiled(host: None, dump: Callable[[str], str], tmp_path: Path) -> None:
    # Fused eager records the products into one program: two host GEMMs. Compiled graphs take them
    # too, by their own rule (rank 2, 2..512 rows, from 2^20 multiply-adds: here 96 x 168 x 136 and
    # 96 x 136 x 136), with the same results.
    lin = torch.nn.Linear(168, 136)
    x = _rand(4, 24, 168)
    with torch.no_grad():
        ref = torch.relu(lin(x)) @ lin.weight[:, :136]
        lin_t = torch.nn.Linear(168, 136).to(DEV)
        lin_t.load_state_dict(lin.state_dict())
        wt = lin.weight[:, :136].to(DEV)
        dump("fused")
        with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
            got = (torch.relu(lin_t(x.to(DEV))) @ wt).cpu()
        _close(got, ref)
        text = dump("compiled")
        assert len(_configs(text)) == 2 and "stablehlo.dot_general" not in text
        fn = torch.compile(lambda t: torch.relu(lin_t(t)) @ wt, backend="tpu")
        _close(fn(x.to(DEV)), ref)
        dump("done")
        graphs = [t for t in _programs(tmp_path / "compiled") if t.startswith("// graph")]
        assert len(graphs) == 1 and "stablehlo.dot_general" not in graphs[0]
        assert _configs(graphs[0]) == [_cfg(0, 1, 1, 1.0, 1.0), _cfg(0, 0, 0)]


def _compiled_graphs(fn: Callable[..., torch.Tensor], *args: torch.Tensor, dump: Callable[[str], str],
                     folder: Path, name: str) -> tuple[torch.Tensor, str]:
    dump(name)
    out = torch.compile(fn, backend="tpu", dynamic=False)(*args).cpu()
    dump(name + "_done")
    return out, "".join(t for t in _programs(folder / name) if t.startswith("// graph"))


def test_compiled_rule(host: None, dump: Callable[[str], str], tmp_path: Path) -> None:
    # Compiled graphs (csrc/lowering/matmul.cc, kGraphGemm*): Linears of 2..512 rows from 2^20
    # multiply-adds are the host GEMM (the weight as stored: trans_b), equal to PyTorch CPU; one row
    # (XLA's fused GEMV), more than 512 rows and batched products stay XLA dots.
    w, bias = _rand(264, 272), _rand(264)
    for rows, host_call in [(2, False), (16, True), (512, True), (1, False), (513, False)]:
        x = _rand(rows, 272, seed=2)
        # 2 rows: 2 x 272 x 264 < 2^20 multiply-adds
        got, text = _compiled_graphs(lambda t, ww, bb: F.linear(t, ww, bb), x.to(DEV), w.to(DEV), bias.to(DEV),
                                     dump=dump, folder=tmp_path, name=f"rows{rows}")
        _close(got, F.linear(x, w, bias))
        if host_call:
            assert _configs(text) == [_cfg(0, 1, 1, 1.0, 1.0)] and "stablehlo.dot_general" not in text, rows
        else:
            assert TARGET not in text and "stablehlo.dot_general" in text, rows
    a, b = _rand(6, 64, 96), _rand(6, 96, 80, seed=3)
    got, text = _compiled_graphs(torch.bmm, a.to(DEV), b.to(DEV), dump=dump, folder=tmp_path, name="bmm")
    _close(got, torch.bmm(a, b))
    assert TARGET not in text and "stablehlo.dot_general" in text
    # switched off: the graph keeps XLA's dot (the swapped Linear product, csrc/aten/graph.cc)
    x = _rand(64, 272, seed=4)
    torch_tpu.ops.host_kernels(False, kind="gemm")
    got, text = _compiled_graphs(lambda t, ww: F.linear(t, ww), x.to(DEV), w.to(DEV), dump=dump, folder=tmp_path,
                                 name="off")
    _close(got, F.linear(x, w))
    assert TARGET not in text and "stablehlo.dot_general" in text


def test_switched_off(host: None, dump: Callable[[str], str]) -> None:
    a, b, s = _rand(104, 144), _rand(144, 152, seed=10), _rand(152, seed=11)
    assert torch_tpu.ops.host_kernels(False, kind="gemm") == "off"
    assert torch_tpu.ops.host_kernels(None, kind="conv") == "on"
    dump("off")
    _close(torch.addmm(s.to(DEV), a.to(DEV), b.to(DEV)), torch.addmm(s, a, b))
    text = dump("on")
    assert TARGET not in text and "stablehlo.dot_general" in text
    assert torch_tpu.ops.host_kernels(True, kind="gemm") == "on"
    assert torch_tpu.ops.host_kernels("always") == "always"  # every size: even a 3 x 5 x 2 product
    _close(_rand(3, 5).to(DEV) @ _rand(5, 2).to(DEV), _rand(3, 5) @ _rand(5, 2))
    assert _configs(dump("end")) == [_cfg(0, 0, 0)]


def test_bad_kind() -> None:
    with pytest.raises(ValueError, match="kind must be 'conv' or 'gemm'"):
        torch_tpu.ops.host_kernels(True, kind="mm")
    with pytest.raises(ValueError, match="'always' applies to every kind"):
        torch_tpu.ops.host_kernels("always", kind="gemm")


def test_default_rule(dump: Callable[[str], str]) -> None:
    # No fixture: the GEMM kind is on by default and takes products of 2..128 rows from 2^18
    # multiply-adds (csrc/lowering/matmul.cc, host_gemm_wanted); one row or more than 128 rows stay
    # XLA dots.
    if torch_tpu.ops.host_kernels() != "on":
        pytest.skip("no host kernels here")
    assert torch_tpu.ops.host_kernels(None, kind="gemm") == "on"
    w, bias = _rand(520, 256), _rand(520)
    for rows, host_call in [(2, True), (128, True), (1, False), (129, False)]:
        x = _rand(rows, 256, seed=1)
        dump(f"rows{rows}")
        _close(F.linear(x.to(DEV), w.to(DEV), bias.to(DEV)), F.linear(x, w, bias))
        text = dump(f"next{rows}")
        if host_call:
            assert _configs(text) == [_cfg(0, 1, 1, 1.0, 1.0)] and "stablehlo.dot_general" not in text
        else:
            assert TARGET not in text and "stablehlo.dot_general" in text


# The two-thread split (csrc/aten/ffi_gemm.cc): from 2^22 multiply-adds on, the call cuts the output
# into two blocks (batch entries; else rows when m >= n; else columns), one per thread, with odd sizes
# that leave unequal blocks. Each block is a one-thread GEMM (oneDNN for rank 2, MKL for bmm), compared
# here with PyTorch CPU.
@pytest.mark.parametrize("m, k, n, ta, tb", [
    (127, 340, 100, False, True),  # rows, 64 + 63, the weight as stored
    (121, 360, 97, True, False),   # rows, a transposed lhs
    (9, 480, 1037, False, False),  # columns, 528 + 509
    (10, 448, 1001, True, True),   # columns, both operands transposed
    (4100, 1024, 1, False, False),  # n = 1 (rows; over 128 rows: "always")
])
def test_split_mm(host: None, dump: Callable[[str], str], m: int, k: int, n: int, ta: bool, tb: bool) -> None:
    assert m * k * n >= 1 << 22
    if m > 128:
        assert torch_tpu.ops.host_kernels("always") == "always"
    a = _rand(k, m).t() if ta else _rand(m, k)
    b = _rand(n, k, seed=1).t() if tb else _rand(k, n, seed=1)
    dump("split")
    _close(torch.mm(a.to(DEV), b.to(DEV)), torch.mm(a, b))
    assert _configs(dump("next")) == [_cfg(int(ta), int(tb), 0)]


def test_split_one_row(host: None, dump: Callable[[str], str]) -> None:
    # m = 1 takes the call only under "always" (one-row products stay XLA's); split by columns
    a, b = _rand(1, 4096), _rand(1100, 4096, seed=2)
    assert torch_tpu.ops.host_kernels("always") == "always"
    dump("gemv")
    _close(a.to(DEV) @ b.to(DEV).t(), a @ b.t())
    assert _configs(dump("next")) == [_cfg(0, 1, 0)]


@pytest.mark.parametrize("m, n", [(125, 120), (12, 1500)])  # rows; columns
def test_split_addmm_beta_alpha(host: None, dump: Callable[[str], str], m: int, n: int) -> None:
    # every addend shape; (beta, alpha) from the program-constant table (csrc/aten/host_operands.cc)
    a, b = _rand(m, 288), _rand(288, n, seed=3)
    cases = [((m, n), 1, 1), ((n,), 0.5, -2.0), ((1, n), 0, 3), ((m, 1), -1, -0.5), ((), 2, 1)]
    for i, (self_shape, beta, alpha) in enumerate(cases):
        s = _rand(*self_shape, seed=4)
        dump(f"addmm{i}")
        got = torch.addmm(s.to(DEV), a.to(DEV), b.to(DEV), beta=beta, alpha=alpha)
        _close(got, torch.addmm(s, a, b, beta=beta, alpha=alpha))
        assert _configs(dump(f"next{i}")) == [_cfg(0, 0, 1, float(alpha), float(beta))]


def test_split_bmm_baddbmm(host: None, dump: Callable[[str], str]) -> None:
    # batch 3: entries 2 + 1 (k as stored, trans_b); batch 1: its columns
    for batch, m, tb in [(3, 40, True), (1, 128, False)]:
        x, s = _rand(batch, m, 96), _rand(batch, 1, 400, seed=6)
        w = _rand(batch, 400, 96, seed=5).transpose(1, 2) if tb else _rand(batch, 96, 400, seed=5)
        dump(f"bmm{batch}")
        wd = w.contiguous().to(DEV) if not tb else _rand(batch, 400, 96, seed=5).to(DEV).transpose(1, 2)
        _close(torch.bmm(x.to(DEV), wd), torch.bmm(x, w))
        got = torch.baddbmm(s.to(DEV), x.to(DEV), wd, beta=0.5, alpha=2)
        _close(got, torch.baddbmm(s, x, w, beta=0.5, alpha=2))
        assert sorted(_configs(dump(f"next{batch}"))) == sorted([_cfg(0, int(tb), 0), _cfg(0, int(tb), 1, 2.0, 0.5)])


_WARM_CHILD = r"""
import json, torch, torch_tpu
import torch.nn.functional as F
g = torch.Generator().manual_seed(5)
x, w, b = torch.randn(96, 200, generator=g), torch.randn(152, 200, generator=g), torch.randn(152, generator=g)
n = len(torch_tpu.compile_stats()["graph_tiers"])
got = torch.compile(lambda t, ww, bb: torch.relu(F.linear(t, ww, bb)), backend="tpu")(
    x.to("tpu"), w.to("tpu"), b.to("tpu")).cpu()
tiers = [t["xla"] for t in torch_tpu.compile_stats()["graph_tiers"][n:]]
err = (got - torch.relu(F.linear(x, w, b))).abs().max().item()
print(json.dumps({"tiers": tiers, "err": err}))
"""


def test_compiled_host_gemm_from_disk_cache(host: None, tmp_path: Path) -> None:
    # A cached executable holding the custom call runs in a second process (the handler is
    # registered there before the executable is loaded from TORCH_TPU_CACHE_DIR).
    cache = str(tmp_path / "cache")
    dump = str(tmp_path / "dump")
    runs = []
    for env in ({"TORCH_TPU_CACHE_DIR": cache, "TORCH_TPU_DUMP_DIR": dump}, {"TORCH_TPU_CACHE_DIR": cache}):
        r = run_python(_WARM_CHILD, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    graphs = [t for t in _programs(Path(dump)) if t.startswith("// graph")]
    assert graphs and all(_configs(g) == [_cfg(0, 1, 1, 1.0, 1.0)] for g in graphs)
    assert "xla_compiled" in runs[0]["tiers"] and runs[1]["tiers"] and set(runs[1]["tiers"]) == {"xla_disk"}
    assert runs[0]["err"] < 1e-3 and runs[1]["err"] < 1e-3
