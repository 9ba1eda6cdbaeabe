"""Real-size MoE decode on tpu: decode tokens/s of a Qwen3-MoE and a Mixtral with realistic hidden and
expert sizes (hidden 2048, Qwen3-MoE 64 experts top-8 of width 768, Mixtral 8 experts top-2 of width
1408) but 2 layers and an 8192-token vocabulary, random bfloat16 weights, at batch 1 and batch 64.

Variants, timed alternately in one process (best of the repeats; prefill not timed):
- tpu "kernel": the experts (and RMSNorm) kernelized to the ragged-dot layer of torch_tpu's kernels
  repository (`kernels.kernelize(..., device="tpu")`), with the CPU plugin's host kernels (the ragged
  dot as an XLA FFI custom call into ATen's CPU GEMM) on, and "kernel_xla" with them off;
- tpu "grouped_mm": Transformers' default experts (`torch._grouped_mm`, lowered to the same host
  kernel), and "grouped_mm_xla" with the host kernels off;
- tpu "eager_loop": Transformers' `experts_implementation="eager"` per-expert loop;
- PyTorch on the CPU: "cpu_grouped_mm" (its default experts) and "cpu_eager_loop".

Every variant decodes greedily from the same prompt; the record says whether each one's tokens equal
the CPU grouped_mm model's (the reference) and how far its prefill logits are from them. Not part of
`make test`.

    cd benchmarks && nice -n 10 python bench_moe_decode.py [--steps N] [--repeats N] [--models a,b]
        [--batches 1,64] [--skip cpu_eager_loop,...]
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import TPU, finish, fmt_ratio, ratio, sync

NAME = "moe_decode"
PROMPT = 8
VOCAB = 8192


def build(kind: str) -> torch.nn.Module:
    """The model on the CPU in bfloat16, seed-0 random weights."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                                  num_key_value_heads=4, head_dim=128, max_position_embeddings=256)
    if kind == "qwen3_moe":
        cfg: Any = Qwen3MoeConfig(**common, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                                  intermediate_size=6144, decoder_sparse_step=1, norm_topk_prob=True)
        cls: Any = Qwen3MoeForCausalLM
    else:
        cfg = MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, intermediate_size=1408)
        cls = MixtralForCausalLM
    return cls._from_config(cfg, dtype=torch.bfloat16).eval()


class Switch:
    """One tpu model whose experts run Transformers' eager loop, its grouped_mm, or the kernelized
    ragged-dot layers (kernelize sets instance `forward`s; this keeps them and puts them back)."""

    def __init__(self, model: torch.nn.Module) -> None:
        import kernels
        import torch_tpu.kernels_repo as repo

        repo.mark_transformers_layers()
        self.model = model
        with kernels.use_kernel_mapping(repo.kernel_mapping()):
            kernels.kernelize(model, device="tpu", mode=kernels.Mode.INFERENCE)
        self.kernel_forwards = {m: m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__}
        if not self.kernel_forwards:
            raise RuntimeError("kernelize replaced no layer")

    def use(self, variant: str) -> None:
        import torch_tpu.ops

        kernel = variant.startswith("kernel")
        for m, fwd in self.kernel_forwards.items():
            if kernel:
                m.forward = fwd
            else:
                m.__dict__.pop("forward", None)
        self.model.config._experts_implementation = "eager" if variant == "eager_loop" else "grouped_mm"
        torch_tpu.ops.host_kernels(not variant.endswith("_xla"))


def decoder(model: torch.nn.Module, ids: torch.Tensor, steps: int, on_tpu: bool,
            before: Callable[[], None]) -> Callable[[], tuple[float, torch.Tensor, torch.Tensor]]:
    """Prefill (untimed), then `steps` greedy decode steps; returns (seconds, tokens, prefill logits)."""
    from transformers import DynamicCache

    def run() -> tuple[float, torch.Tensor, torch.Tensor]:
        before()
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            first = out.logits[:, -1].float()
            tok = first.argmax(-1, keepdim=True)
            toks = [tok]
            if on_tpu:
                sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                toks.append(tok)
            if on_tpu:
                sync()
            dt = time.perf_counter() - t0
        return dt, torch.cat(toks, 1).cpu(), first.cpu()

    return run


def case(kind: str, batches: list[int], steps: int, repeats: int, skip: set[str]) -> list[dict[str, Any]]:
    cpu_model = build(kind)
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    switch = Switch(tpu_model)
    results = []
    for batch in batches:
        ids = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(5))
        idd = ids.to(TPU)
        fns: dict[str, Callable[[], tuple[float, torch.Tensor, torch.Tensor]]] = {}
        for v in ("kernel", "kernel_xla", "grouped_mm", "grouped_mm_xla", "eager_loop"):
            fns[v] = decoder(tpu_model, idd, steps, True, lambda v=v, s=switch: s.use(v))
        for v, impl in (("cpu_grouped_mm", "grouped_mm"), ("cpu_eager_loop", "eager")):
            def cpu_impl(impl: str = impl, m: torch.nn.Module = cpu_model) -> None:
                m.config._experts_implementation = impl
            fns[v] = decoder(cpu_model, ids, steps, False, cpu_impl)
        for v in skip:
            fns.pop(v, None)
        first = {k: f() for k, f in fns.items()}  # warm-up: compiles every program once
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for k, f in fns.items():
                times[k].append(f()[0])
        ref = next(k for k in ("cpu_grouped_mm", "grouped_mm", *first) if k in first)  # --skip may drop any
        ref_toks, ref_logits = first[ref][1], first[ref][2]
        scale = ref_logits.abs().max().item()
        results.append({
            "model": kind, "batch": batch, "prompt": PROMPT, "decode_steps": steps,
            "tokens_per_s": {k: batch * steps / min(v) for k, v in times.items()},
            "reference": ref,
            "same_tokens_as_reference": {k: bool(torch.equal(r[1], ref_toks)) for k, r in first.items()},
            "prefill_logits_max_rel_diff_vs_reference": {
                k: (r[2] - ref_logits).abs().max().item() / scale for k, r in first.items()},
        })
        print(kind, batch, {k: round(v, 1) for k, v in results[-1]["tokens_per_s"].items()}, flush=True)
    switch.use("kernel")
    del cpu_model, tpu_model, switch
    gc.collect()
    return results


def run(models: list[str], batches: list[int], steps: int, repeats: int, skip: set[str]) -> dict[str, Any]:
    import torch_tpu.ops

    status = torch_tpu.ops.host_kernels()
    cases = [c for kind in models for c in case(kind, batches, steps, repeats, skip)]
    ratios = []
    for c in cases:
        tps, tag = c["tokens_per_s"], f"{c['model']} b{c['batch']}"
        for a, b in (("kernel", "eager_loop"), ("kernel", "kernel_xla"), ("grouped_mm", "grouped_mm_xla"),
                     ("kernel", "cpu_grouped_mm"), ("grouped_mm", "cpu_grouped_mm")):
            if a in tps and b in tps:
                ratios.append(ratio(f"{tag} {a}/{b}", tps[a] / tps[b], None, True))
    parts = [f"{c['model']} b{c['batch']} tok/s " + " ".join(f"{k} {v:.1f}" for k, v in c["tokens_per_s"].items())
             for c in cases]
    torch_tpu.ops.host_kernels(True)
    return finish(NAME, {
        "description": __doc__.strip().splitlines()[0] if __doc__ else NAME,
        "host_kernels": status,
        "dtype": "bfloat16",
        "cases": cases,
        "ratios": ratios,
        "summary": f"{NAME}: " + "; ".join(parts) + " | " + ", ".join(fmt_ratio(r) for r in ratios),
    })


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="qwen3_moe,mixtral")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--skip", default="", help="variants to leave out, e.g. cpu_eager_loop (slow on a loaded machine)")
    a = p.parse_args()
    run(a.models.split(","), [int(b) for b in a.batches.split(",")], a.steps, a.repeats,
        {v for v in a.skip.split(",") if v})
