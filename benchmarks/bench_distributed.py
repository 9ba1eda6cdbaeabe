"""tpu_dist on 2 processes: all_reduce of tpu tensors vs gloo on the same data in CPU tensors, and
tensor-parallel decode of a tiny Llama (2 processes) vs one process, measured in the same run.

Run: `python benchmarks/bench_distributed.py` (starts its own 2 worker processes like torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NAME = "distributed"
SIZES_MIB = (4, 64)
REPEATS = 15
DECODE_TOKENS = 16
GOAL_ALLREDUCE = 0.8  # tpu_dist time must be within 1/0.8 of gloo on CPU tensors


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ worker (one rank)
def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _allreduce(dist: Any, torch: Any, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A group without the rank-agreement check shows what the check costs.
    os.environ["TORCH_TPU_DIST_CHECK"] = "0"
    unchecked = dist.new_group([0, 1], backend="cpu:gloo,tpu:tpu_dist")
    os.environ.pop("TORCH_TPU_DIST_CHECK")
    for mib in SIZES_MIB:
        n = mib * (1 << 20) // 4
        cpu = torch.full((n,), float(rank + 1))
        tpu = cpu.to("tpu")

        def run_cpu(cpu: Any = cpu) -> None:
            dist.all_reduce(cpu)

        def run_tpu(group: Any = None, tpu: Any = tpu) -> None:
            dist.all_reduce(tpu, group=group)
            torch.tpu.synchronize()

        fns = {"gloo_cpu": run_cpu, "tpu_dist": run_tpu, "tpu_dist_nocheck": lambda: run_tpu(unchecked)}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(REPEATS):
            for k, fn in fns.items():
                dist.barrier()
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        med = {k: _median(v) * 1e3 for k, v in times.items()}
        out[f"{mib}MiB"] = {"ms": med, "ratio_vs_gloo": med["gloo_cpu"] / med["tpu_dist"],
                            "ratio_vs_gloo_nocheck": med["gloo_cpu"] / med["tpu_dist_nocheck"]}
    return out


def _decode(dist: Any, torch: Any, rank: int) -> dict[str, Any]:
    import transformers as tf
    from transformers.distributed import DistributedConfig

    path = [tempfile.mkdtemp(prefix="bench_dist_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if rank == 0:
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
        tf.LlamaForCausalLM(cfg).save_pretrained(path[0])
    dist.barrier()
    ids = torch.tensor([[1, 5, 9, 3, 7, 11, 2, 4]], device="tpu")
    kw = {"max_new_tokens": DECODE_TOKENS, "min_new_tokens": DECODE_TOKENS, "do_sample": False}

    def ms_per_token(model: Any) -> tuple[float, list[int]]:
        model.generate(ids, **kw)  # warm-up: compiles every program
        best = []
        for _ in range(3):
            torch.tpu.synchronize()
            t = time.perf_counter()
            toks = model.generate(ids, **kw)
            torch.tpu.synchronize()
            best.append((time.perf_counter() - t) * 1e3 / DECODE_TOKENS)
        return _median(best), toks[0].tolist()

    single_ms, single_toks = None, None
    if rank == 0:  # one process (the other waits at the barrier)
        ref = tf.AutoModelForCausalLM.from_pretrained(path[0]).to("tpu")
        single_ms, single_toks = ms_per_token(ref)
        del ref
    dist.barrier()
    tp = tf.AutoModelForCausalLM.from_pretrained(path[0], distributed_config=DistributedConfig(tp_plan="auto"))
    tp_ms, tp_toks = ms_per_token(tp)
    # Same model with small collectives sent after the agreement check instead of inside it
    # (two gloo round trips per collective, as before the inline path existed).
    from torch_tpu.distributed import _backend

    inline, _backend._INLINE_BYTES = _backend._INLINE_BYTES, 0
    two_trip_ms, _ = ms_per_token(tp)
    _backend._INLINE_BYTES = inline
    return {"single_process_ms_per_token": single_ms, "tp2_ms_per_token": tp_ms,
            "tp2_two_round_trips_ms_per_token": two_trip_ms, "inline_speedup": two_trip_ms / tp_ms,
            "tokens_equal": None if single_toks is None else single_toks == tp_toks,
            "ratio_tp2_vs_single": None if single_ms is None else single_ms / tp_ms}


def worker() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    rank = dist.get_rank()
    res = {"allreduce": _allreduce(dist, torch, rank), "decode": _decode(dist, torch, rank)}
    if rank == 0:
        print("@@BENCH " + json.dumps(res), flush=True)
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver
def run() -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from bench_common import finish, fmt_ratio, ratio

    port = _free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("TORCH_TPU_NUM_DEVICES", None)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a benchmark worker failed:\n" + "\n".join(o[-2000:] for o in outs))
    res = json.loads(next(line for line in outs[0].splitlines() if line.startswith("@@BENCH "))[8:])
    ratios = [ratio(f"all_reduce {k} f32 tpu_dist vs gloo(CPU tensors)", v["ratio_vs_gloo"], GOAL_ALLREDUCE, True)
              for k, v in res["allreduce"].items()]
    ratios += [ratio(f"all_reduce {k} (no agreement check) vs gloo", v["ratio_vs_gloo_nocheck"], None, True)
               for k, v in res["allreduce"].items()]
    ratios.append(ratio("TP decode 2 processes vs 1 (ms/token)", res["decode"]["ratio_tp2_vs_single"], None, True))
    ratios.append(ratio("TP decode, small collectives in 1 vs 2 round trips", res["decode"]["inline_speedup"],
                        None, True))
    dec = res["decode"]
    summary = "distributed: " + "; ".join(fmt_ratio(r) for r in ratios) + (
        f"; decode ms/token 1 proc {dec['single_process_ms_per_token']:.1f}, "
        f"2 procs TP {dec['tp2_ms_per_token']:.1f} (2 round trips: {dec['tp2_two_round_trips_ms_per_token']:.1f}), "
        f"tokens equal {dec['tokens_equal']}")
    return finish(NAME, {"results": res, "ratios": ratios, "summary": summary})


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        run()
