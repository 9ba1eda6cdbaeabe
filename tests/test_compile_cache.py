"""The program cache: signature hits, element-count keys, the disk cache, explain(), bounded memory."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch_tpu

from tests.conftest import run_python


def test_disk_cache_second_process_and_corrupt_entry(tmp_path: object) -> None:
    cache = os.path.join(str(tmp_path), "cache")
    code = (
        "import torch, torch_tpu, json\n"
        "x = torch.arange(7.0, device='tpu')\n"
        "y = (x * 3.5 - 1).exp().sum()\n"
        "assert abs(y.item() - torch.arange(7.0).mul(3.5).sub(1).exp().sum().item()) < 1e-2 * y.item()\n"
        "print(json.dumps(torch_tpu.cache_stats()))\n"
    )
    first = run_python(code, env={"TORCH_TPU_CACHE_DIR": cache})
    assert first.returncode == 0, first.stderr
    s1 = json.loads(first.stdout.strip().splitlines()[-1])
    assert s1["misses"] > 0 and s1["disk_hits"] == 0
    second = run_python(code, env={"TORCH_TPU_CACHE_DIR": cache})
    s2 = json.loads(second.stdout.strip().splitlines()[-1])
    assert s2["misses"] == 0 and s2["disk_hits"] == s1["misses"]
    entries = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith(".xla")]
    assert entries
    for i, e in enumerate(entries):
        with open(e, "wb") as f:
            f.write(b"garbage" if i % 2 else b"TORCH_TPU_EXE_V1\n5\nwrong-key-and-payload")
    third = run_python(code, env={"TORCH_TPU_CACHE_DIR": cache})
    assert third.returncode == 0, third.stderr
    s3 = json.loads(third.stdout.strip().splitlines()[-1])
    assert s3["disk_errors"] == len(entries) and s3["misses"] == len(entries)
    fourth = run_python(code, env={"TORCH_TPU_CACHE_DIR": cache})
    s4 = json.loads(fourth.stdout.strip().splitlines()[-1])
    assert s4["misses"] == 0 and s4["disk_errors"] == 0


def test_scalar_change_does_not_recompile() -> None:
    # Values outside the constant table (-2, -1, -0.5, 0, 0.5, 1, 2), which compile a program each.
    x = torch.randn(33, device="tpu")
    (x * 1.5 + 2.5).cpu()
    before = torch_tpu.cache_stats()
    for s in (3.0, -7.25, 1e3):
        (x * s + s).cpu()
    after = torch_tpu.cache_stats()
    assert after["misses"] == before["misses"] and after["memory_hits"] == before["memory_hits"]


def test_elementwise_programs_are_keyed_by_element_count() -> None:
    a = torch.randn(6, 4, device="tpu")
    (a * a).cpu()
    before = torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"]
    b = torch.randn(3, 8, device="tpu")
    c = torch.randn(24, device="tpu")
    (b * b).cpu()
    (c * c).cpu()
    after = torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"]
    # randn and the host read add programs for the new shapes, the multiply must not.
    events = [e for e in torch_tpu._C._compile_events() if e[0] == "aten::mul.Tensor"]
    assert after >= before
    assert len({e[1] for e in events if "F|" in e[1] and "[24," in e[1]}) <= 1


def test_explain_names_the_input_that_forced_a_recompile(capsys: pytest.CaptureFixture[str]) -> None:
    torch_tpu.reset_cache_stats()
    w = torch.randn(17, 3, device="tpu")
    for n in (13, 13, 19):  # shapes no other test uses
        (torch.ones(n, 17, device="tpu") @ w).cpu()
    e = torch_tpu.explain()
    printed = capsys.readouterr().out
    mm = [r for r in e.compiles if r.op == "aten::mm" and "-> f32[19, 17]" in r.reason]
    assert len(mm) == 1 and "new shape for 'self': f32[13, 17] -> f32[19, 17]" in mm[0].reason
    assert "aten::mm" in printed and "CPU fallbacks" in printed
    assert e.cache["op_hits"] >= 1
    assert any(r in e.recompiles for r in mm)


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_program_memory_is_bounded_least_recently_used() -> None:
    stats = torch_tpu.cache_stats()
    limits = (stats["max_programs"], stats["max_bytes"])
    assert limits[0] > 0 and limits[1] > 0
    hot = torch.arange(5.0, device="tpu")
    (hot * 3).cpu()
    torch_tpu._C._set_cache_limits(8, limits[1])
    try:
        before = torch_tpu.cache_stats()
        assert before["programs"] <= 8
        maps = []
        for n in range(40):  # element counts no other test uses: one new mul program each
            x = torch.full((1000 + n,), 2.0, device="tpu")
            assert (x * 3.0)[-1].item() == 6.0
            assert (hot * 3)[4].item() == 12.0  # used every step: never the least recently used
            maps.append(_maps())
        after = torch_tpu.cache_stats()
        assert after["programs"] <= 8 and after["evictions"] - before["evictions"] >= 30
        assert 0 < after["program_bytes"] <= after["max_bytes"]
        assert maps[-1] - maps[10] < 100, maps  # executables are unmapped when evicted
        # An evicted program is rebuilt (disk or compile) with the same result.
        assert torch.equal((torch.full((1000,), 2.0, device="tpu") * 3.0).cpu(), torch.full((1000,), 6.0))
    finally:
        torch_tpu._C._set_cache_limits(*limits)
