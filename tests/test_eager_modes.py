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
