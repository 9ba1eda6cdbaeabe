"""HF `generate` of 256 tokens with the default DynamicCache on a tiny random-weight Llama, all
measured in this run: `model.forward = torch.compile(model.forward, backend="tpu")` (bounded
dynamic shapes: one program per KV-length bucket), strict-eager tpu, fused-eager tpu and PyTorch
CPU eager; each tpu variant also with `torch_tpu.mark_dynamic(input_ids, 1)` and
`mark_dynamic(attention_mask, 1)` (eager bounded dynamism: generate's own eager ops, and in eager
the whole model, run as one program per length bucket). Reports programs built by the first (cold)
generation and by a second one (steady state), ms/token medians, and whether the greedy tokens
equal CPU eager's. `--no-fused` leaves fused eager out, `--marked-only` the unmarked variants,
`--python-path` adds the marked eager variants with the C++ fast path for repeated bucketed calls
turned off (every bucketed op through Python, as before that path existed)."""

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


def _us_per_call(fn: Callable[[], Any], n: int = 200) -> float:
    for _ in range(20):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t0) / n


def per_op(rounds: int = 5) -> dict[str, dict[str, float]]:
    """µs per eager op on a tensor of length 20 along the marked dim: unmarked, marked with the C++
    fast path (a repeated bucketed call runs without Python), marked through Python on every
    call; best of `rounds` alternated rounds."""
    from torch_tpu._internal.eager_dynamic import set_fast_path

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 20, 64, generator=g).to(TPU)
    tail = torch.randn(1, 1, 64, generator=g).to(TPU)
    ids = torch.randint(0, 100, (20,), generator=g).to(TPU)
    table = torch.randn(100, 64, generator=g).to(TPU)
    q = torch.randn(1, 4, 1, 16, generator=g).to(TPU)
    k = torch.randn(1, 4, 20, 16, generator=g).to(TPU)
    ops: dict[str, tuple[torch.Tensor, int, Callable[[torch.Tensor], Any]]] = {
        "mul": (x, 1, lambda a: a * 2),
        "cat (KV-cache append)": (x, 1, lambda a: torch.cat([a, tail], 1)),
        "index_select (embedding rows)": (ids, 0, lambda a: table.index_select(0, a)),
        "attention scores matmul": (k, 2, lambda a: q @ a.transpose(-1, -2)),
        "sum over the dynamic dim": (x, 1, lambda a: a.sum(1)),
        "last-position slice + add": (x, 1, lambda a: a[:, -1:] + 1),
    }
    out: dict[str, dict[str, float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k marks a dim with heads before it: strided results
        for name, (a, dim, f) in ops.items():
            am = torch_tpu.mark_dynamic(a.clone(), dim)
            runs: dict[str, list[float]] = {"unmarked": [], "marked_fast": [], "marked_python": []}
            for _ in range(rounds):
                runs["unmarked"].append(_us_per_call(lambda f=f, a=a: f(a)))
                for mode in ("marked_fast", "marked_python"):
                    prev = set_fast_path(mode == "marked_fast")
                    try:
                        runs[mode].append(_us_per_call(lambda f=f, am=am: f(am)))
                    finally:
                        set_fast_path(prev)
            out[name] = {k: min(v) for k, v in runs.items()}
    return out


def run(fused: bool = True, unmarked: bool = True, python_path: bool = False) -> dict[str, Any]:
    """`fused=False` leaves fused eager out (unmarked, its first generation compiles one program
    per token: minutes on a loaded 2-core machine); `unmarked=False` runs only the marked tpu
    variants; `python_path=True` adds the marked eager variants with the C++ fast path for
    bucketed calls turned off."""
    warnings.simplefilter("ignore")
    base = build_model()
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ids_t = ids.to(TPU)

    def gen(model: Any, x: torch.Tensor, mark: bool = False) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            ids_, mask = x, torch.ones_like(x)
            if mark:  # fresh tensors each generate, marked as a user would
                ids_, mask = x.clone(), torch.ones_like(x)
                torch_tpu.mark_dynamic(ids_, 1)
                torch_tpu.mark_dynamic(mask, 1)
            out = model.generate(ids_, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            if x.device.type == TPU:
                sync()
            return out
        return call

    m_cpu = copy.deepcopy(base)
    m_strict = copy.deepcopy(base).to(TPU)
    m_fused = copy.deepcopy(base).to(TPU)
    m_comp = copy.deepcopy(base).to(TPU)
    m_comp.forward = torch.compile(m_comp.forward, backend="tpu")

    def fused_mode(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
                return fn()
        return call

    fns: dict[str, Callable[[], Any]] = {
        "tpu_compiled_dynamic": gen(m_comp, ids_t),
        "tpu_strict": gen(m_strict, ids_t),
        "tpu_fused": fused_mode(gen(m_fused, ids_t)),
        "tpu_compiled_dynamic_marked": gen(m_comp, ids_t, True),
        "tpu_strict_marked": gen(m_strict, ids_t, True),
        "tpu_fused_marked": fused_mode(gen(m_fused, ids_t, True)),
        "cpu_eager": one_thread(gen(m_cpu, ids)),
    }
    if python_path:  # the marked eager variants with the C++ fast path off (Python on every call)
        def no_fast(fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                from torch_tpu._internal.eager_dynamic import set_fast_path

                prev = set_fast_path(False)
                try:
                    return fn()
                finally:
                    set_fast_path(prev)
            return call

        fns["tpu_strict_marked_python"] = no_fast(fns["tpu_strict_marked"])
        fns["tpu_fused_marked_python"] = no_fast(fns["tpu_fused_marked"])
    if not fused:
        for k in ("tpu_fused", "tpu_fused_marked", "tpu_fused_marked_python"):
            fns.pop(k, None)
    if not unmarked:
        for k in ("tpu_compiled_dynamic", "tpu_strict", "tpu_fused"):
            fns.pop(k, None)
    ops_us = per_op()
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
    ratios = []
    for k in cold:
        if k.endswith("_marked") and k[: -len("_marked")] in cold:
            base_k = k[: -len("_marked")]
            ratios.append(ratio(f"{base_k}: XLA programs per generate, unmarked / marked (fewer)",
                                cold[base_k]["programs_first"] / max(1, cold[k]["programs_first"]), None, True))
    for k in cold:
        ratios.append(ratio(f"{k} vs CPU eager (speedup)", ms["cpu_eager"] / ms[k], None, True))
    for k in ("tpu_strict_marked", "tpu_fused_marked"):
        if k + "_python" in ms:
            ratios.append(ratio(f"{k}: C++ fast path vs Python per bucketed call (speedup)",
                                ms[k + "_python"] / ms[k], None, True))
    if "tpu_compiled_dynamic" in cold:
        ratios.append(ratio("compiled graph programs per 256-token generate (vs bound)",
                            cold["tpu_compiled_dynamic"]["graph_programs_first"] / bound, 1.0, False))
    parts = [f"{k}: {ms[k]:.2f} ms/token, {v['programs_first']} XLA programs ({v['graph_programs_first']} graph) "
             f"first generate, {v['programs_second']} second" for k, v in cold.items()]
    for name, v in ops_us.items():
        ratios.append(ratio(f"per-op {name}: marked (C++ fast path) / unmarked (time, {v['marked_fast']:.1f} vs "
                            f"{v['unmarked']:.1f} us; through Python {v['marked_python']:.1f} us)",
                            v["marked_fast"] / v["unmarked"], 3.0, False))
    summary = (f"{NAME}: " + "; ".join(parts) + f"; CPU eager {ms['cpu_eager']:.2f} ms/token; graph-program bound "
               f"{bound}; tokens equal CPU: {all(v['tokens_equal_cpu'] for v in cold.values())}; "
               + "; ".join(fmt_ratio(r) for r in ratios))
    return finish(NAME, {
        "description": __doc__,
        "model": {"hidden_size": HIDDEN, "layers": LAYERS, "vocab": VOCAB, "prompt": PROMPT, "new_tokens": NEW},
        "ms_per_token": ms, "per_op_us": ops_us, "times_s": times, "cold": cold, "program_bound": bound, "buckets": buckets,
        "ratios": ratios, "summary": summary,
    })


if __name__ == "__main__":
    import sys

    run(fused="--no-fused" not in sys.argv, unmarked="--marked-only" not in sys.argv,
        python_path="--python-path" in sys.argv)
