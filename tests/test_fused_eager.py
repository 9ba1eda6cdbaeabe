"""Fused eager (DEFER_AND_FUSE) has exactly strict eager's semantics; loops compile once."""

from __future__ import annotations

import torch
import torch_tpu
from torch_tpu import EagerMode, set_eager_mode


def _program(x: torch.Tensor) -> torch.Tensor:
    y = torch.nn.functional.gelu(x * 1.5 + 0.25) * torch.sigmoid(x)
    y[1:3].add_(1.0)
    y.t()[2].mul_(-2.0)
    z = y[:, ::2].clone()
    y[:, 1::2] = z.exp()
    return y + y.square().mean(-1, keepdim=True)


def test_fused_matches_strict_and_cpu() -> None:
    torch_tpu.reset_fallback_stats()  # earlier tests in the session may have used the fallback
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    ref = _program(x.clone())
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        out = _program(x.to("tpu"))
        got = out.cpu()
    strict = _program(x.to("tpu")).cpu()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, strict, atol=1e-6, rtol=1e-6)
    assert torch_tpu.fallback_stats() == {}


def test_fused_loop_body_compiles_once_and_scalars_are_operands() -> None:
    # Values outside the constant table (-2, -1, -0.5, 0, 0.5, 1, 2: program constants, see
    # tests/test_dispatch_cache.py) are operands.
    x = torch.randn(5, 7, device="tpu")
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        for s in (1.5, 2.5):
            ((x * s + s).relu().sum()).item()
        before = torch_tpu.cache_stats()
        for s in (3.0, -4.0, 0.25):
            v = ((x * s + s).relu().sum()).item()
        after = torch_tpu.cache_stats()
    assert after["misses"] == before["misses"] and after["disk_hits"] == before["disk_hits"]
    assert abs(v - (x.cpu() * 0.25 + 0.25).relu().sum().item()) < 1e-4


def test_fused_trace_keys_tell_structures_apart() -> None:
    # Same ops, different storage wiring or sizes: each structure gets its own program; a structure
    # seen before is found by its trace key alone (no program text built: no memory-cache lookup).
    bodies = [lambda a, b: a * b + b, lambda a, b: a * b + a, lambda a, b: (a * b) * b,
              lambda a, b: (a * b).add_(a), lambda a, b: a * b]
    xs = [(torch.randn(16), torch.randn(16)), (torch.randn(17), torch.randn(17))]
    for rnd in range(2):
        before = torch_tpu.cache_stats()
        with set_eager_mode(EagerMode.DEFER_AND_FUSE):
            for a, b in xs:
                ta, tb = a.to("tpu"), b.to("tpu")
                for body in bodies:
                    torch.testing.assert_close(body(ta, tb).cpu(), body(a.clone(), b), rtol=1e-6, atol=1e-6)
        after = torch_tpu.cache_stats()
        if rnd:
            assert after["misses"] == before["misses"] and after["memory_hits"] == before["memory_hits"]


def test_fused_rng_matches_strict() -> None:
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        torch.manual_seed(11)
        a = (torch.rand(100, device="tpu") * 2).cpu()
    torch.manual_seed(11)
    b = (torch.rand(100, device="tpu") * 2).cpu()
    assert torch.equal(a, b)


def test_fused_sync_points_and_fallback_ops() -> None:
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        x = torch.arange(12.0, device="tpu").reshape(3, 4)
        x.add_(1)
        assert x[0, 0].item() == 1.0  # host read flushes
        m = x > 6
        sel = x[m]  # data-dependent: flush + one host sync
        assert torch.equal(sel.cpu(), torch.arange(7.0, 13.0))
        cpu = torch.ones(3, 4)
        x.copy_(cpu)  # host upload into a tensor with pending work
        x.mul_(3)
        torch.tpu.synchronize()
        assert torch.equal(x.cpu(), torch.full((3, 4), 3.0))


def test_fused_many_ops_hit_the_size_limit() -> None:
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        x = torch.zeros(4, device="tpu")
        for _ in range(1200):
            x = x + 1
        assert torch.equal(x.cpu(), torch.full((4,), 1200.0))


def _small_chain(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    y = a.clone()
    for i in range(40):  # ~160 small ops: more than XLA:CPU runs inline in one program
        y = y * c + b
        y[i % 4 :: 4].mul_(0.5)  # in-place through a view, across piece boundaries
        a.add_(y[: a.numel()])
    return y.sum() + a.sum()


def test_fused_small_ops_launch_in_inline_pieces() -> None:
    # A pending program of many small ops is launched in pieces small enough for XLA:CPU to run on
    # the caller's thread; results, in-place writes and views stay exactly strict eager's.
    a, b, c = torch.randn(16), torch.randn(16), torch.rand(16)
    ref_a = a.clone()
    ref = _small_chain(ref_a, b, c)
    for rnd in range(2):
        ta = a.to("tpu")
        before = torch_tpu.dispatch_stats()["launches"]
        misses = torch_tpu.cache_stats()["misses"]
        with set_eager_mode(EagerMode.DEFER_AND_FUSE):
            got = _small_chain(ta, b.to("tpu"), c.to("tpu")).item()
        pieces = torch_tpu.dispatch_stats()["launches"] - before
        assert pieces >= 3, pieces
        assert abs(got - ref.item()) < 1e-4 * max(1.0, abs(ref.item()))
        torch.testing.assert_close(ta.cpu(), ref_a, rtol=1e-5, atol=1e-5)
        if rnd:  # the same op sequence splits the same way: no new program
            assert torch_tpu.cache_stats()["misses"] == misses
    # Large ops are not split: the block stays one program.
    x = torch.randn(64, 64, device="tpu")
    before = torch_tpu.dispatch_stats()["launches"]
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        for _ in range(20):
            x = x * 0.5 + 1.0
        torch.tpu.synchronize()
    assert torch_tpu.dispatch_stats()["launches"] - before == 1


def test_fused_never_written_storages_read_as_zeros_without_upload() -> None:
    # Fresh memory reads as zeros (as in strict eager); in fused eager the pending program makes the
    # zeros itself instead of uploading a zero buffer, so factories are one recorded op each.
    def body(dev: str) -> list[torch.Tensor]:
        z = torch.zeros(6, device=dev)
        z[::2] = 1.0  # a partial write: the rest of the storage is read
        e = torch.empty(4, dtype=torch.int32, device=dev)
        ints = torch.zeros(5, dtype=torch.int64, device=dev) + torch.full((5,), 3, device=dev)
        flags = torch.zeros(3, dtype=torch.bool, device=dev) | (torch.full((3,), 2.0, device=dev) > 1)
        s = torch.scalar_tensor(2.5, device=dev) * torch.ones(2, device=dev)
        return [z, e.view(torch.float32) * 0, ints, flags, s]

    ref = body("cpu")
    ref[1] = torch.zeros(4)  # CPU's empty() is uninitialized (NaN bits happen); ours reads as zeros
    strict = [t.cpu() for t in body("tpu")]
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        launches = torch_tpu.dispatch_stats()["launches"]
        fused = body("tpu")
        assert torch_tpu.dispatch_stats()["launches"] == launches  # all pending, nothing launched
        fused = [t.cpu() for t in fused]
    for r, a, b in zip(ref, strict, fused, strict=True):
        torch.testing.assert_close(a, r)
        torch.testing.assert_close(b, r)


def test_item_reads_a_one_element_storage_like_cpu() -> None:
    # .item() of a whole one-element storage reads it directly; views and other storages copy.
    cases = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
             torch.int8, torch.uint8, torch.bool]
    for mode in (EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE):
        with set_eager_mode(mode):
            for dt in cases:
                c = (torch.arange(5) - 2).to(dt)
                t = c.to("tpu")
                for f in (lambda x: x.max(), lambda x: x[3], lambda x: x.view(5)[4:5].reshape(())):
                    a, b = f(c).item(), f(t).item()
                    assert type(a) is type(b) and a == b, (mode, dt, a, b)
            x = torch.full((1,), 3.5, device="tpu")
            x.add_(1)
            assert x.item() == 4.5


def test_factories_whose_scalars_decide_the_shape() -> None:
    # arange's metadata is cached with its scalar values and the default dtype (its meta function
    # is Python, ~60 us a call); arange(out=) is never served by the dispatch cache, whose
    # signature leaves scalar values out.
    for mode in (EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE):
        with set_eager_mode(mode):
            for n in (5, 7, 5, 9):
                torch.testing.assert_close(torch.arange(n, device="tpu").cpu(), torch.arange(n))
                torch.testing.assert_close(torch.arange(0.5, n, 1.5, device="tpu").cpu(), torch.arange(0.5, n, 1.5))
                out = torch.empty(0, dtype=torch.int64, device="tpu")
                assert torch.arange(2, n, out=out) is out
                torch.testing.assert_close(out.cpu(), torch.arange(2, n))
            default = torch.get_default_dtype()
            try:
                for dt in (torch.float64, torch.float32):
                    torch.set_default_dtype(dt)
                    assert torch.arange(0.5, 3.0, device="tpu").dtype == dt
                    assert torch.full((2,), 1.5, device="tpu").dtype == dt
            finally:
                torch.set_default_dtype(default)


def test_fused_flush_reasons_are_counted() -> None:
    def counts() -> dict[str, int]:
        return dict(torch_tpu._C._fused_flush_stats())

    a = torch.ones(16, device="tpu")
    before = counts()
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        x = a
        for _ in range(100):  # 200 small ops: launched in inline pieces
            x = x * 1.01 + 0.1
        x.sum().item()  # a host read
        y = a + 1  # pending when the mode is left
    after = counts()
    assert after["inline_split"] >= before["inline_split"] + 2
    assert after["host_transfer"] == before["host_transfer"] + 1
    assert after["synchronize"] == before["synchronize"] + 1
    torch.testing.assert_close(y.cpu(), torch.full((16,), 2.0))
