"""N emulated chips (TORCH_TPU_NUM_DEVICES=4): guards, per-device placement, cross-chip copies."""

from __future__ import annotations

from tests.conftest import run_python

CODE = r"""
import torch
assert torch.tpu.device_count() == 4, torch.tpu.device_count()
a = torch.arange(12.0).reshape(3, 4)
ts = [a.to(f"tpu:{i}") * (i + 1) for i in range(4)]
for i, t in enumerate(ts):
    assert t.device == torch.device("tpu", i), t.device
    assert torch.equal(t.cpu(), a * (i + 1))
# one portable executable serves every chip: the same op on 4 devices
x = ts[3].t().to("tpu:1")
assert x.device.index == 1 and torch.equal(x.cpu(), (a * 4).t())
y = ts[0][1:, ::2].to("tpu:2", dtype=torch.float64)
assert torch.equal(y.cpu(), a[1:, ::2].double())
with torch.tpu.device(2):
    z = torch.ones(3, device="tpu")
    assert z.device.index == 2 and torch.tpu.current_device() == 2
assert torch.tpu.current_device() == 0
torch.tpu.set_device(3)
assert torch.empty(1, device="tpu").device.index == 3
torch.tpu.set_device(0)
try:
    ts[0] + ts[1]
    raise SystemExit("mixing tpu:0 and tpu:1 did not raise")
except RuntimeError as e:
    assert "same device" in str(e), e
dst = torch.zeros(3, 4, device="tpu:3")
dst.copy_(ts[2])
assert torch.equal(dst.cpu(), a * 3)
print("ok")
"""


def test_four_devices() -> None:
    r = run_python(CODE, env={"TORCH_TPU_NUM_DEVICES": "4"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
