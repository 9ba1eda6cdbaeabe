"""The dispatch cache (csrc/aten/dispatch_cache.h) serves ops with tensor-list arguments and random
ops too: each cached call binds its own list elements, scalar lists and generator state."""

from __future__ import annotations

import torch
import torch_tpu
from torch_tpu import EagerMode, set_eager_mode


def _served() -> int:
    return int(torch_tpu._C._dispatch_cache_stats()["hits"])


def _offset(gen: torch.Generator | None = None) -> int:
    state = gen.get_state() if gen is not None else torch.tpu.get_rng_state()
    return int(state[8:].view(torch.int64).item())


def test_tensor_list_ops_take_the_cache_and_bind_each_calls_elements() -> None:
    for mode in (EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE):
        with set_eager_mode(mode):
            before = _served()
            for k in range(3):  # fresh storages per iteration, same signature
                ac, bc = torch.arange(4.0) + k, torch.full((3,), -float(k))
                a, b = ac.to("tpu"), bc.to("tpu")
                assert torch.equal(torch.cat([a, b]).cpu(), torch.cat([ac, bc]))
                assert torch.equal(torch.cat([a, a]).cpu(), torch.cat([ac, ac]))  # one storage twice
                assert torch.equal(torch.stack([a, a * 2]).cpu(), torch.stack([ac, ac * 2]))
                idx_c = torch.tensor([3, 0, k])
                assert torch.equal(a[idx_c.to("tpu")].cpu(), ac[idx_c])  # index: Tensor?[]
                m = torch.zeros(3, 4, device="tpu")
                assert torch.equal(m[:, idx_c.to("tpu")].cpu(), torch.zeros(3, 4)[:, idx_c])  # [None, idx]
                xs_c = [torch.arange(3.0) * (i + 1) for i in range(8)]
                xs = [x.to("tpu") for x in xs_c]
                torch._foreach_add_(xs, [x.to("tpu") for x in xs_c])
                torch._foreach_add_(xs_c, xs_c)
                scalars = [0.5 * (i + k) for i in range(8)]  # ScalarList: runtime operands
                torch._foreach_mul_(xs, scalars)
                torch._foreach_mul_(xs_c, scalars)
                for x, xc in zip(xs, xs_c, strict=True):
                    assert torch.equal(x.cpu(), xc)
                outs = torch._foreach_add(xs, 1.5)  # one list of fresh tensors
                for o, xc in zip(outs, xs_c, strict=True):
                    assert torch.equal(o.cpu(), xc + 1.5)
            assert _served() - before >= 2 * 9  # the 2nd and 3rd iterations: every op above
    # A bool mask still takes the host path (its integer indices depend on the data).
    xc = torch.arange(5.0)
    for _ in range(2):
        assert torch.equal(xc.to("tpu")[(xc > 1).to("tpu")].cpu(), xc[xc > 1])


def test_random_ops_take_the_cache_and_draw_per_call() -> None:
    x = torch.ones(1000, device="tpu")
    torch.nn.functional.dropout(x, 0.5, True)  # fills the cache
    before, start = _served(), _offset()
    masks = [torch.nn.functional.dropout(x, 0.5, True).cpu() for _ in range(3)]
    assert _served() - before == 3
    per_call = (_offset() - start) // 3
    assert per_call > 0 and _offset() - start == 3 * per_call  # the full path's count, every call
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    torch.tpu.manual_seed(5)
    first = [torch.nn.functional.dropout(x, 0.5, True).cpu(), torch.rand(7, device="tpu").cpu()]
    torch.tpu.manual_seed(5)
    again = [torch.nn.functional.dropout(x, 0.5, True).cpu(), torch.rand(7, device="tpu").cpu()]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # An explicit generator is drawn from, not the device's, on the cached path too.
    g = torch.Generator(device="tpu").manual_seed(3)
    y = torch.zeros(16, device="tpu")  # (a written storage: one signature from the start)
    y.normal_(generator=g)
    before, start, g_start = _served(), _offset(), _offset(g)
    a = y.normal_(generator=g).cpu()
    assert _served() - before == 1 and _offset() == start and _offset(g) > g_start
    g.manual_seed(3)
    y.normal_(generator=g)
    assert torch.equal(y.normal_(generator=g).cpu(), a)
    # Eval-mode dropout draws nothing (a cached call either).
    for _ in range(2):
        start = _offset()
        assert torch.equal(torch.native_dropout(x, 0.5, False)[0].cpu(), torch.ones(1000))
        assert _offset() == start


def test_small_integral_scalars_are_constants_other_values_operands() -> None:
    # pow(x, 3.0): 3 is a program constant, so XLA emits x*x*x as ATen's CPU kernel does: equal
    # bitwise, and no scalar pow per element (GPT-2's GELU cube ran ~13x slower as an operand).
    xc = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10
    x = xc.to("tpu")
    for e in (3.0, 3, 2.0):
        assert torch.equal(torch.pow(x, e).cpu(), torch.pow(xc, e))
    assert torch.equal((x + 3).cpu(), xc + 3)
    # Any other value is a runtime operand: a new value is served by the same remembered call.
    xa = x.abs()
    assert torch.allclose(torch.pow(xa, 3.5).cpu(), torch.pow(xc.abs(), 3.5))
    before = _served()
    assert torch.allclose(torch.pow(xa, 4.5).cpu(), torch.pow(xc.abs(), 4.5))
    assert _served() - before == 1


def test_python_scalars_of_tensor_overloads_follow_the_constant_table() -> None:
    # `x + 1` passes 1 to add.Tensor as a wrapped-number CPU tensor: a table value is a program
    # constant as for a Scalar argument (one program per value, one launch argument less), any
    # other value an operand (one program for all). 3 stays an operand here: XLA turns x / 3 into
    # x * (1/3), which is not CPU's division.
    xc = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 10
    x = xc.to("tpu")
    for f in (lambda t: t + 1, lambda t: t * 0.5, lambda t: t / -2, lambda t: t - 2, lambda t: t / 3,
              lambda t: t * 3, lambda t: t / 7, lambda t: 2 * t, lambda t: t.long() // 2, lambda t: t.long() + 3):
        assert torch.equal(f(x).cpu(), f(xc))
    def texts() -> int:  # program texts built (compiled, or found in the memory or disk cache)
        st = torch_tpu.cache_stats()
        return int(st["misses"] + st["memory_hits"] + st["disk_hits"])

    y = torch.randn(333, device="tpu")
    before = texts()
    for s in (1.0, 2.0, -1.0):
        assert torch.equal((y * s).cpu(), y.cpu() * s)
    assert texts() - before == 3  # constants: a program each
    before = texts()
    for s in (1.25, 2.25, 3.0, 7.0):
        assert torch.equal((y * s).cpu(), y.cpu() * s)
    assert texts() - before == 1  # operands: one program


def test_matmul_precision_reaches_cached_contractions_only(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The signature leaves the matmul precision out: a cached add is served whatever the setting,
    # while a cached mm planned at another precision is planned (and built) again at the new one.
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(3)
    ac, bc, xc = torch.randn(3, 13, generator=g), torch.randn(13, 6, generator=g), torch.randn(7, generator=g)
    a, b, x = ac.to("tpu"), bc.to("tpu"), xc.to("tpu")
    prev = torch.get_float32_matmul_precision()
    try:
        for _ in range(2):  # remembered, then served
            torch.mm(a, b)
            x + 1
        before = _served()
        torch.set_float32_matmul_precision("medium")
        torch.mm(a, b)  # planned again: DEFAULT
        assert torch.equal((x + 1).cpu(), xc + 1)  # served
        assert _served() - before == 1
        torch.set_float32_matmul_precision("highest")
        out = torch.mm(a, b).cpu()  # planned again: HIGHEST, equal to CPU
        torch.testing.assert_close(out, ac @ bc)
        mm = [f.read_text() for f in tmp_path.glob("*.mlir") if "stablehlo.dot_general" in f.read_text()]
        assert any("#stablehlo<precision DEFAULT>" in t for t in mm), mm
    finally:
        torch.set_float32_matmul_precision(prev)
