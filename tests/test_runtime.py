"""Runtime behaviour: memory accounting, RNG, eager modes, threads, serialization, cache."""

from __future__ import annotations

import io
import os
import threading

import pytest
import torch
import torch_tpu
from torch_tpu._internal.execution_mode import EagerMode, get_eager_mode, set_eager_mode

from tests.conftest import run_python


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


def test_rng_reproducible_and_seedable() -> None:
    torch.manual_seed(1234)  # seeds tpu too (through torch.tpu.manual_seed_all)
    a = torch.rand(1000, device="tpu")
    b = torch.randn(1000, device="tpu")
    torch.tpu.manual_seed(1234)
    assert torch.equal(a.cpu(), torch.rand(1000, device="tpu").cpu())
    assert torch.equal(b.cpu(), torch.randn(1000, device="tpu").cpu())
    state = torch.tpu.get_rng_state()
    c = torch.randint(0, 10, (100,), device="tpu")
    torch.tpu.set_rng_state(state)
    assert torch.equal(c.cpu(), torch.randint(0, 10, (100,), device="tpu").cpu())
    assert torch.tpu.initial_seed() == 1234
    u = torch.empty(20000, device="tpu").uniform_(-2, 3).cpu()
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean().item() - 0.5) < 0.05
    n = torch.empty(20000, device="tpu").normal_(1.0, 2.0).cpu()
    assert abs(n.mean().item() - 1.0) < 0.1 and abs(n.std().item() - 2.0) < 0.1
    p = torch.randperm(50, device="tpu").cpu()
    assert sorted(p.tolist()) == list(range(50))
    d = torch.nn.functional.dropout(torch.ones(20000, device="tpu"), 0.25).cpu()
    assert abs((d == 0).float().mean().item() - 0.25) < 0.02
    assert torch.allclose(d[d != 0], torch.tensor(1 / 0.75))
    bern = torch.bernoulli(torch.full((20000,), 0.3, device="tpu")).cpu()
    assert abs(bern.mean().item() - 0.3) < 0.02
    g = torch.Generator(device="tpu").manual_seed(7)
    x1 = torch.rand(10, device="tpu", generator=g)
    g.manual_seed(7)
    assert torch.equal(x1.cpu(), torch.rand(10, device="tpu", generator=g).cpu())
    assert torch_tpu.fallback_stats() == {}


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


def test_save_load_map_location_both_ways(tmp_path: object) -> None:
    t = torch.randn(3, 4, device="tpu")
    buf = io.BytesIO()
    torch.save({"w": t, "v": t[1]}, buf)
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["w"].device.type == "cpu" and torch.equal(on_cpu["w"], t.cpu())
    buf.seek(0)
    back = torch.load(buf, map_location="tpu")
    assert back["w"].device.type == "tpu" and torch.equal(back["w"].cpu(), t.cpu())
    c = torch.randn(5)
    buf = io.BytesIO()
    torch.save(c, buf)
    buf.seek(0)
    moved = torch.load(buf, map_location="tpu:0")
    assert moved.device == torch.device("tpu", 0) and torch.equal(moved.cpu(), c)
    m = torch.nn.Linear(4, 2).tpu()
    sd = {k: v.cpu() for k, v in m.state_dict().items()}
    m2 = torch.nn.Linear(4, 2).tpu()
    m2.load_state_dict(sd)
    assert torch.equal(m2.weight.cpu(), m.weight.cpu())


def test_disk_cache_second_process_and_corrupt_entry(tmp_path: object) -> None:
    cache = os.path.join(str(tmp_path), "cache")
    code = (
        "import torch, torch_tpu, json\n"
        "x = torch.arange(7.0, device='tpu')\n"
        "y = (x * 3.5 - 1).exp().sum()\n"
        "assert abs(y.item() - torch.arange(7.0).mul(3.5).sub(1).exp().sum().item()) < 1e-2 * y.item()\n"
        "print(json.dumps(torch_tpu.cache_stats()))\n"
    )
    import json

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
    x = torch.randn(33, device="tpu")
    (x * 2.0 + 1.0).cpu()
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
