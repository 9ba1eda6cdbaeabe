"""Storages keep their logical shape (csrc/runtime/storage.h): a program that writes a whole
storage returns the value in the shape it computed (a [64, 4096] result is tensor<64x4096>, never
reshaped to 1-D, so XLA emits its fusions over the real dims), the storage records those dims, and
a later program whose view is that shape takes the buffer as its parameter unchanged. Views of
other shapes, partial writes, in-place ops, resize_, host and cross-device copies still see the
same bytes; in-place ops still update their donated buffer in place."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch_tpu
from torch_tpu import EagerMode, set_eager_mode

TPU = "tpu"


def dims(t: torch.Tensor) -> list[int] | None:
    """The dims of t's storage buffer as PJRT reports them (checked against the storage's record)."""
    has, d = torch.ops.torch_tpu._storage_dims(t)
    return list(d) if has else None


def _block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x * w + b)


def _block_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(64, 4096), torch.randn(4096), torch.randn(4096)


def _result_types(text: str) -> list[str]:
    """The result types of the program's main function (its signature's `-> (...)`)."""
    m = re.search(r"func\.func (?:public )?@main\(.*?\)\s*->\s*\(?(.*?)\)?\s*\{", text, re.S)
    assert m is not None, text[:400]
    return re.findall(r"tensor<[^>]*>", m.group(1))


def test_compiled_block_returns_its_logical_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_tpu import _C
    from torch_tpu._internal import compile as tpu_compile

    texts: list[str] = []
    build: Callable[[dict[str, Any]], int] = tpu_compile._build

    def spy(desc: dict[str, Any]) -> int:
        texts.append(_C._graph_text(desc))
        return build(desc)

    monkeypatch.setattr(tpu_compile, "_build", spy)
    x, w, b = _block_inputs()
    fn = torch.compile(_block, backend="tpu", dynamic=False)
    out = fn(x.to(TPU), w.to(TPU), b.to(TPU))
    torch.testing.assert_close(out.cpu(), _block(x, w, b), atol=1e-5, rtol=1e-5)
    assert len(texts) == 1
    assert _result_types(texts[0]) == ["tensor<64x4096xf32>"]
    assert "tensor<262144xf32>" not in texts[0]
    assert dims(out) == [64, 4096]


def test_fused_eager_program_returns_its_logical_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = _block_inputs()
    xt, wt, bt = x.to(TPU), w.to(TPU), b.to(TPU)
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path))
    limits = torch_tpu.cache_stats()
    torch_tpu._C._set_cache_limits(1, limits["max_bytes"])  # evicts: the fused program is built (dumped) again
    torch_tpu._C._set_cache_limits(limits["max_programs"], limits["max_bytes"])
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        out = _block(xt, wt, bt)
        got = out.cpu()
    torch.testing.assert_close(got, _block(x, w, b), atol=1e-5, rtol=1e-5)
    fused = [f.read_text() for f in tmp_path.glob("*.mlir") if f.read_text().startswith("// fused graph")]
    assert len(fused) == 1, [f.read_text()[:200] for f in tmp_path.glob("*.mlir")]
    assert _result_types(fused[0]) == ["tensor<64x4096xf32>"]
    assert "262144" not in fused[0]  # inputs too are parameters of their own shapes
    assert dims(out) == [64, 4096]


def test_uploads_and_strict_results_hold_logical_dims() -> None:
    torch.manual_seed(1)
    a = torch.randn(8, 16)
    at = a.to(TPU)
    assert dims(at) == [8, 16]
    s = torch.tensor(2.5).to(TPU)  # 0-d: dims [], not [1]
    assert dims(s) == []
    y = at * s + 1
    assert dims(y) == [8, 16]
    torch.testing.assert_close(y.cpu(), a * 2.5 + 1)
    z = s * 3
    assert dims(z) == [] and z.item() == 7.5
    assert dims(torch.empty(3, 5, device=TPU)) is None  # never written: no buffer
    e = torch.empty(3, 5, device=TPU)
    e.add_(1)  # reads fresh memory as zeros, of the storage's shape... or [15]; then writes [3, 5]
    assert dims(e) == [3, 5] and torch.equal(e.cpu(), torch.ones(3, 5))


def test_views_of_other_shapes_read_the_same_bytes() -> None:
    torch.manual_seed(2)
    a = torch.randn(8, 16)
    at = a.to(TPU)
    cases: list[tuple[torch.Tensor, torch.Tensor]] = [
        (at.view(-1) + 1, a.view(-1) + 1),
        (at.t() * 2, a.t() * 2),
        (at.narrow(1, 3, 5) - 1, a.narrow(1, 3, 5) - 1),
        (at.narrow(0, 2, 4).sum(1), a.narrow(0, 2, 4).sum(1)),
        (at.as_strided((5, 3), (7, 2), 4).exp(), a.as_strided((5, 3), (7, 2), 4).exp()),
        (at.view(4, 2, 16).permute(2, 0, 1).contiguous(), a.view(4, 2, 16).permute(2, 0, 1).contiguous()),
        (at.view(128)[::3] * 1, a.view(128)[::3] * 1),
        (at.unfold(1, 4, 3).sum(-1), a.unfold(1, 4, 3).sum(-1)),
    ]
    for got, want in cases:
        torch.testing.assert_close(got.cpu(), want)
    assert dims(at) == [8, 16]  # reads never change the storage
    # an output with its input's transposed strides holds its memory order
    assert dims(cases[0][0]) == [128] and dims(cases[1][0]) == [8, 16]
    # A [128] storage and an [8, 16] one read through the same [128] view: different parameter
    # types, so different programs (the dims are part of the key), equal results.
    flat = a.reshape(-1).to(TPU)
    assert dims(flat) == [128]
    torch.testing.assert_close((flat * 3).cpu(), (at.view(-1) * 3).cpu(), rtol=0, atol=0)


def test_inplace_writes_through_views() -> None:
    torch.manual_seed(3)
    a = torch.randn(8, 16)
    at = a.to(TPU)
    at.view(-1).add_(1)  # a whole write through a [128] view: the storage becomes [128]
    a.view(-1).add_(1)
    assert dims(at) == [128]
    torch.testing.assert_close(at.cpu(), a)
    at.mul_(2)  # whole write in its own shape: [8, 16] again
    a.mul_(2)
    assert dims(at) == [8, 16]
    at[2:4].fill_(3.0)  # partial writes keep the dims
    a[2:4].fill_(3.0)
    assert dims(at) == [8, 16]
    at.t().mul_(0.5)  # every element, transposed: the storage keeps its memory order
    a.t().mul_(0.5)
    assert dims(at) == [8, 16]
    at.view(2, 64)[:, ::5].neg_()  # strided partial write over a storage of other dims
    a.view(2, 64)[:, ::5].neg_()
    assert dims(at) == [8, 16]
    torch.testing.assert_close(at.cpu(), a)
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        at.view(-1).sub_(1)  # fused: the pending value takes [128], then a partial write keeps it
        at.view(4, 32)[1].zero_()
        a.view(-1).sub_(1)
        a.view(4, 32)[1].zero_()
        v = at.t() + 0
        torch.testing.assert_close(v.cpu(), a.t() + 0)
    assert dims(at) == [128]
    torch.testing.assert_close(at.cpu(), a)


def _address(t: torch.Tensor) -> int:
    """Where t's buffer lives (the CPU plugin's device memory is host memory)."""
    view = torch.ops.tpu_dist.host_view(t, False)
    assert view is not None and view.numel() > 0
    return int(view.data_ptr())


def test_inplace_ops_update_the_donated_buffer_in_place() -> None:
    if torch_tpu._C._platform()["platform_name"] != "cpu":
        pytest.skip("buffer addresses are host addresses on the CPU plugin only")
    torch.manual_seed(4)
    for mode in (EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE):
        x = torch.randn(64, 128).to(TPU)
        before = _address(x)
        with set_eager_mode(mode):
            x.mul_(2).add_(1)
        assert _address(x) == before, mode  # same dims in and out: XLA wrote the donated buffer
        assert dims(x) == [64, 128]
        x[3:9].zero_()  # a partial write: in place too
        assert _address(x) == before and dims(x) == [64, 128]


def test_resize_keeps_the_bytes_of_a_shaped_storage() -> None:
    a = torch.arange(12.0).view(3, 4)
    at = a.to(TPU)
    assert dims(at) == [3, 4]
    at.resize_(20)
    assert dims(at) == [20]
    assert torch.equal(at[:12].cpu(), a.view(-1))
    at.resize_(2, 3)  # a smaller view of the same storage
    assert torch.equal(at.cpu(), a.view(-1)[:6].view(2, 3))


def test_host_and_device_copies_of_shaped_storages() -> None:
    torch.manual_seed(5)
    a = torch.randn(6, 10)
    at = a.to(TPU)
    host = torch.empty(10, 6)
    host.copy_(at.t())  # a transposed read of a [6, 10] buffer, to the host
    assert torch.equal(host, a.t())
    dst = torch.zeros(10, 6, device=TPU)
    dst.copy_(a.t())  # upload into a strided... contiguous [10, 6] destination
    assert dims(dst) == [10, 6] and torch.equal(dst.cpu(), a.t())
    part = torch.zeros(6, 10, device=TPU)
    part[:, 2:5].copy_(a[:, 2:5])  # partial upload: staged, then written through the view
    assert dims(part) == [6, 10] and torch.equal(part[:, 2:5].cpu(), a[:, 2:5])
    if torch_tpu._C._device_count() > 1:
        moved = at.to("tpu:1")
        assert dims(moved) == [6, 10] and torch.equal(moved.cpu(), a)
        back = at.view(-1).to("tpu:1")
        assert torch.equal(back.cpu(), a.view(-1))


def test_compiled_graph_takes_inputs_whose_storages_hold_other_dims() -> None:
    torch.manual_seed(6)
    x = torch.randn(4, 32)
    xt = x.to(TPU)
    v = xt.view(8, 16)  # a whole, contiguous view whose storage holds [4, 32]
    fn = torch.compile(lambda t: (t * 2).sum(0), backend="tpu", dynamic=False)
    torch.testing.assert_close(fn(v).cpu(), (x.view(8, 16) * 2).sum(0))
    fresh = x.view(8, 16).to(TPU)  # the same graph with a buffer of the input's own shape
    torch.testing.assert_close(fn(fresh).cpu(), (x.view(8, 16) * 2).sum(0))

    def step(p: torch.Tensor) -> None:
        p.mul_(3)  # an input mutation written back into the storage

    g = torch.compile(step, backend="tpu", dynamic=False)
    g(v)
    assert dims(xt) == [8, 16]  # the mutation's result is the input's logical shape
    torch.testing.assert_close(xt.cpu(), x * 3)
