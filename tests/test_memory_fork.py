"""CUDA-like memory tools; fork safety (DataLoader workers, a child touching tpu); crash + resume."""

from __future__ import annotations

import json
import os
import signal

import torch

from tests.conftest import run_python


def test_memory_tools() -> None:
    torch.tpu.synchronize()
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    x = torch.ones(1024, device="tpu")
    y = x * 2
    assert torch.tpu.memory_allocated() == base + 2 * 4096
    del y
    assert torch.tpu.memory_allocated() == base + 4096
    assert torch.tpu.max_memory_allocated() >= base + 2 * 4096
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated()
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.tpu.memory_allocated()
    summary = torch.tpu.memory_summary()
    assert "Allocated memory" in summary and "Peak Usage" in summary and "tpu:0" in summary
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total
    del x


FORK = r"""
import os, torch
from torch.utils.data import DataLoader, Dataset

class DS(Dataset):
    def __len__(self): return 8
    def __getitem__(self, i): return torch.full((3,), float(i))

w = torch.ones(3, device="tpu")
got = [(b.to("tpu") * w).sum().item() for b in DataLoader(DS(), batch_size=2, num_workers=2)]
assert got == [3.0, 15.0, 27.0, 39.0], got

r, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    msgs = []
    for f in (lambda: torch.ones(1, device="tpu"), lambda: w.cpu(), lambda: w + 1):
        try:
            f()
            msgs.append("no error")
        except RuntimeError as e:
            msgs.append(str(e))
    msgs.append(str(torch.tpu._is_in_bad_fork()))
    os.write(wfd, "\n".join(msgs).encode())
    os._exit(0)
os.close(wfd)
_, status = os.waitpid(pid, 0)
print("CHILD", os.read(r, 65536).decode().replace("\n", " | "), "STATUS", status)
print("PARENT", (w + 1).sum().item())
"""


def test_forked_children_and_dataloader_workers() -> None:
    r = run_python(FORK, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    child = r.stdout.split("CHILD ", 1)[1]
    assert child.count("forked subprocess") == 3 and "True" in child and "STATUS 0" in child, child
    assert "PARENT 6.0" in r.stdout


TRAIN = r"""
import json, os, signal, sys, torch
ckpt, steps, kill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0); torch.tpu.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
start, losses = 0, []
if os.path.exists(ckpt):
    s = torch.load(ckpt, weights_only=False)
    model.load_state_dict(s["model"]); opt.load_state_dict(s["opt"])
    torch.set_rng_state(s["cpu_rng"]); torch.tpu.set_rng_state(s["tpu_rng"])
    start, losses = s["step"], s["losses"]
for step in range(start, steps):
    x = torch.randn(32, 8)  # CPU RNG: the data order
    y = x.sum(1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x.to("tpu")), y.to("tpu"))  # tpu RNG: dropout
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "cpu_rng": torch.get_rng_state(),
                "tpu_rng": torch.tpu.get_rng_state(), "step": step + 1, "losses": losses}, ckpt + ".tmp")
    os.replace(ckpt + ".tmp", ckpt)
    if step + 1 == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
print("LOSSES " + json.dumps(losses))
"""


def test_sigkill_between_steps_then_resume_gives_the_same_curve(tmp_path: os.PathLike) -> None:
    def run(ckpt: str, kill_after: int):
        return run_python(TRAIN.replace("sys.argv[1], int(sys.argv[2]), int(sys.argv[3])",
                                        f"{ckpt!r}, 6, {kill_after}"), timeout=180)

    full = run(str(tmp_path / "a.pt"), -1)
    assert full.returncode == 0, full.stderr[-2000:]
    ref = json.loads(full.stdout.split("LOSSES ", 1)[1])
    killed = run(str(tmp_path / "b.pt"), 3)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    resumed = run(str(tmp_path / "b.pt"), -1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = json.loads(resumed.stdout.split("LOSSES ", 1)[1])
    print("uninterrupted", ref, "\nkilled after 3 + resumed", got)
    assert len(got) == 6 and got == ref
    assert ref[-1] < ref[0]
