"""HF `generate` of 256 tokens with the default DynamicCache on a tiny random-weight Llama, all
measured in this run: `model.forward = torch.compile(model.forward, backend="tpu")` (bounded
dynamic shapes: one program per KV-length bucket), strict-eager tpu, fused-eager tpu and PyTorch
CPU eager. Reports programs built by the first (cold) generation and by a second one (steady
state), ms/token medians, and whether the greedy tokens equal CPU eager's."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import bench_common  # noqa: F401  (sets HF_HUB_OFFLINE before transformers loads)
import torch
import torch_tpu
import transformers
from bench_common import (
    HIDDEN,
    LAYERS,
    TPU,
    VOCAB,
    finish,
    fmt_ratio,
    interleaved,
    median,
    one_thread,
    ratio,
    small_llama,
    sync,
)

NAME = "dynamic_generate"
PROMPT, NEW = 5, 256
REPEATS = 3


def build_model() -> transformers.LlamaForCausalLM:
    return small_llama(1024).eval()


def _programs() -> int:
    """XLA programs the runtime built: compiled by XLA or loaded from the disk cache (a program
    evicted from the bounded memory cache and loaded again counts again)."""
    c = torch_tpu.cache_stats()
    return int(c.get("misses", 0) + c.get("disk_hits", 0))


def run(fused: bool = True) -> dict[str, Any]:
    """`fused=False` leaves fused eager out (its first generation compiles one program per
    token: minutes on a loaded 2-core machine)."""
    warnings.simplefilter("ignore")
    base = build_model()
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ids_t = ids.to(TPU)

    def gen(model: Any, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            out = model.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            if x.device.type == TPU:
                sync()
            return out
        return call

    m_cpu = copy.deepcopy(base)
    m_strict = copy.deepcopy(base).to(TPU)
    m_fused = copy.deepcopy(base).to(TPU)
    m_comp = copy.deepcopy(base).to(TPU)
    m_comp.forward = torch.compile(m_comp.forward, backend="tpu")

    def run_fused() -> torch.Tensor:
        with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
            return gen(m_fused, ids_t)()

    fns: dict[str, Callable[[], Any]] = {
        "tpu_compiled_dynamic": gen(m_comp, ids_t),
        "tpu_strict": gen(m_strict, ids_t),
        "tpu_fused": run_fused,
        "cpu_eager": one_thread(gen(m_cpu, ids)),
    }
    if not fused:
        del fns["tpu_fused"]
    ref = fns["cpu_eager"]()
    cold: dict[str, dict[str, Any]] = {}
    for name, fn in fns.items():
        if name == "cpu_eager":
            continue
        before, g0 = _programs(), len(torch_tpu.compile_stats()["graph_tiers"])
        t0 = time.perf_counter()
        out = fn()
        first_s = time.perf_counter() - t0
        built, graphs = _programs() - before, len(torch_tpu.compile_stats()["graph_tiers"]) - g0
        before, g0 = _programs(), len(torch_tpu.compile_stats()["graph_tiers"])
        again = fn()
        cold[name] = {"first_s": first_s, "programs_first": built, "graph_programs_first": graphs,
                      "programs_second": _programs() - before,
                      "graph_programs_second": len(torch_tpu.compile_stats()["graph_tiers"]) - g0,
                      "tokens_equal_cpu": bool(torch.equal(out.cpu(), ref) and torch.equal(again.cpu(), ref))}
    buckets = [b for b in torch_tpu.compile_stats()["dynamic"]]
    times = interleaved(fns, REPEATS)
    ms = {k: 1000 * median(v) / NEW for k, v in times.items()}
    bound = math.ceil(math.log2(PROMPT + NEW)) + 2
    c = cold["tpu_compiled_dynamic"]
    ratios = [
        ratio("compiled dynamic-cache generate vs tpu strict (speedup)", ms["tpu_strict"] / ms["tpu_compiled_dynamic"],
              None, True),
        ratio("compiled dynamic-cache generate vs CPU eager (speedup)", ms["cpu_eager"] / ms["tpu_compiled_dynamic"],
              None, True),
        ratio("compiled graph programs per 256-token generate (vs bound)", c["graph_programs_first"] / bound, 1.0,
              False),
    ]
    fused_txt = (f"fused {cold['tpu_fused']['programs_first']} (second generate "
                 f"{cold['tpu_fused']['programs_second']})" if fused else "fused not run")
    summary = (f"{NAME}: ms/token compiled {ms['tpu_compiled_dynamic']:.2f}, strict {ms['tpu_strict']:.2f}, "
               + (f"fused {ms['tpu_fused']:.2f}, " if fused else "") + f"CPU eager {ms['cpu_eager']:.2f}; compiled: "
               f"{c['graph_programs_first']} graph programs (bound {bound}), {c['programs_first']} XLA programs in "
               f"all (with generate's own eager ops), {c['graph_programs_second']} graph / {c['programs_second']} XLA "
               f"programs in a second generate; XLA programs: "
               f"strict {cold['tpu_strict']['programs_first']} (second generate "
               f"{cold['tpu_strict']['programs_second']}), {fused_txt}; tokens equal CPU: "
               f"{all(v['tokens_equal_cpu'] for v in cold.values())}; " + "; ".join(fmt_ratio(r) for r in ratios))
    return finish(NAME, {
        "description": __doc__,
        "model": {"hidden_size": HIDDEN, "layers": LAYERS, "vocab": VOCAB, "prompt": PROMPT, "new_tokens": NEW},
        "ms_per_token": ms, "times_s": times, "cold": cold, "program_bound": bound, "buckets": buckets,
        "ratios": ratios, "summary": summary,
    })


if __name__ == "__main__":
    import sys

    run(fused="--no-fused" not in sys.argv)
