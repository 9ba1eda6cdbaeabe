"""Tiny-Llama greedy decode (transformers generate, static KV cache, 32 new tokens) on tpu:
strict eager vs fused eager (DEFER_AND_FUSE), median ms per token over interleaved runs after two
warm-up runs, how many programs each mode still compiles per token after warm-up (goal: 0), and
PJRT launches and host reads per token, vs PyTorch CPU eager. generate() runs with
disable_compile=True: transformers otherwise torch.compiles the forward of a static-cache model
on a "tpu" device, and the benchmark would time a compiled graph in both eager modes."""

from __future__ import annotations

from typing import Any

import torch
import torch_tpu
import transformers
from bench_common import TPU, finish, fmt_ratio, interleaved, median, ratio, sync
from torch_tpu import EagerMode, set_eager_mode

NAME = "decode"
NEW_TOKENS = 32
WARMUP = 2
REPEATS = 5
GOAL_FUSED_OVER_STRICT = 1.5


def build() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 256, (1, 8))


def generate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          cache_implementation="static", pad_token_id=0, disable_compile=True)


def runner(model: torch.nn.Module, ids: torch.Tensor, mode: EagerMode | None) -> Any:
    def fn() -> torch.Tensor:
        with torch.no_grad():
            if mode is None:
                return generate(model, ids)
            with set_eager_mode(mode):
                out = generate(model, ids)
                sync()
            return out

    return fn


def run() -> dict[str, Any]:
    model, ids = build()
    cpu_model = model
    model = build()[0].to(TPU)  # same seed: same weights
    tpu_ids = ids.to(TPU)
    fns = {"cpu": runner(cpu_model, ids, None), "strict": runner(model, tpu_ids, EagerMode.DEFER_NEVER),
           "fused": runner(model, tpu_ids, EagerMode.DEFER_AND_FUSE)}
    tokens = {}
    new_programs = {}
    per_token: dict[str, dict[str, float]] = {}
    for name, fn in fns.items():
        for _ in range(WARMUP):
            tokens[name] = fn().cpu()[0].tolist()
        before, stats = torch_tpu.cache_stats()["misses"], torch_tpu.dispatch_stats()
        fn()
        new_programs[name] = (torch_tpu.cache_stats()["misses"] - before) / NEW_TOKENS
        after = torch_tpu.dispatch_stats()
        per_token[name] = {k: (after[k] - stats[k]) / NEW_TOKENS for k in ("ops", "launches", "host_syncs")}
    times = interleaved(fns, REPEATS)
    ms = {name: median(ts) * 1e3 / NEW_TOKENS for name, ts in times.items()}
    same = tokens["strict"] == tokens["cpu"] and tokens["fused"] == tokens["cpu"]
    speedup = ms["strict"] / ms["fused"]
    ratios = [ratio("fused/strict speedup", speedup, GOAL_FUSED_OVER_STRICT, higher_is_better=True)]
    summary = (
        f"{NAME}: ms/token cpu {ms['cpu']:.2f}, strict {ms['strict']:.2f} "
        f"({new_programs['strict']:.2f} new programs/token), fused {ms['fused']:.2f} "
        f"({new_programs['fused']:.2f} new programs/token), launches/token strict "
        f"{per_token['strict']['launches']:.1f} fused {per_token['fused']['launches']:.2f} "
        f"({per_token['fused']['ops']:.1f} ops, {per_token['fused']['host_syncs']:.2f} host reads), "
        f"tokens match cpu: {same} | "
        + ", ".join(fmt_ratio(r) for r in ratios)
    )
    return finish(NAME, {"description": __doc__, "ms_per_token": ms, "times_s": times,
                         "new_programs_per_token_after_warmup": new_programs, "per_token": per_token,
                         "tokens_match_cpu": same,
                         "ratios": ratios, "summary": summary})


if __name__ == "__main__":
    run()
