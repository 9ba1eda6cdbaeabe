"""torch.profiler view of one tiny-Llama greedy decode step on tpu (strict eager, or compiled).

Prints the tpu rows of key_averages() (launches, compiles with their cache tier, transfers, host
syncs: CPU time; device time of each launch: the TPU column), the torch ops by the device time of
their launches, and writes a chrome trace. Example:
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
    averages = prof.key_averages()
    avg = [a for a in averages if a.key.startswith("tpu::") or a.key == "decode_step"]
    avg.sort(key=lambda a: -max(a.cpu_time_total, a.device_time_total))
    print(f"mode: {'compiled' if args.compile else 'strict eager'}  next token {tok_cpu.item()}  "
          f"profiled wall {wall * 1e3:.1f} ms")
    print(f"{'row':52s} {'calls':>5s} {'CPU total us':>12s} {'TPU total us':>12s}")
    for a in avg[: args.rows]:
        print(f"{a.key[:52]:52s} {a.count:5d} {a.cpu_time_total:12.1f} {a.device_time_total:12.1f}")
    # Device time per torch op (the tpu activities linked to the op that launched them).
    ops = sorted((a for a in averages if a.key.startswith(("aten::", "torch_tpu::")) and a.self_device_time_total > 0
                  or a.key.startswith(("aten::", "torch_tpu::")) and a.device_time_total > 0),
                 key=lambda a: -a.device_time_total)
    print(f"{'op (device time of its launches)':52s} {'calls':>5s} {'CPU total us':>12s} {'TPU total us':>12s}")
    for a in ops[:8]:
        print(f"{a.key[:52]:52s} {a.count:5d} {a.cpu_time_total:12.1f} {a.device_time_total:12.1f}")
    kinds: dict[str, tuple[int, float]] = {}
    for a in averages:
        if a.key.startswith("tpu::"):
            k = a.key.split(" ")[0]
            n, t = kinds.get(k, (0, 0.0))
            kinds[k] = (n + a.count, t + (a.device_time_total if k == "tpu::device" else a.cpu_time_total))
    print("summary:", "  ".join(f"{k} x{n} {t / 1e3:.2f} ms" for k, (n, t) in sorted(kinds.items())))
    print(f"counters: launches +{d1['launches'] - d0['launches']}  host_syncs +{d1['host_syncs'] - d0['host_syncs']}  "
          f"compiles memory +{c1['memory_hits'] - c0['memory_hits']} disk +{c1['disk_hits'] - c0['disk_hits']} "
          f"xla +{c1['misses'] - c0['misses']}")
    print(f"chrome trace: {args.trace}")


if __name__ == "__main__":
    main()
