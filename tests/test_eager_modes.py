"""Eager execution modes and concurrent use from several threads."""

from __future__ import annotations

import threading

import torch
from torch_tpu._internal.execution_mode import EagerMode, get_eager_mode, set_eager_mode

from tests.conftest import run_python


def test_eager_modes() -> None:
    assert get_eager_mode() is EagerMode.DEFER_NEVER
    with set_eager_mode(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert get_eager_mode() is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
        assert (torch.ones(3, device="tpu") * 2).sum().item() == 6.0
    assert get_eager_mode() is EagerMode.DEFER_NEVER
    with set_eager_mode(EagerMode.DEFER_AND_FUSE):
        assert get_eager_mode() is EagerMode.DEFER_AND_FUSE
    assert get_eager_mode() is EagerMode.DEFER_NEVER
    r = run_python(
        "import torch\nfrom torch_tpu._internal.execution_mode import get_eager_mode\nprint(get_eager_mode().name)",
        env={"TPU_LAUNCH_BLOCKING": "1"},
    )
    assert r.stdout.strip() == "DEFER_NEVER_AND_LAUNCH_BLOCKING", r.stderr


def test_four_threads_issue_ops_concurrently() -> None:
    errors: list[BaseException] = []
    results: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        try:
            x = torch.full((64, 64), float(k), device="tpu")
            for _ in range(200):
                x = (x @ torch.eye(64, device="tpu")) + 1
            results[k] = x.cpu()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(4):
        assert torch.equal(results[k], torch.full((64, 64), float(k + 200)))


def test_dispatch_cache_binds_each_calls_storages_and_scalars() -> None:
    """Repeated signatures take the dispatch cache: every call still reads its own storages,
    scalar values and 0-d host tensors, and a new aliasing pattern or dtype is a new signature."""
    import torch_tpu

    xc = torch.arange(6, dtype=torch.float32)
    yc = torch.linspace(-1.0, 1.0, 6)
    x, y = xc.to("tpu"), yc.to("tpu")
    for mode in (EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE):
        with set_eager_mode(mode):
            for s in (0.5, 3.0, 1.0, 2.0, -1.0, 2.5):  # operands and baked small constants alike
                assert torch.equal((x * s + y).cpu(), xc * s + yc)
                assert torch.equal((x**s).cpu(), xc**s)
                assert torch.equal((x + torch.tensor(s)).cpu(), xc + torch.tensor(s))  # 0-d host tensor
            assert torch.equal((x + x).cpu(), xc + xc)  # one storage for both arguments
            assert torch.equal((x + y).cpu(), xc + yc)
            assert torch.equal((x[:3] * x[3:]).cpu(), xc[:3] * xc[3:])  # views of one storage
            assert torch.equal((x.double() + 1).cpu(), xc.double() + 1)
            a, ac = x.clone(), xc.clone()
            for _ in range(3):
                a.add_(a, alpha=2)
                ac.add_(ac, alpha=2)
            assert torch.equal(a.cpu(), ac)
            for k in range(3):  # a fresh storage per iteration, same signature
                z = torch.full((6,), float(k), device="tpu")
                assert torch.equal((z - y).cpu(), torch.full((6,), float(k)) - yc)
    assert torch_tpu.cache_stats()["op_hits"] > 0
