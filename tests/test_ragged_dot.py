"""torch.tpu.ops.ragged_dot / ragged_dot_weight_grad against the per-group loop on the CPU: forward,
weight gradient, autograd, compiled graphs, no host sync, every window of the lowered path, the
Pallas kernel, and bad input."""

from __future__ import annotations

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


CASES = [
    (12, [3, 0, 5, 2]),            # empty group, two rows past the groups
    (2, [0, 1, 0, 0, 0, 1, 0, 0]),  # decode: fewer rows than experts (per-row weight gather)
    (40, [1, 35, 0, 4]),            # one large group: a wide window
    (16, [16]),                      # a single group
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,sizes", CASES)
def test_forward_and_weight_grad(dtype: torch.dtype, m: int, sizes: list[int]) -> None:
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
