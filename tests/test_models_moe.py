"""Mixture-of-Experts language models (Transformers' Qwen3-MoE and Mixtral) on tpu vs the CPU.

Tiny seeded configs (hidden 64, 2 layers, 4 experts, top-2, vocab 128, seq 16, batch 2). Transformers
runs its experts with `experts_implementation="grouped_mm"` (always on tpu): routing by sort +
histc(int32) + cumsum(int32), then `aten._grouped_mm` forward and backward, which must all run
lowered: no CPU fallback and no host sync in the forward.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch_tpu
from model_harness import check_model, float_tensors, max_err, to_device
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH = 128, 16, 2


def build(kind: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                                  max_position_embeddings=64, attention_dropout=0.0)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                             decoder_sparse_step=1, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = MixtralConfig(**common, intermediate_size=32, num_local_experts=4)
        model = MixtralForCausalLM(cfg)
    return model.eval()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops that reach the backends (to see which experts path ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_model_float32(kind: str) -> None:
    model = build(kind)
    assert model.config._experts_implementation == "grouped_mm"
    rep = check_model(kind, model, batch(), lambda out: out.loss, steps=8)  # CPU side: ~0.75 s a step
    print(f"{kind}: fwd_err={rep.fwd_max_err:.3g} (ref {rep.fwd_max_ref:.3g}) grad_err={rep.grad_max_err:.3g} "
          f"(ref {rep.grad_max_ref:.3g}) loss_dev={rep.loss_curve_max_dev:.3g} fallbacks={rep.fallbacks} "
          f"host_syncs/fwd={rep.host_syncs_per_forward}")
    assert rep.fallbacks == {}
    assert rep.fwd_max_err <= 1e-4 * rep.fwd_max_ref
    assert rep.grad_max_err <= 1e-3 * rep.grad_max_ref
    assert rep.loss_curve_max_dev <= 1e-3
    assert rep.losses_tpu[-1] < rep.losses_tpu[0]  # it trains
    # Routing (sort, histc on int32, cumsum) and the grouped GEMMs stay on the device: no reads.
    assert rep.host_syncs_per_forward == 0


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_uses_grouped_mm_on_tpu(kind: str) -> None:
    model = build(kind).to("tpu")
    data = to_device(batch(), "tpu")
    counter = OpCounter()
    torch_tpu.reset_fallback_stats()
    with counter, torch.no_grad():
        model(**data)
    # 2 layers x (up/gate + down) grouped GEMMs; the expert counts come from an int32 histc.
    assert counter.counts["_grouped_mm"] == 4
    assert counter.counts["histc"] == 2
    assert torch_tpu.fallback_stats() == {}


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_model_bfloat16_forward(kind: str) -> None:
    model = build(kind).to(torch.bfloat16)
    data = batch()
    dev = build(kind).to(torch.bfloat16).to("tpu")
    torch_tpu.reset_fallback_stats()
    with torch.no_grad():
        ref = float_tensors(model(**data).logits)
        out = float_tensors(dev(**to_device(data, "tpu")).logits)
    err, scale = max_err(out, ref)
    print(f"{kind} bf16: fwd_err={err:.3g} (ref {scale:.3g})")
    assert torch_tpu.fallback_stats() == {}
    assert err <= 2e-2 * scale
