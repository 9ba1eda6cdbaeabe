"""Cost of device-side error checks (on by default) on the tiny-Llama greedy decode step of
bench_compile.py (static KV cache, batch 1): strict eager and torch.compile(backend="tpu"), checks
on vs off (`torch_tpu._C._set_device_checks`), measured interleaved in this run. The decode step
has checked ops (embedding, the cache's index_copy_); goal: on/off <= 1.03 in both modes."""

from __future__ import annotations

import argparse
from typing import Any

import bench_common  # noqa: F401  (sets HF_HUB_OFFLINE before transformers loads)
import torch
from bench_common import TPU, finish, fmt_ratio, interleaved, median, ratio
from bench_compile import DECODE_TOKENS, Variant, build_model, next_token
from torch_tpu import _C

NAME = "device_checks"
GOAL = 1.03  # checks-on time <= 1.03x checks-off time


def step_checked(*a: Any) -> torch.Tensor:  # distinct code objects: one compiled graph each
    return next_token(*a)


def step_unchecked(*a: Any) -> torch.Tensor:
    return next_token(*a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model = build_model().to(TPU)
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    variants = {
        "strict_on": (Variant("strict_on", model, TPU, next_token, ids), True),
        "strict_off": (Variant("strict_off", model, TPU, next_token, ids), False),
        "compiled_on": (
            Variant("compiled_on", model, TPU, torch.compile(step_checked, backend="tpu", dynamic=False), ids),
            True,
        ),
        "compiled_off": (
            Variant("compiled_off", model, TPU, torch.compile(step_unchecked, backend="tpu", dynamic=False), ids),
            False,
        ),
    }
    toks = {}
    for name, (v, on) in variants.items():  # warm-up: compiles (each graph built with its setting)
        _C._set_device_checks(on)
        v.timed("prefill")
        v.timed("decode")
        toks[name] = v.decode().cpu().item()

    def run(v: Variant, on: bool) -> float:
        _C._set_device_checks(on)
        return v.timed("decode")

    times = interleaved({n: (lambda v=v, on=on: run(v, on)) for n, (v, on) in variants.items()}, args.repeats)
    _C._set_device_checks(True)
    ms = {n: 1000 * median(t) / DECODE_TOKENS for n, t in times.items()}
    ratios = [
        ratio("strict_on_over_off", ms["strict_on"] / ms["strict_off"], GOAL, higher_is_better=False),
        ratio("compiled_on_over_off", ms["compiled_on"] / ms["compiled_off"], GOAL, higher_is_better=False),
    ]
    summary = (
        f"{NAME}: decode ms/token strict on {ms['strict_on']:.2f} off {ms['strict_off']:.2f}, compiled on "
        f"{ms['compiled_on']:.2f} off {ms['compiled_off']:.2f}; " + "; ".join(fmt_ratio(r) for r in ratios)
    )
    finish(NAME, {
        "summary": summary,
        "ms_per_token": ms,
        "raw_seconds": times,
        "same_tokens": len(set(toks.values())) == 1,
        "decode_tokens": DECODE_TOKENS,
        "repeats": args.repeats,
        "ratios": ratios,
    })


if __name__ == "__main__":
    main()
