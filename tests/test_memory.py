"""Device memory accounting: allocator statistics, out-of-memory errors."""

from __future__ import annotations

import pytest
import torch


def test_memory_stats_and_return_to_baseline_after_20000_ops() -> None:
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    x = torch.ones(256, device="tpu")
    assert torch.tpu.memory_allocated() == base + 1024
    torch.tpu.reset_peak_memory_stats()
    for i in range(20000):
        x = x * 1.0001 + (i % 3)
    torch.tpu.synchronize()
    assert torch.tpu.memory_allocated() == base + 1024
    assert torch.tpu.max_memory_allocated() <= base + 3 * 1024
    assert torch.tpu.memory_reserved() >= torch.tpu.memory_allocated()
    del x
    assert torch.tpu.memory_allocated() == base
    torch.tpu.empty_cache()


def test_out_of_memory_raises_and_process_survives() -> None:
    with pytest.raises(torch.OutOfMemoryError, match="tpu out of memory"):
        torch.empty(1 << 50, dtype=torch.uint8, device="tpu")
    assert torch.ones(3, device="tpu").sum().item() == 3.0
