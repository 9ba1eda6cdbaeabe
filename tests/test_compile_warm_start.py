"""Warm start across processes: PyTorch's AOTAutogradCache (and Dynamo's precompile cache)
serve the tpu backend's graphs, whose XLA executables come from TORCH_TPU_CACHE_DIR."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Compiles the same tiny model twice: with PyTorch's default caches (AOTAutogradCache), then with
# Dynamo's caching precompile on (its AOTAutograd key differs: it holds the precompile backend id).
# No torch.compiler.save_cache_artifacts() call: torch_tpu writes Dynamo's packages at exit.
CHILD = r"""
import json, sys
import torch, torch_tpu
from torch._dynamo.utils import counters

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to("tpu")
x = torch.randn(3, 8).to("tpu")
result = {}
# training first (default caches): forward + backward graphs, cached together
n = len(torch_tpu.compile_stats()["graph_tiers"])
loss = torch.compile(model, backend="tpu")(x).square().sum()
loss.backward()
result["train"] = {"loss": loss.item(), "grads": [p.grad.cpu().flatten().tolist() for p in model.parameters()],
                   "tiers": torch_tpu.compile_stats()["graph_tiers"][n:]}
model.zero_grad(set_to_none=True)
for precompile in (False, True):
    torch._dynamo.reset()
    torch._dynamo.config.caching_precompile = precompile
    counters.clear()
    n = len(torch_tpu.compile_stats()["graph_tiers"])
    with torch.no_grad():
        out = torch.compile(model, backend="tpu")(x).cpu()
    result[str(precompile)] = {"out": out.tolist(), "tiers": torch_tpu.compile_stats()["graph_tiers"][n:],
                               "dynamo": dict(counters["dynamo_cache"])}
print(json.dumps(result))
"""


def _run(tmp: Path) -> dict:
    env = {**os.environ, "TORCH_TPU_CACHE_DIR": str(tmp / "xla"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "torch")}
    env.pop("TORCH_CACHING_PRECOMPILE", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_hits_aot_autograd_and_dynamo_caches(tmp_path: Path) -> None:
    import torch

    cold, warm = _run(tmp_path), _run(tmp_path)
    # cold: everything traced, XLA compiles once
    assert [(t["aot"], t["xla"]) for t in cold["False"]["tiers"]] == [("traced", "xla_compiled")]
    assert cold["True"]["dynamo"].get("dynamo_cache_miss") == 1
    # warm, PyTorch's defaults: Dynamo traces, AOTAutogradCache gives the graph, XLA loads from disk
    assert [(t["aot"], t["xla"]) for t in warm["False"]["tiers"]] == [("aot_cache", "xla_disk")]
    # warm, caching precompile: the Dynamo frame is installed from disk too (nothing traced)
    assert warm["True"]["dynamo"].get("dynamo_cache_hit") == 1
    # ... and its program is not compiled again: the rebuilt graph gets the same default XLA options
    # (compile.graph_defaults) as the saving process, so the program key matches
    assert [t["aot"] for t in warm["True"]["tiers"]] == ["aot_cache"]
    assert all(t["xla"] in ("xla_memory", "xla_disk") for t in warm["True"]["tiers"]), warm["True"]["tiers"]
    # training: the forward and backward programs, both from AOTAutogradCache in the warm process
    assert [(t["aot"], t["xla"]) for t in cold["train"]["tiers"]] == [("traced", "xla_compiled")] * 2
    assert [(t["aot"], t["xla"]) for t in warm["train"]["tiers"]] == [("aot_cache", "xla_disk")] * 2
    assert warm["train"]["loss"] == cold["train"]["loss"]
    assert warm["train"]["grads"] == cold["train"]["grads"]
    for run in (cold["True"], warm["False"], warm["True"]):
        torch.testing.assert_close(torch.tensor(run["out"]), torch.tensor(cold["False"]["out"]), rtol=0, atol=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(torch.tensor(cold["False"]["out"]), ref, rtol=1e-5, atol=1e-5)
    loss = model(x).square().sum()
    loss.backward()
    assert abs(loss.item() - cold["train"]["loss"]) < 1e-4
    for p, g in zip(model.parameters(), cold["train"]["grads"], strict=True):
        torch.testing.assert_close(torch.tensor(g), p.grad.flatten(), rtol=1e-4, atol=1e-5)


def test_aot_key_carries_the_torch_tpu_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same graph hits AOTAutogradCache again, and misses it once the torch_tpu tag (lowered
    ops + tracing sources) differs: an upgrade never reuses a graph traced with another table."""
    import torch
    from torch._dynamo.utils import counters
    from torch_tpu._internal import compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = torch.nn.Linear(4, 3).to("tpu")
    x = torch.randn(2, 4).to("tpu")

    def compile_once() -> dict[str, int]:
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            torch.compile(model, backend="tpu")(x).cpu()
        return dict(counters["aot_autograd"])

    assert compile_once().get("autograd_cache_miss") == 1
    assert compile_once().get("autograd_cache_hit") == 1
    monkeypatch.setattr(compile_cache, "_TAG", [compile_cache.backend_tag() + "-other"])
    assert compile_once().get("autograd_cache_miss") == 1
