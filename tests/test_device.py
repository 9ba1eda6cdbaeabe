"""The device surface: torch.tpu, torch.accelerator, methods generated for PrivateUse1, guards."""

from __future__ import annotations

import torch
import torch_tpu

from tests.conftest import run_python


def test_autoload_by_import_torch_alone() -> None:
    r = run_python(
        "import torch; import transformers.utils as u;"
        "print(hasattr(torch, 'tpu'), hasattr(torch.backends, 'tpu'), torch.accelerator.current_accelerator(),"
        " u.is_torch_tpu_available())"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "tpu", "True"]


def test_autoload_can_be_disabled() -> None:
    r = run_python("import torch; print(hasattr(torch, 'tpu'))", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    r = run_python("import torch, torch_tpu; print(torch.ones(2, device='tpu').sum().item())",
                   env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2.0"


def test_device_module_surface() -> None:
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    assert "cpu" in torch.tpu.get_device_name().lower()
    props = torch.tpu.get_device_properties(0)
    assert props.pjrt_api_version == "0.81"
    assert props.total_memory > 0
    assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]
    assert torch.tpu._is_in_bad_fork() is False
    torch.tpu.set_device(0)
    assert torch.tpu.is_initialized()
    with torch.tpu.device(0):
        assert torch.tpu.current_device() == 0
    torch.tpu.synchronize()
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total


def test_stream_and_event_query_do_not_wait() -> None:
    from torch_tpu import EagerMode, get_eager_mode, set_eager_mode

    s, e = torch.tpu.current_stream(), torch.tpu.Event()
    x = torch.randn(256, 256, device="tpu")
    y = x @ x
    e.record(s)
    assert isinstance(s.query(), bool) and isinstance(e.query(), bool)  # the guard's queryStream
    torch.tpu.synchronize()
    assert s.query() and e.query() and torch.Stream(device="tpu").query()
    # Fused eager: a query launches the pending program (it is not reported done unlaunched).
    old = get_eager_mode()
    set_eager_mode(EagerMode.DEFER_AND_FUSE)
    try:
        z = y * 2 + 1
        s.query()
        torch.tpu.synchronize()
        assert s.query()
    finally:
        set_eager_mode(old)
    torch.testing.assert_close(z.cpu(), (x.cpu() @ x.cpu()) * 2 + 1, rtol=1e-4, atol=1e-4)


def test_synchronize_after_many_launches_and_donations() -> None:
    # More launches than the in-flight bound (512), in-place ones (their input buffer donated) and
    # kept results: all settle.
    before = torch_tpu.dispatch_stats()["launches"]
    x = torch.zeros(64, device="tpu")
    kept = []
    for i in range(600):
        x.add_(1)
        if i % 150 == 0:
            kept.append(x * 2)
    torch.tpu.synchronize()
    assert torch.tpu.current_stream().query()
    assert torch_tpu.dispatch_stats()["launches"] - before >= 600
    assert torch.equal(x.cpu(), torch.full((64,), 600.0))
    assert [k[0].item() for k in kept] == [2.0, 302.0, 602.0, 902.0]


def test_synchronize_waits_for_launches_whose_results_were_dropped() -> None:
    # A timing loop discards its results; synchronize() must still wait for that work (as
    # torch.cuda.synchronize does), so the stream is idle right after it and busy right before.
    a = torch.randn(512, 512, device="tpu")
    torch.tpu.synchronize()
    for _ in range(40):
        a @ a  # result dropped at once
    busy = not torch.tpu.current_stream().query()
    torch.tpu.synchronize()
    assert torch.tpu.current_stream().query()
    assert busy, "40 dropped 512x512 matmuls were reported complete right after launch"


def test_generated_methods() -> None:
    x = torch.arange(4.0).tpu()
    assert x.device.type == "tpu" and x.is_tpu
    m = torch.nn.Linear(3, 2).tpu()
    assert m.weight.device.type == "tpu"
    assert torch.equal(x.cpu(), torch.arange(4.0))


def test_data_ptrs_are_unique_and_nonzero() -> None:
    a = torch.empty(16, device="tpu")
    b = torch.empty(16, device="tpu")
    assert a.data_ptr() != 0 and b.data_ptr() != 0 and a.data_ptr() != b.data_ptr()
    assert a[4:].data_ptr() == a.data_ptr() + 16
    # Like CPU tensors, empty tensors report 0.
    assert torch.empty(0, device="tpu").data_ptr() == torch.empty(0).data_ptr() == 0


def test_pjrt_plugin_facts() -> None:
    import torch_tpu._C as C

    p = C._platform()
    assert p["pjrt_api_version"] == "0.81"
    assert p["platform_name"] == "cpu"
    assert p["plugin_path"].endswith("xla_cpu_pjrt.so")


def test_lowered_ops_registry_is_populated() -> None:
    ops = torch_tpu.lowered_ops()
    for name in ("add", "mm", "copy", "sum", "index", "uniform"):
        assert name in ops
