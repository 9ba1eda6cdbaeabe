"""Hugging Face Transformers models (seeded random weights, hidden 256, 4 layers, seq 128, batch 4):
forward and one training step (forward + backward + AdamW step), strict eager on tpu vs PyTorch CPU
eager in the same process (the faster of default threads and one thread). Each timed tpu call
ends with a sync."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import bench_common  # noqa: F401  (sets HF_HUB_OFFLINE before transformers loads)
import torch
import torch_tpu
import transformers
from bench_common import TPU, finish, fmt_ratio, interleaved, median, one_thread, ratio, sync, time_call

NAME = "models_hf"
HIDDEN, LAYERS, HEADS, FFN, SEQ, BATCH, VOCAB = 256, 4, 4, 1024, 128, 4, 1024
WARMUP = 1
REPEATS = 3
GOAL_MAX_RATIO = None  # the brief sets no goal: ratios are reported as measured

transformers.utils.logging.set_verbosity_error()

Builder = Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]]


def _ids(seed: int, shape: tuple[int, ...] = (BATCH, SEQ)) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                   max_position_embeddings=2 * SEQ)
    ids = _ids(1)
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, lambda o: o.loss


def gpt2() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                                  n_positions=2 * SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids(2)
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}, lambda o: o.loss


def bert() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=2 * SEQ,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1:, SEQ // 2:] = 0  # a padded batch
    return (transformers.BertModel(cfg), {"input_ids": _ids(3), "attention_mask": mask},
            lambda o: o.last_hidden_state.square().mean() + o.pooler_output.sum())


def t5() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
                                num_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0)
    batch = {"input_ids": _ids(4), "labels": _ids(5, (BATCH, SEQ // 4))}
    return transformers.T5ForConditionalGeneration(cfg), batch, lambda o: o.loss


def vit() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]:
    cfg = transformers.ViTConfig(image_size=96, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                 num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, num_labels=10)
    batch = {"pixel_values": torch.randn(BATCH, 3, 96, 96, generator=torch.Generator().manual_seed(6)),
             "labels": torch.arange(BATCH) % 10}  # 96/8 = 12x12 = 144 patches + [CLS]
    return transformers.ViTForImageClassification(cfg), batch, lambda o: o.loss


MODELS: dict[str, Builder] = {"llama": llama, "gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit}


def to_tpu(model: torch.nn.Module) -> torch.nn.Module:
    """Module.to("tpu") that keeps tied weights tied (see tests/model_harness.py:module_to)."""
    prev = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return model.to(TPU)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(prev)


def bench_model(name: str, build: Builder) -> dict[str, Any]:
    torch.manual_seed(0)
    model_cpu, batch_cpu, loss_fn = build()
    model_tpu = to_tpu(copy.deepcopy(model_cpu))
    batch_tpu = {k: v.to(TPU) for k, v in batch_cpu.items()}
    fwd_batch_cpu = {k: v for k, v in batch_cpu.items() if k != "labels" or name == "t5"}  # T5 needs decoder ids
    fwd_batch_tpu = {k: v for k, v in batch_tpu.items() if k in fwd_batch_cpu}

    def forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], on_tpu: bool) -> Callable[[], Any]:
        def fn() -> Any:
            model.eval()
            with torch.no_grad():
                out = model(**batch)
            if on_tpu:
                sync()
            return out

        return fn

    def train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], on_tpu: bool) -> Callable[[], Any]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def fn() -> Any:
            model.train()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(**batch))
            loss.backward()
            opt.step()
            if on_tpu:
                sync()
            return loss

        return fn

    # Accuracy of the measured forward (before any training step changes the weights).
    out_cpu = forward(model_cpu, fwd_batch_cpu, False)()
    first_fwd = time_call(forward(model_tpu, fwd_batch_tpu, True))  # compiles (or loads from the cache)
    out_tpu = forward(model_tpu, fwd_batch_tpu, True)()
    ref = out_cpu.logits if hasattr(out_cpu, "logits") else out_cpu.last_hidden_state
    got = out_tpu.logits if hasattr(out_tpu, "logits") else out_tpu.last_hidden_state
    max_diff = (got.cpu() - ref).abs().max().item()

    fwd = {TPU: forward(model_tpu, fwd_batch_tpu, True), "cpu": forward(model_cpu, fwd_batch_cpu, False),
           "cpu_1thread": one_thread(forward(model_cpu, fwd_batch_cpu, False))}
    step = {TPU: train_step(model_tpu, batch_tpu, True), "cpu": train_step(model_cpu, batch_cpu, False)}
    step["cpu_1thread"] = one_thread(step["cpu"])
    first_step = time_call(step[TPU])
    for _ in range(WARMUP):
        for fn in (*fwd.values(), *step.values()):
            fn()
    before = torch_tpu.cache_stats()
    fb_before = sum(torch_tpu.fallback_stats().values())
    syncs_before = torch_tpu.dispatch_stats()["host_syncs"]
    fwd_times = interleaved(fwd, REPEATS)
    step_times = interleaved(step, REPEATS)
    # Launches (one per op in strict eager) of one forward / one train step, for the per-op cost.
    launches = {}
    for kind, fn in (("fwd", fwd[TPU]), ("step", step[TPU])):
        n0 = torch_tpu.dispatch_stats()["launches"]
        fn()
        launches[kind] = torch_tpu.dispatch_stats()["launches"] - n0
    after = torch_tpu.cache_stats()
    fwd_ms = {d: median(ts) * 1e3 for d, ts in fwd_times.items()}
    step_ms = {d: median(ts) * 1e3 for d, ts in step_times.items()}
    # The ratio is against the faster CPU setting (default threads or one thread), never the slower.
    fwd_ms["cpu_default_threads"], step_ms["cpu_default_threads"] = fwd_ms["cpu"], step_ms["cpu"]
    fwd_ms["cpu"] = min(fwd_ms["cpu"], fwd_ms["cpu_1thread"])
    step_ms["cpu"] = min(step_ms["cpu"], step_ms["cpu_1thread"])
    return {
        "params": sum(p.numel() for p in model_cpu.parameters()),
        "fwd_tpu_ms": fwd_ms[TPU],
        "fwd_cpu_ms": fwd_ms["cpu"],
        "fwd_cpu_default_threads_ms": fwd_ms["cpu_default_threads"],
        "fwd_cpu_1thread_ms": fwd_ms["cpu_1thread"],
        "fwd_ratio_tpu_over_cpu": fwd_ms[TPU] / fwd_ms["cpu"],
        "step_tpu_ms": step_ms[TPU],
        "step_cpu_ms": step_ms["cpu"],
        "step_cpu_default_threads_ms": step_ms["cpu_default_threads"],
        "step_cpu_1thread_ms": step_ms["cpu_1thread"],
        "step_ratio_tpu_over_cpu": step_ms[TPU] / step_ms["cpu"],
        "tpu_launches_per_forward": launches["fwd"],
        "tpu_launches_per_step": launches["step"],
        "tpu_ms_per_launch_fwd": fwd_ms[TPU] / max(launches["fwd"], 1),
        "tpu_ms_per_launch_step": step_ms[TPU] / max(launches["step"], 1),
        "tpu_first_forward_ms": first_fwd * 1e3,
        "tpu_first_step_ms": first_step * 1e3,
        "fwd_times_s": fwd_times,
        "step_times_s": step_times,
        "fwd_max_abs_diff_vs_cpu": max_diff,
        "fwd_max_abs_cpu": ref.abs().max().item(),
        "compile_misses_during_timing": after["misses"] - before["misses"],
        "cpu_fallbacks_during_timing": sum(torch_tpu.fallback_stats().values()) - fb_before,
        "host_syncs_during_timing": torch_tpu.dispatch_stats()["host_syncs"] - syncs_before,
    }


def run(names: list[str] | None = None) -> dict[str, Any]:
    results = {name: bench_model(name, MODELS[name]) for name in (names or list(MODELS))}
    ratios = []
    parts = []
    for name, r in results.items():
        rf = ratio(f"{name} fwd tpu/cpu", r["fwd_ratio_tpu_over_cpu"], GOAL_MAX_RATIO, higher_is_better=False)
        rs = ratio(f"{name} train-step tpu/cpu", r["step_ratio_tpu_over_cpu"], GOAL_MAX_RATIO, higher_is_better=False)
        ratios += [rf, rs]
        parts.append(f"{name} fwd {r['fwd_tpu_ms']:.0f}/{r['fwd_cpu_ms']:.0f} ms, step {r['step_tpu_ms']:.0f}/"
                     f"{r['step_cpu_ms']:.0f} ms ({fmt_ratio(rf).split()[-1]}, {fmt_ratio(rs).split()[-1]})")
    summary = f"{NAME} (tpu/cpu): " + "; ".join(parts)
    return finish(
        NAME,
        {
            "description": "HF Transformers models, seeded random weights, strict eager tpu vs CPU eager: eval "
                           "forward under no_grad, and a train step (zero_grad, forward, loss, backward, AdamW "
                           "foreach step); tpu calls end with a sync",
            "config": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "ffn": FFN, "seq": SEQ, "batch": BATCH,
                       "vocab": VOCAB},
            "warmup": WARMUP,
            "repeats": REPEATS,
            "models": results,
            "ratios": ratios,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    import sys

    run(sys.argv[1:] or None)
