"""torch.save / torch.load of tpu tensors and modules, both map_location directions."""

from __future__ import annotations

import io

import torch


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
