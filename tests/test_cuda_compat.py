"""CUDA-compatible behaviours: CPU index tensors on tpu tensors, `param.data =` across devices."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch_tpu

X = torch.arange(20.0).reshape(4, 5)
ROWS = torch.tensor([3, 0, 3])


def _both(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn gets the data tensor (cpu or tpu); its index tensors always stay on the CPU."""
    expected = fn(X.clone())
    got = fn(X.clone().to("tpu"))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_getitem_setitem_with_cpu_index(dtype: torch.dtype) -> None:
    rows = ROWS.to(dtype)
    _both(lambda x: x[rows])
    _both(lambda x: x[rows, torch.tensor([1, 2, 4], dtype=dtype)])
    _both(lambda x: x[:, rows])
    _both(lambda x: x[torch.tensor(2, dtype=dtype)])  # 0-d

    def setitem(x: torch.Tensor) -> torch.Tensor:
        x[torch.tensor([1, 2], dtype=dtype)] = 7.0
        x[torch.tensor(0, dtype=dtype), torch.tensor([0, 4], dtype=dtype)] = -1.0
        return x

    _both(setitem)


def test_bool_mask_on_cpu() -> None:
    mask = torch.tensor([True, False, True, False])
    _both(lambda x: x[mask])
    # The CPU mask becomes indices on the host (OpEntry::host_bool_indices): no device round trip.
    x = X.to("tpu")
    before = torch_tpu.dispatch_stats()["host_syncs"]
    torch.testing.assert_close(x[mask].cpu(), X[mask])
    assert torch_tpu.dispatch_stats()["host_syncs"] - before == 1  # the .cpu() only

    def setmask(x: torch.Tensor) -> torch.Tensor:
        x[mask] = 3.0
        x[X > 15] = 0.0  # elementwise CPU mask
        return x

    _both(setmask)


def test_index_family_with_cpu_index() -> None:
    idx = torch.tensor([[0, 4], [1, 1], [2, 0], [3, 3]])
    _both(lambda x: x.index_select(0, ROWS))
    _both(lambda x: x.index_select(1, torch.tensor([4, 0], dtype=torch.int32)))
    _both(lambda x: x.gather(1, idx))
    _both(lambda x: torch.take(x, torch.tensor([0, 19, 7])))
    _both(lambda x: x.index_put_((ROWS,), torch.tensor(9.0), accumulate=True))
    _both(lambda x: x.scatter(1, idx, -2.0))
    _both(lambda x: x.scatter_add(1, idx, torch.ones(4, 2, device=x.device)))
    _both(lambda x: x.index_add(0, ROWS, torch.ones(3, 5, device=x.device)))
    _both(lambda x: x.index_copy(0, torch.tensor([2, 1]), torch.zeros(2, 5, device=x.device)))
    _both(lambda x: x.index_fill(1, torch.tensor([0, 3]), 5.0))


def test_cpu_index_autograd() -> None:
    grads = []
    for dev in ("cpu", "tpu"):
        w = X.clone().to(dev).requires_grad_()
        (w[ROWS] * 2).sum().backward()
        grads.append(w.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


def test_assisted_decoding_style_arange_index() -> None:
    logits = torch.randn(2, 6, 11)
    n = torch.arange(2)
    torch.testing.assert_close(logits.to("tpu")[n, -1].cpu(), logits[n, -1])


def test_cpu_index_of_a_non_index_op_still_raises() -> None:
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, device="tpu") + torch.ones(3)


def test_param_data_across_devices_both_ways() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.data = torch.full((3,), 2.0, device="tpu")
    assert isinstance(p, torch.nn.Parameter) and p.device.type == "tpu" and p.requires_grad
    (p * p).sum().backward()
    torch.testing.assert_close(p.grad.cpu(), torch.full((3,), 4.0))
    p.data = p.data.cpu() + 1
    assert p.device.type == "cpu"
    torch.testing.assert_close(p.detach(), torch.full((3,), 3.0))
    t = torch.zeros(2, 2)
    t.data = torch.eye(2, device="tpu")  # Tensor.set_data
    assert t.device.type == "tpu"
    torch.testing.assert_close(t.cpu(), torch.eye(2))
    assert torch._has_compatible_shallow_copy_type(torch.ones(1), torch.ones(1, device="tpu"))


def test_module_to_moves_grads_in_place() -> None:
    lin = torch.nn.Linear(3, 2)
    lin(torch.ones(1, 3)).sum().backward()
    w, g = lin.weight, lin.weight.grad.clone()
    lin.to("tpu")
    assert lin.weight is w and w.grad.device.type == "tpu"
    torch.testing.assert_close(w.grad.cpu(), g)
