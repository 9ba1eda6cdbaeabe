"""One training step of a tiny random-weight Llama (AdamW, fused), all measured in this run,
interleaved: torch.tpu.optimizers.SingleTraceTrainer (forward + backward + update as ONE program),
strict-eager tpu, PyTorch CPU eager, and Inductor on CPU (compiled model forward/backward, eager
fused AdamW). Reports ms/step medians, the trainer's launches per step and programs built."""

from __future__ import annotations

import copy
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

NAME = "train_step"
BATCH, SEQ = 2, 64
WARMUP, REPEATS = 2, 7
INDUCTOR_BUDGET_S = 240


def build_model() -> transformers.LlamaForCausalLM:
    return small_llama(SEQ).train()


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def eager_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
               forward: Callable[..., Any] | None = None) -> Callable[[], Any]:
    def step() -> torch.Tensor:
        loss = (model if forward is None else forward)(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ids.device.type == TPU:
            sync()
        return loss
    return step


def run() -> dict[str, Any]:
    warnings.simplefilter("ignore")
    base = build_model()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids_t = ids.to(TPU)

    m_trainer = copy.deepcopy(base).to(TPU)
    trainer = torch.tpu.optimizers.SingleTraceTrainer(
        m_trainer, torch.optim.AdamW(m_trainer.parameters(), lr=1e-3, fused=True), loss_fn)

    def trainer_step() -> torch.Tensor:
        loss = trainer(ids_t)
        sync()
        return loss

    m_eager = copy.deepcopy(base).to(TPU)
    m_cpu = copy.deepcopy(base)
    m_ind = copy.deepcopy(base)
    fns: dict[str, Callable[[], Any]] = {
        "tpu_single_trace": trainer_step,
        "tpu_strict": eager_step(m_eager, torch.optim.AdamW(m_eager.parameters(), lr=1e-3, fused=True), ids_t),
        "cpu_eager": one_thread(eager_step(m_cpu, torch.optim.AdamW(m_cpu.parameters(), lr=1e-3, fused=True), ids)),
    }
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    first["tpu_single_trace"] = _timed(trainer_step)
    ind_fwd = torch.compile(m_ind)
    ind = one_thread(eager_step(m_ind, torch.optim.AdamW(m_ind.parameters(), lr=1e-3, fused=True), ids, ind_fwd))
    t1 = time.perf_counter()
    try:
        first["cpu_inductor"] = _timed(ind)
        fns["cpu_inductor"] = ind
    except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
        first["cpu_inductor_error"] = repr(e)[:300]  # type: ignore[assignment]
    if time.perf_counter() - t1 > INDUCTOR_BUDGET_S:
        fns.pop("cpu_inductor", None)
    for _ in range(WARMUP):
        for fn in fns.values():
            fn()
    before = torch_tpu.dispatch_stats()["launches"]
    trainer_step()
    launches = torch_tpu.dispatch_stats()["launches"] - before
    times = interleaved(fns, REPEATS)
    ms = {k: 1000 * median(v) for k, v in times.items()}
    ratios = [
        ratio("train step single-trace vs tpu strict (speedup)", ms["tpu_strict"] / ms["tpu_single_trace"], None, True),
        ratio("train step single-trace vs CPU eager (speedup)", ms["cpu_eager"] / ms["tpu_single_trace"], None, True),
        ratio("train step single-trace vs Inductor (speedup)",
              ms["cpu_inductor"] / ms["tpu_single_trace"] if "cpu_inductor" in ms else None, None, True),
    ]
    summary = (f"{NAME}: ms/step single-trace {ms['tpu_single_trace']:.1f}, strict {ms['tpu_strict']:.1f}, "
               f"CPU eager {ms['cpu_eager']:.1f}, Inductor {ms.get('cpu_inductor', float('nan')):.1f}; "
               f"launches/step {launches}, programs {trainer.programs_built}; "
               + "; ".join(fmt_ratio(r) for r in ratios))
    return finish(NAME, {
        "description": __doc__,
        "model": {"hidden_size": HIDDEN, "layers": LAYERS, "vocab": VOCAB, "batch": BATCH, "seq": SEQ},
        "ms_per_step": ms, "times_s": times, "first_call_s": first, "setup_s": time.perf_counter() - t0,
        "single_trace_launches_per_step": launches, "single_trace_programs": trainer.programs_built,
        "ratios": ratios, "summary": summary,
    })


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    run()
