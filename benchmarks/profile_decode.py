"""torch.profiler view of one tiny-Llama greedy decode step on tpu (strict eager, or compiled).

Prints the tpu rows of key_averages() (launches, compiles with their cache tier, transfers, host
syncs, device time) and writes a chrome trace. Example:
    python benchmarks/profile_decode.py --trace /tmp/decode_trace.json [--compile]
"""

import argparse
import time

import torch
import torch_tpu
import transformers
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="/tmp/tpu_decode_trace.json")
    ap.add_argument("--compile", action="store_true", help="torch.compile(backend='tpu') the model")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval().to("tpu")
    fwd = torch.compile(model, backend="tpu", dynamic=False) if args.compile else model
    ids = torch.randint(0, 256, (1, 8))

    with torch.no_grad():
        cache = transformers.DynamicCache()
        out = fwd(input_ids=ids.to("tpu"), past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):  # warm: the decode-step programs exist (the cache length still grows)
            out = fwd(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tok.cpu()
        torch_tpu.synchronize()
        d0, c0 = torch_tpu.dispatch_stats(), torch_tpu.cache_stats()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
            with record_function("decode_step"):
                out = fwd(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                tok_cpu = tok.cpu()
        wall = time.perf_counter() - t0
        d1, c1 = torch_tpu.dispatch_stats(), torch_tpu.cache_stats()

    prof.export_chrome_trace(args.trace)
    avg = [a for a in prof.key_averages() if a.key.startswith("tpu::") or a.key == "decode_step"]
    avg.sort(key=lambda a: -a.cpu_time_total)
    print(f"mode: {'compiled' if args.compile else 'strict eager'}  next token {tok_cpu.item()}  "
          f"profiled wall {wall * 1e3:.1f} ms")
    print(f"{'row':58s} {'calls':>5s} {'total us':>10s} {'avg us':>9s}")
    for a in avg[: args.rows]:
        print(f"{a.key[:58]:58s} {a.count:5d} {a.cpu_time_total:10.1f} {a.cpu_time_total / a.count:9.1f}")
    kinds: dict[str, tuple[int, float]] = {}
    for a in prof.key_averages():
        if a.key.startswith("tpu::"):
            k = a.key.split(" ")[0]
            n, t = kinds.get(k, (0, 0.0))
            kinds[k] = (n + a.count, t + a.cpu_time_total)
    print("summary:", "  ".join(f"{k} x{n} {t / 1e3:.2f} ms" for k, (n, t) in sorted(kinds.items())))
    print(f"counters: launches +{d1['launches'] - d0['launches']}  host_syncs +{d1['host_syncs'] - d0['host_syncs']}  "
          f"compiles memory +{c1['memory_hits'] - c0['memory_hits']} disk +{c1['disk_hits'] - c0['disk_hits']} "
          f"xla +{c1['misses'] - c0['misses']}")
    print(f"chrome trace: {args.trace}")


if __name__ == "__main__":
    main()
