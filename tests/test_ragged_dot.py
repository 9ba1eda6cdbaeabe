"""torch.tpu.ops.ragged_dot / ragged_dot_weight_grad against the per-group loop on the CPU: forward,
weight gradient, autograd, compiled graphs, no host sync, every window of the lowered path, the
host kernel of the CPU plugin (an XLA FFI custom call) in strict, fused and compiled programs, the
Pallas kernel, and bad input."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch
import torch_tpu

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
       torch.float16: dict(atol=1e-2, rtol=1e-2)}


def _loop(lhs: torch.Tensor, rhs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    out, start = torch.zeros(lhs.shape[0], rhs.shape[2]), 0
    for g, n in enumerate(sizes):
        out[start:start + n] = lhs[start:start + n].float() @ rhs[g].float()
        start += n
    return out


def _wgrad_loop(lhs: torch.Tensor, grad: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    out, start = torch.zeros(len(sizes), lhs.shape[1], grad.shape[1]), 0
    for g, n in enumerate(sizes):
        out[g] = lhs[start:start + n].float().t() @ grad[start:start + n].float()
        start += n
    return out


@pytest.fixture(params=["host", "xla"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU plugin's host kernel, then the XLA lowering, for the same test."""
    if request.param == "host" and torch.tpu.ops.host_kernels().startswith("unavailable"):
        pytest.skip("no host kernels here")  # test_host_kernels_registered says whether that is expected
    torch.tpu.ops.host_kernels("always" if request.param == "host" else False)  # tiny shapes: every size
    yield request.param
    torch.tpu.ops.host_kernels(True)


@pytest.fixture
def restore_host_kernels() -> Iterator[None]:
    yield
    torch.tpu.ops.host_kernels(True)


CASES = [
    (12, [3, 0, 5, 2]),            # empty group, two rows past the groups
    (2, [0, 1, 0, 0, 0, 1, 0, 0]),  # decode: fewer rows than experts (per-row weight gather)
    (40, [1, 35, 0, 4]),            # one large group: a wide window
    (16, [16]),                      # a single group
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,sizes", CASES)
def test_forward_and_weight_grad(dtype: torch.dtype, m: int, sizes: list[int], path: str) -> None:
    g = torch.Generator().manual_seed(m)
    lhs = torch.randn(m, 16, generator=g).to(dtype)
    rhs = torch.randn(len(sizes), 16, 24, generator=g).to(dtype)
    grad = torch.randn(m, 24, generator=g).to(dtype)
    gs = torch.tensor(sizes, dtype=torch.int32)
    torch_tpu.reset_fallback_stats()
    torch_tpu.synchronize()
    syncs = torch_tpu.dispatch_stats()["host_syncs"]
    out = torch.tpu.ops.ragged_dot(lhs.to("tpu"), rhs.to("tpu"), gs.to("tpu"))
    wg = torch.tpu.ops.ragged_dot_weight_grad(lhs.to("tpu"), grad.to("tpu"), gs.to("tpu"))
    # rhs as a transposed [G, N, K] view (nn.Linear-layout experts): contracted in its own layout
    out_t = torch.tpu.ops.ragged_dot(lhs.to("tpu"), rhs.transpose(1, 2).contiguous().to("tpu").transpose(1, 2),
                                     gs.to("tpu"))
    assert torch_tpu.dispatch_stats()["host_syncs"] == syncs
    torch.testing.assert_close(out_t.cpu().float(), _loop(lhs, rhs, sizes), **TOL[dtype])
    assert out.dtype == dtype and out.shape == (m, 24) and wg.shape == (len(sizes), 16, 24)
    torch.testing.assert_close(out.cpu().float(), _loop(lhs, rhs, sizes), **TOL[dtype])
    torch.testing.assert_close(wg.cpu().float(), _wgrad_loop(lhs, grad, sizes), **TOL[dtype])
    # the CPU kernel of the op agrees with the loop too
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(lhs, rhs, gs).float(), _loop(lhs, rhs, sizes), **TOL[dtype])
    assert torch_tpu.fallback_stats() == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_threaded_column_blocks_strided_and_empty_k(dtype: torch.dtype, path: str) -> None:
    """Shapes the host kernel splits over two threads (>= 2**22 multiply-adds) and into column blocks
    (N >= 256), on every dtype's GEMM (bfloat16/float16: MKL's mixed GEMMs where ATen has no native
    kernel for them): an empty group, 5 rows past the groups, a strided lhs (a column slice of a wider
    tensor), nn.Linear-layout experts (a transposed view), and K = 0 (zeros)."""
    g = torch.Generator().manual_seed(7)
    sizes = [20, 0, 1, 38]
    wide = torch.randn(64, 512, generator=g).to(dtype)
    lhs = wide[:, ::2]  # [64, 256], strided
    rhs = (torch.randn(4, 256, 384, generator=g) / 16).to(dtype)
    grad = torch.randn(64, 384, generator=g).to(dtype)
    gs = torch.tensor(sizes, dtype=torch.int32).to("tpu")
    lt = wide.to("tpu")[:, ::2]
    rl = rhs.transpose(1, 2).contiguous().to("tpu")  # [G, N, K] storage
    out = torch.tpu.ops.ragged_dot(lt, rhs.to("tpu"), gs)
    out_t = torch.tpu.ops.ragged_dot(lt, rl.transpose(1, 2), gs)
    wg = torch.tpu.ops.ragged_dot_weight_grad(lt, grad.to("tpu"), gs)
    # the op's CPU kernel: float32 products, rounded once to the dtype, as both GEMMs do
    ref, ref_w = torch.ops.torch_tpu.ragged_dot(lhs, rhs, gs.cpu()), torch.ops.torch_tpu.ragged_dot_weight_grad(
        lhs, grad, gs.cpu())
    assert out.dtype == dtype and wg.dtype == dtype
    torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])
    torch.testing.assert_close(out_t.cpu(), ref, **TOL[dtype])
    torch.testing.assert_close(wg.cpu(), ref_w, **TOL[dtype])
    assert out.cpu()[59:].abs().max() == 0 and wg.cpu()[1].abs().max() == 0
    empty = torch.tpu.ops.ragged_dot(torch.ones(6, 0, dtype=dtype).to("tpu"), torch.ones(2, 0, 3, dtype=dtype).to("tpu"),
                                     torch.tensor([2, 3], dtype=torch.int32).to("tpu"))
    torch.testing.assert_close(empty.cpu(), torch.zeros(6, 3, dtype=dtype))


def test_float32_whole_group_tasks(path: str) -> None:
    """float32 groups of >= 2**20 multiply-adds run oneDNN's matmul in the host kernel (whole groups
    as the threads' tasks, largest first), the smaller ones and single rows MKL's sgemm: eight groups
    of 0..30 rows (decode routing), rows past the groups, both weight layouts and the weight gradient."""
    g = torch.Generator().manual_seed(11)
    sizes = [16, 1, 0, 22, 3, 30, 2, 18]
    lhs, rhs = torch.randn(96, 256, generator=g), torch.randn(8, 256, 512, generator=g) / 16
    grad = torch.randn(96, 512, generator=g)
    gs = torch.tensor(sizes, dtype=torch.int32)
    lt, st = lhs.to("tpu"), gs.to("tpu")
    ref = torch.ops.torch_tpu.ragged_dot(lhs, rhs, gs)
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(lt, rhs.to("tpu"), st).cpu(), ref, **TOL[torch.float32])
    rl = rhs.transpose(1, 2).contiguous().to("tpu")  # nn.Linear layout [G, N, K], a transposed view
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(lt, rl.transpose(1, 2), st).cpu(), ref, **TOL[torch.float32])
    wg = torch.tpu.ops.ragged_dot_weight_grad(lt, grad.to("tpu"), st).cpu()
    torch.testing.assert_close(wg, torch.ops.torch_tpu.ragged_dot_weight_grad(lhs, grad, gs), **TOL[torch.float32])
    assert wg[2].abs().max() == 0


@pytest.mark.parametrize("sizes", [[5, 5, 5, 5], [3, -2, 20, 5]])
def test_groups_past_the_rows_and_negative_sizes(sizes: list[int], path: str) -> None:
    """sum(group_sizes) > M and negative sizes: the groups are clipped to the M rows and a negative
    size counts as 0, as in the op's CPU kernel, so a group with no rows gets a zero weight gradient
    (the XLA path's weight-gradient windows read another group's rows before)."""
    g = torch.Generator().manual_seed(0)
    lhs, rhs, grad = torch.randn(12, 3, generator=g), torch.randn(4, 3, 2, generator=g), torch.randn(12, 2, generator=g)
    gs = torch.tensor(sizes)
    ref, ref_w = torch.ops.torch_tpu.ragged_dot(lhs, rhs, gs), torch.ops.torch_tpu.ragged_dot_weight_grad(lhs, grad, gs)
    got = torch.tpu.ops.ragged_dot(lhs.to("tpu"), rhs.to("tpu"), gs.to("tpu")).cpu()
    got_w = torch.tpu.ops.ragged_dot_weight_grad(lhs.to("tpu"), grad.to("tpu"), gs.to("tpu")).cpu()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_w, ref_w)


def test_host_kernels_registered() -> None:
    # On the CPU plugin with jaxlib's XLA FFI headers at build time the FFI handlers must register
    # (and pass their probe call); anywhere else the status says why not.
    status = torch.tpu.ops.host_kernels()
    ffi_headers = importlib.util.find_spec("jaxlib") is not None
    if torch_tpu._C._platform()["platform_name"] == "cpu" and ffi_headers \
            and os.environ.get("TORCH_TPU_HOST_KERNELS") != "0":
        assert status == "on", status
    else:
        assert status.startswith("unavailable: "), status
    with pytest.raises(TypeError, match="host_kernels: enabled must be a bool, 'always' or None"):
        torch.tpu.ops.host_kernels(1)  # type: ignore[arg-type]


def _programs(dump: str) -> str:
    return "".join(open(os.path.join(dump, f)).read() for f in sorted(os.listdir(dump)))


def test_host_kernel_in_strict_fused_and_compiled_programs(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                                                           restore_host_kernels: None) -> None:
    if torch.tpu.ops.host_kernels() != "on":
        pytest.skip("no host kernels here")
    dumps = [str(tmp_path / n) for n in ("strict", "fused", "compiled", "off", "by_size")]  # type: ignore[operator]
    # by default (float32) from 2**20 multiply-adds or 2**21 weights (below, XLA's dot is as fast):
    # 256 x 256 x 256 takes it
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", dumps[4])
    big, wbig = torch.randn(256, 256), torch.randn(2, 256, 256)
    gbig = torch.tensor([200, 56], dtype=torch.int64)  # int64 sizes go to the kernel as they are
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(big.to("tpu"), wbig.to("tpu"), gbig.to("tpu")).cpu(),
                               _loop(big, wbig, [200, 56]), atol=1e-3, rtol=1e-4)
    small, wsmall = torch.randn(64, 64), torch.randn(2, 64, 128)
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(small.to("tpu"), wsmall.to("tpu"), (gbig // 4).to("tpu")).cpu(),
                               _loop(small, wsmall, [50, 14]), atol=1e-3, rtol=1e-4)
    # few rows against large experts (decode batch 1, 2**22 weights) take it however few the MACs
    few, wide = torch.randn(1, 512), torch.randn(8, 512, 1024)
    gfew = torch.tensor([0, 0, 0, 0, 0, 1, 0, 0], dtype=torch.int32)
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(few.to("tpu"), wide.to("tpu"), gfew.to("tpu")).cpu(),
                               _loop(few, wide, gfew.tolist()), atol=1e-3, rtol=1e-4)
    # bfloat16 pays oneDNN's setup per group: 2**21 MACs over 8 experts of 128 x 256 stay on XLA
    mid, wmid = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(8, 128, 256, dtype=torch.bfloat16)
    gmid = torch.tensor([8] * 8, dtype=torch.int32)
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(mid.to("tpu"), wmid.to("tpu"), gmid.to("tpu")).cpu(),
                               _loop(mid.float(), wmid.float(), [8] * 8).bfloat16(), atol=0.1, rtol=0.02)
    text = _programs(dumps[4])
    assert text.count('"torch_tpu.ragged_dot"') == 2  # the 64-row f32 call (2**19 MACs) and bf16 one took XLA
    assert torch.tpu.ops.host_kernels("always") == "always"  # the small shapes below
    sizes = [6, 0, 9, 3]  # shapes no other test uses: every program below is compiled fresh
    lhs, rhs, grad = torch.randn(21, 12), torch.randn(4, 12, 10), torch.randn(21, 10)
    gs = torch.tensor(sizes, dtype=torch.int32)
    lt, rt, gt, st = lhs.to("tpu"), rhs.to("tpu"), grad.to("tpu"), gs.to("tpu")
    want, want_w = _loop(lhs, rhs, sizes), _wgrad_loop(lhs, grad, sizes)
    torch_tpu.synchronize()
    syncs = torch_tpu.dispatch_stats()["host_syncs"]
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", dumps[0])
    out, wg = torch.tpu.ops.ragged_dot(lt, rt, st), torch.tpu.ops.ragged_dot_weight_grad(lt, gt, st)
    assert torch_tpu.dispatch_stats()["host_syncs"] == syncs
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(wg.cpu(), want_w, atol=1e-4, rtol=1e-4)
    text = _programs(dumps[0])
    assert '"torch_tpu.ragged_dot"' in text and '"torch_tpu.ragged_dot_wgrad"' in text
    # fused eager: the custom call is one node of the fused program
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", dumps[1])
    torch_tpu.synchronize()
    with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
        before = torch_tpu.dispatch_stats()["launches"]
        got = (torch.tpu.ops.ragged_dot(lt * 2, rt, st) + 1).cpu()
        assert torch_tpu.dispatch_stats()["launches"] - before == 1
    torch.testing.assert_close(got, _loop(lhs * 2, rhs, sizes) + 1, atol=1e-4, rtol=1e-4)
    assert '"torch_tpu.ragged_dot"' in _programs(dumps[1])
    # compiled: forward and backward graphs call the kernel (backward: rhs^T and the weight grad)
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", dumps[2])

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.tpu.ops.ragged_dot(a, b, c).tanh().sum()

    la, ra = lt.clone().requires_grad_(), rt.clone().requires_grad_()
    torch.compile(f, backend="tpu", fullgraph=True)(la, ra, st).backward()
    lc, rc = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    f(lc, rc, gs).backward()
    torch.testing.assert_close(la.grad.cpu(), lc.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ra.grad.cpu(), rc.grad, atol=1e-4, rtol=1e-4)
    text = _programs(dumps[2])
    assert '"torch_tpu.ragged_dot"' in text and '"torch_tpu.ragged_dot_wgrad"' in text
    # nn.Linear-layout experts in a graph: the transpose node marks the weight column-major, so the
    # kernel reads the parameter in place (no transposed copy)
    wl = torch.randn(4, 10, 12)
    offs = torch.tensor([6, 6, 15, 18], dtype=torch.int32)

    def g(a: torch.Tensor, w: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=o)

    got = torch.compile(g, backend="tpu", fullgraph=True)(lt, wl.to("tpu"), offs.to("tpu")).cpu()
    torch.testing.assert_close(got[:18], g(lhs, wl, offs)[:18], atol=1e-4, rtol=1e-4)
    assert "rhs_col_major = 1" in _programs(dumps[2])
    # switched off: a new plan on the XLA path, same numbers
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", dumps[3])
    assert torch.tpu.ops.host_kernels(False) == "off"
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(lt, rt, st).cpu(), want, atol=1e-4, rtol=1e-4)
    assert "custom_call" not in _programs(dumps[3])


def test_backward_matches_cpu() -> None:
    sizes = [5, 0, 7, 4]
    lhs, rhs = torch.randn(18, 8), torch.randn(4, 8, 6)
    gs = torch.tensor(sizes, dtype=torch.int32)
    lt, rt = lhs.to("tpu").requires_grad_(), rhs.to("tpu").requires_grad_()
    (torch.tpu.ops.ragged_dot(lt, rt, gs.to("tpu")) ** 2).sum().backward()
    lc, rc = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    (torch.tpu.ops.ragged_dot(lc, rc, gs) ** 2).sum().backward()
    torch.testing.assert_close(lt.grad.cpu(), lc.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rt.grad.cpu(), rc.grad, atol=1e-4, rtol=1e-4)


def test_compiled_graph() -> None:
    import warnings

    sizes = [4, 4, 0, 8]
    lhs, rhs, gs = torch.randn(16, 8), torch.randn(4, 8, 6), torch.tensor(sizes, dtype=torch.int32)

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.tpu.ops.ragged_dot(a, b, c).relu().sum()

    lt, rt = lhs.to("tpu").requires_grad_(), rhs.to("tpu").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the graph compiles as one program
        torch.compile(f, backend="tpu", fullgraph=True)(lt, rt, gs.to("tpu")).backward()
    lc, rc = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    f(lc, rc, gs).backward()
    torch.testing.assert_close(lt.grad.cpu(), lc.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rt.grad.cpu(), rc.grad, atol=1e-4, rtol=1e-4)


def test_pallas_kernel_matches() -> None:
    pytest.importorskip("jax")
    sizes = [3, 0, 9, 2]
    lhs, rhs, gs = torch.randn(16, 16), torch.randn(4, 16, 8), torch.tensor(sizes, dtype=torch.int32)
    out = torch.tpu.ops.ragged_dot(lhs.to("tpu"), rhs.to("tpu"), gs.to("tpu"), impl="pallas")
    torch.testing.assert_close(out.cpu(), _loop(lhs, rhs, sizes), atol=1e-4, rtol=1e-4)
    lt = lhs.to("tpu").requires_grad_()
    torch.tpu.ops.ragged_dot(lt, rhs.to("tpu"), gs.to("tpu"), impl="pallas").sum().backward()
    lc = lhs.clone().requires_grad_()
    torch.tpu.ops.ragged_dot(lc, rhs, gs).sum().backward()
    torch.testing.assert_close(lt.grad.cpu(), lc.grad, atol=1e-4, rtol=1e-4)


def test_bad_input() -> None:
    t = torch.randn(4, 8).to("tpu")
    w = torch.randn(2, 8, 3).to("tpu")
    gs = torch.tensor([2, 2], dtype=torch.int32).to("tpu")
    with pytest.raises(TypeError, match="ragged_dot: lhs and rhs must share one dtype"):
        torch.tpu.ops.ragged_dot(t.double(), w.double(), gs)
    with pytest.raises(TypeError, match="group_sizes must be a 1-D int32/int64"):
        torch.tpu.ops.ragged_dot(t, w, gs.float())
    with pytest.raises(ValueError, match=r"rhs must be \[G, K, N\]"):
        torch.tpu.ops.ragged_dot(t, torch.randn(3, 8, 3).to("tpu"), gs)
    with pytest.raises(ValueError, match="one device"):
        torch.tpu.ops.ragged_dot(t, w, gs.cpu())
    with pytest.raises(ValueError, match="impl must be"):
        torch.tpu.ops.ragged_dot(t, w, gs, impl="cuda")
