"""torch.profiler rows of the tpu backend: launches, compiles (cache tier), transfers, host syncs
and device time, counted against the backend's own counters."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch_tpu
from torch.profiler import ProfilerActivity, profile, record_function

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to("tpu")


def _kinds(names: list[str]) -> Counter:
    return Counter(n.split(" ")[0].split("[")[0] for n in names if n.startswith("tpu::"))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = _model()
    with torch.no_grad():
        model(torch.randn(4, 16).to("tpu")).cpu()  # warm: programs compiled once
    torch_tpu.synchronize()
    d0, c0 = torch_tpu.dispatch_stats(), torch_tpu.cache_stats()
    x_cpu = torch.randn(3, 16)  # a new batch size: these signatures compile inside the profile
    with profile(activities=ACTIVITIES) as prof:
        with record_function("tiny_step"), torch.no_grad():
            x = x_cpu.to("tpu")
            y = model(x)
            out = y.softmax(-1).cpu()
            torch_tpu.synchronize()
    d1, c1 = torch_tpu.dispatch_stats(), torch_tpu.cache_stats()
    trace = tmp_path_factory.mktemp("prof") / "trace.json"
    prof.export_chrome_trace(str(trace))
    ref = model.cpu()(x_cpu).softmax(-1)
    return {"prof": prof, "d": (d0, d1), "c": (c0, c1), "trace": trace, "out": out, "ref": ref}


def test_counts_match_backend_counters(profiled: dict) -> None:
    prof, (d0, d1), (c0, c1) = profiled["prof"], profiled["d"], profiled["c"]
    torch.testing.assert_close(profiled["out"], profiled["ref"], rtol=1e-5, atol=1e-6)
    names = [e.name for e in prof.events()]
    kinds = _kinds(names)
    assert kinds["tpu::launch"] == d1["launches"] - d0["launches"] > 0
    assert kinds["tpu::d2h"] == d1["host_syncs"] - d0["host_syncs"] == 1
    assert kinds["tpu::h2d"] == 1
    assert kinds["tpu::synchronize"] >= 1
    tiers = Counter(n.split("]")[0] + "]" for n in names if n.startswith("tpu::compile["))
    assert tiers["tpu::compile[memory]"] == c1["memory_hits"] - c0["memory_hits"]
    assert tiers["tpu::compile[disk]"] == c1["disk_hits"] - c0["disk_hits"]
    assert tiers["tpu::compile[xla]"] == c1["misses"] - c0["misses"]
    assert sum(tiers.values()) > 0
    # Every launch finished before synchronize() returned, so each has a device interval.
    assert kinds["tpu::device"] == kinds["tpu::launch"]
    launched = sorted(n[len("tpu::launch ") :] for n in names if n.startswith("tpu::launch "))
    on_device = sorted(n[len("tpu::device ") :] for n in names if n.startswith("tpu::device "))
    assert launched == on_device
    assert any("addmm" in n for n in launched)


def test_chrome_trace_nesting_and_device_row(profiled: dict) -> None:
    events = json.loads(Path(profiled["trace"]).read_text())["traceEvents"]
    step = next(e for e in events if e.get("name") == "tiny_step")
    lo, hi = step["ts"], step["ts"] + step["dur"]
    host = [
        e
        for e in events
        if e.get("ph") == "X"
        and str(e.get("name", "")).startswith(("tpu::launch", "tpu::d2h", "tpu::h2d", "tpu::compile"))
    ]
    device = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("tpu::device")]
    assert host and device
    for e in host:  # nested under the record_function range, on its thread
        assert e["tid"] == step["tid"] and lo <= e["ts"] and e["ts"] + e["dur"] <= hi + 1, e
    # Device activities (Kineto's PrivateUse1 profiler): kernels on the "TPU 0" process row.
    assert {e["pid"] for e in device} == {0} != {step["pid"]}
    assert {e.get("cat") for e in device} == {"kernel"}
    labels = [e for e in events if e.get("ph") == "M" and e.get("pid") == 0 and e.get("name") == "process_labels"]
    assert labels and labels[0]["args"]["labels"] == "TPU 0"
    for e in device:
        assert e["dur"] > 0 and lo - 1 <= e["ts"] <= hi + 1


def test_key_averages_rows(profiled: dict) -> None:
    avg = {a.key: a for a in profiled["prof"].key_averages()}
    dev = [a for k, a in avg.items() if k.startswith("tpu::device ")]
    # Device rows carry device time (the "Self TPU" column), no CPU time.
    assert dev and all(a.self_device_time_total > 0 and a.cpu_time_total == 0 for a in dev)
    # ... and count as device time of the op that launched them (linked by correlation id).
    kernels = avg["tpu::device aten::addmm"]
    assert avg["aten::addmm"].device_time_total == pytest.approx(kernels.self_device_time_total)
    assert avg["aten::linear"].device_time_total == pytest.approx(kernels.self_device_time_total)
    assert avg["tiny_step"].device_time_total >= sum(a.self_device_time_total for a in dev) - 1
    assert any(k.startswith("tpu::launch aten::addmm") for k in avg)
    table = profiled["prof"].key_averages().table(sort_by="self_device_time_total", row_limit=5)
    assert "Self TPU" in table and "tpu::device aten::addmm" in table


def test_no_rows_without_profiler() -> None:
    # Work outside a profiling session is neither recorded nor queued for a later one. (The
    # profiler itself synchronizes the accelerator when it stops: that range is expected.)
    x = torch.ones(5, device="tpu")
    (x * 3).sum().item()
    with profile(activities=ACTIVITIES) as prof:
        pass
    (x * 4).sum().item()
    rows = [e.name for e in prof.events() if e.name.startswith("tpu::")]
    assert set(rows) <= {"tpu::synchronize"}, rows


def test_compiled_graph_launch_row() -> None:
    fn = torch.compile(lambda a: (a * 2).sin().sum(dim=0), backend="tpu")
    x = torch.randn(4, 3).to("tpu")
    fn(x).cpu()  # compile outside the profile
    d0 = torch_tpu.dispatch_stats()
    with profile(activities=ACTIVITIES) as prof:
        out = fn(x).cpu()
    d1 = torch_tpu.dispatch_stats()
    torch.testing.assert_close(out, (x.cpu() * 2).sin().sum(dim=0))
    names = [e.name for e in prof.events()]
    graphs = [n for n in names if n.startswith("tpu::launch graph")]
    assert len(graphs) == d1["launches"] - d0["launches"] == 1, names
    assert [n for n in names if n.startswith("tpu::device graph")] == [
        "tpu::device" + graphs[0][len("tpu::launch") :]
    ]
    # The graph's device time is the device time of the op that ran it.
    run = {a.key: a for a in prof.key_averages()}["torch_tpu::run_graph"]
    assert run.device_time_total > 0


def test_cpu_only_profile_keeps_device_rows() -> None:
    # A CPU-only profile still shows each launch's device interval: as a device activity when
    # Kineto runs the tpu's activity profiler anyway (once it was set up in this process), else as
    # a CPU-side row on a thread of its own.
    x = torch.randn(8, 8).to("tpu")
    (x @ x).cpu()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (x @ x).cpu()
    rows = [e for e in prof.events() if e.name == "tpu::device aten::mm"]
    assert len(rows) == 1 and rows[0].time_range.elapsed_us() > 0
