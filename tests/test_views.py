"""Views are metadata; reads and in-place writes through any strides behave exactly as on CPU."""

from __future__ import annotations

import torch
import torch_tpu
from hypothesis import given, settings
from hypothesis import strategies as st


def same(t: torch.Tensor, c: torch.Tensor) -> None:
    assert t.device.type == "tpu"
    torch.testing.assert_close(t.cpu(), c, rtol=1e-6, atol=1e-6, check_dtype=True)


def test_views_share_storage_and_do_no_device_work() -> None:
    x = torch.arange(24.0, device="tpu").reshape(4, 6)
    before = torch_tpu.dispatch_stats()["ops"]
    views = [x.t(), x[1:3], x[:, ::2], x.view(6, 4), x.unsqueeze(0), x.transpose(0, 1)[2], x.narrow(1, 1, 3),
             x.diagonal(), x.as_strided((2, 2), (1, 1), 3), x.expand(2, 4, 6), x.unfold(1, 2, 2)]
    assert torch_tpu.dispatch_stats()["ops"] == before
    for v in views:
        assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_reads_through_views() -> None:
    c = torch.randn(5, 7)
    t = c.to("tpu")
    for f in (lambda a: a.t(), lambda a: a[1:4, ::3], lambda a: a[:, 2], lambda a: a.diagonal(1),
              lambda a: a.as_strided((3, 3), (1, 1), 4), lambda a: a.reshape(-1).unfold(0, 5, 3),
              lambda a: a[::-1] if False else a.flip(0), lambda a: a[None, :, None].expand(2, 5, 3, 7)):
        same(f(t) * 1, f(c) * 1)
        same(f(t).contiguous(), f(c).contiguous())


def test_inplace_writes_through_views_reach_the_base() -> None:
    c = torch.randn(6, 8)
    t = c.to("tpu")
    for f in (lambda a: a[2:4].add_(1), lambda a: a.t()[3].mul_(2), lambda a: a[:, ::3].zero_(),
              lambda a: a.diagonal().fill_(7), lambda a: a.view(4, 12)[1:3, 5:].sub_(3),
              lambda a: a[1].copy_(torch.arange(8.0))):
        f(t)
        f(c)
        same(t, c)


def test_copy_into_view_from_cpu_and_dtype_change() -> None:
    c = torch.zeros(4, 5)
    t = c.to("tpu")
    src = torch.arange(10, dtype=torch.int64).reshape(2, 5)
    t[1:3].copy_(src)
    c[1:3].copy_(src)
    same(t, c)
    t.t()[0].copy_(torch.ones(4, dtype=torch.float64, device="tpu"))
    c.t()[0].copy_(torch.ones(4, dtype=torch.float64))
    same(t, c)


def test_out_resizes_empty_out() -> None:
    a = torch.randn(3, 4)
    out = torch.empty(0, device="tpu")
    torch.mul(a.to("tpu"), 2, out=out)
    same(out, a * 2)
    assert out.shape == (3, 4)


def test_inplace_donation_keeps_other_views_consistent() -> None:
    t = torch.zeros(10, device="tpu")
    v = t[3:6]
    t.add_(1)
    v.mul_(5)
    expected = torch.ones(10)
    expected[3:6] = 5
    same(t, expected)
    same(v, torch.full((3,), 5.0))


def test_dtype_reinterpret_view() -> None:
    c = torch.randn(8)
    t = c.to("tpu")
    assert torch.equal(t.view(torch.int32).cpu(), c.view(torch.int32))
    same(t.view(torch.int32) + 1, c.view(torch.int32) + 1)
    assert torch.equal(t.view(torch.uint8).cpu(), c.view(torch.uint8))


ops = st.sampled_from(["slice", "transpose", "select", "add_", "mul_", "fill_", "view", "expand_read", "diag"])


@settings(max_examples=40, deadline=None)
@given(st.lists(ops, min_size=1, max_size=6), st.integers(0, 1000))
def test_random_programs_of_views_and_inplace_ops(program: list[str], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    base_c = torch.randn(6, 6, generator=g)
    base_t = base_c.to("tpu")
    vc, vt = base_c, base_t
    for i, op in enumerate(program):
        if op == "slice" and vc.dim() >= 1 and vc.shape[0] > 1:
            vc, vt = vc[1:], vt[1:]
        elif op == "transpose" and vc.dim() >= 2:
            vc, vt = vc.transpose(0, 1), vt.transpose(0, 1)
        elif op == "select" and vc.dim() >= 2:
            vc, vt = vc[0], vt[0]
        elif op == "diag" and vc.dim() == 2:
            vc, vt = vc.diagonal(), vt.diagonal()
        elif op == "view" and vc.is_contiguous():
            vc, vt = vc.view(-1), vt.view(-1)
        elif op == "expand_read":
            same(vt.unsqueeze(0).expand(2, *vt.shape) + 0, vc.unsqueeze(0).expand(2, *vc.shape) + 0)
        elif op == "add_":
            vc.add_(i + 0.5)
            vt.add_(i + 0.5)
        elif op == "mul_":
            vc.mul_(-1.5)
            vt.mul_(-1.5)
        elif op == "fill_":
            vc.fill_(float(i))
            vt.fill_(float(i))
        same(vt, vc)
    same(base_t, base_c)
