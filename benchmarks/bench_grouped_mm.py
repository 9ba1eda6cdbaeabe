"""MoE grouped GEMMs and MoE models.

1. `torch._grouped_mm` at decode batch 64 (64 tokens x top-2 routed to 8 experts, hidden 512, ffn 1024),
   float32 and bfloat16: the tpu lowering (sync-free, see csrc/lowering/grouped_mm.cc) by its default
   path - on the CPU plugin the host kernel (an XLA FFI custom call into ATen's CPU GEMM, one mm per
   group inside the program) - and by the XLA path (host kernels switched off), vs PyTorch's per-expert
   loop on the CPU (its generic `_grouped_mm`, one .item() + one mm per group) and the same per-expert
   loop on tpu (offsets read to the host once, one mm per expert). Forms: up projection
   [S,512] x [8,512,1024] and the weight-gradient form [512,S] x [S,1024] with offsets along K.
2. torch.tpu.ops.ragged_dot at the same shape (the routing of 64 tokens x top-2): the host kernel, the
   XLA path, the Pallas kernel through jax_op (interpret mode off TPU), Transformers' eager per-expert
   loop on tpu (`experts_implementation="eager"`: one_hot mask, nonzero, one linear + index_add per
   expert) and PyTorch CPU's `_grouped_mm`; forward and weight gradient, float32 and bfloat16. The
   forward also times host kernel and XLA path on the weights in nn.Linear layout [E, N, K] passed as a
   transposed view. The goals compare the default path ("ragged_dot": the host kernel where it is
   registered, else XLA) with the loop (>= 10x) and with CPU `_grouped_mm` (>= 1x).
3. Tiny Qwen3-MoE and Mixtral (the configs of tests/test_models_moe.py): forward and one AdamW train
   step, tpu strict eager vs CPU eager; and decode tokens/s at batch 64 (one token per sequence per
   step, KV cache) with Transformers' eager experts loop, its default grouped_mm experts, and the
   experts kernelized to the ragged-dot layer of torch_tpu's kernels repository; the last two with the
   host kernels on and off.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import TPU, finish, fmt_ratio, interleaved, median, ratio, steady, sync

NAME = "grouped_mm"
TOKENS, TOP_K, EXPERTS, HIDDEN, FFN = 64, 2, 8, 512, 1024
REPEATS = 7
KERNEL_REPEATS = 15  # the grouped GEMMs themselves: short calls, more repeats against the shared load
ITERS = 3
# The machine is shared (load average ~10 on 2 cores while measuring): ratios use the fastest
# repeat (least disturbed); medians are recorded too. The kernel cases time each variant in its own
# steady state (bench_common.steady), the model cases alternate whole runs (bench_common.interleaved).


def cpu_ms(fns: dict[str, Callable[[], object]], calls: int = 10) -> dict[str, float]:
    """Process CPU time (all threads) per call of each variant, `calls` runs after one untimed: the
    work a variant costs the machine, which the load of a shared machine distorts less than wall time."""
    out = {}
    for name, fn in fns.items():
        fn()
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        out[name] = (time.process_time() - t0) / calls / ITERS * 1e3
    return out


def per_call_ms(times: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    best = {k: min(v) / ITERS * 1e3 for k, v in times.items()}
    med = {k: median(v) / ITERS * 1e3 for k, v in times.items()}
    return best, med


def host_kernels(on: bool) -> str:
    import torch_tpu.ops

    return torch_tpu.ops.host_kernels(on)


def timed(fn: Callable[[], object], on_tpu: bool, host: bool = True) -> Callable[[], object]:
    """ITERS calls (then one sync on tpu), with the CPU plugin's host kernels on or off."""

    def loop() -> object:
        if on_tpu:
            host_kernels(host)
        r = None
        for _ in range(ITERS):
            r = fn()
        if on_tpu:
            sync()
        return r

    return loop


def routing(seed: int) -> torch.Tensor:
    """int32 group ends for TOKENS x TOP_K rows sorted by a random expert id."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, EXPERTS, (TOKENS * TOP_K,), generator=g)
    return torch.cumsum(torch.bincount(ids, minlength=EXPERTS), 0).to(torch.int32)


def loop_rows(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The per-expert loop over row groups (what a backend without a grouped GEMM does)."""
    ends = offs.tolist()  # one host read
    parts, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            parts.append(x[start:end] @ w[g])
        start = end
    if start < x.shape[0]:
        parts.append(x.new_zeros(x.shape[0] - start, w.shape[-1]))
    return torch.cat(parts)


def loop_k(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The per-expert loop for the weight-gradient form (offsets along K)."""
    ends = offs.tolist()
    parts, start = [], 0
    for end in ends:
        parts.append(a[:, start:end] @ b[start:end])
        start = end
    return torch.stack(parts)


def gmm_case(form: str, dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    offs = routing(2)
    s = TOKENS * TOP_K
    if form == "up 2d x 3d":
        a = torch.randn(s, HIDDEN, generator=g).to(dtype)
        b = (torch.randn(EXPERTS, HIDDEN, FFN, generator=g) / HIDDEN**0.5).to(dtype)
        loop = loop_rows
    else:
        a = torch.randn(s, HIDDEN, generator=g).to(dtype).t()
        b = torch.randn(s, FFN, generator=g).to(dtype)
        loop = loop_k
    ad, bd, od = a.to(TPU), b.to(TPU), offs.to(TPU)
    fns = {
        "tpu_lowered": timed(lambda: torch._grouped_mm(ad, bd, od), True),
        "tpu_lowered_xla": timed(lambda: torch._grouped_mm(ad, bd, od), True, host=False),
        "tpu_loop": timed(lambda: loop(ad, bd, od), True),
        "cpu_grouped_mm": timed(lambda: torch._grouped_mm(a, b, offs), False),
    }
    ref = torch._grouped_mm(a.float(), b.float(), offs)
    got = torch._grouped_mm(ad, bd, od).cpu().float()
    n = int(offs[-1]) if form == "up 2d x 3d" else ref.shape[0]
    err = ((got[:n] - ref[:n]).abs().max() / ref[:n].abs().max()).item()
    for f in fns.values():  # warm-up: compiles every program once
        f()
    ms, med = per_call_ms(steady(fns, KERNEL_REPEATS))
    return {"form": form, "dtype": str(dtype).removeprefix("torch."), "group_ends": offs.tolist(),
            "rel_err_vs_cpu_f32": err, "ms": ms, "median_ms": med}


def routed(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index [TOKENS, TOP_K] (distinct experts per token) and the sorted group sizes."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    return idx, torch.bincount(idx.reshape(-1), minlength=EXPERTS).to(torch.int32)


def hf_eager_loop(x: torch.Tensor, w: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Transformers' eager experts loop (modeling_qwen3_moe.Qwen3MoeExperts.forward) for one
    projection: x [T, H] tokens, w [E, N, H] (nn.Linear layout)."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=EXPERTS + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == EXPERTS:
            continue
        _pos, tok = torch.where(mask[e])
        out.index_add_(0, tok, torch.nn.functional.linear(x[tok], w[e]))
    return out


def hf_eager_loop_wgrad(x: torch.Tensor, gy: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """The same loop's weight gradient (what autograd runs per expert): [E, H, N]."""
    out = x.new_zeros(EXPERTS, x.shape[1], gy.shape[1])
    mask = torch.nn.functional.one_hot(top_k_index, num_classes=EXPERTS + 1).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == EXPERTS:
            continue
        _pos, tok = torch.where(mask[e])
        out[e] = x[tok].t() @ gy[tok]
    return out


def ragged_case(form: str, dtype: torch.dtype) -> dict[str, Any]:
    import torch_tpu.ops

    idx, sizes = routed(3)
    order = torch.argsort(idx.reshape(-1), stable=True)
    g = torch.Generator().manual_seed(4)
    xt = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)  # tokens
    rows = xt[order // TOP_K]  # sorted by expert
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    d = {k: v.to(TPU) for k, v in dict(xt=xt, rows=rows, sizes=sizes, idx=idx).items()}
    if form == "forward":
        w = (torch.randn(EXPERTS, HIDDEN, FFN, generator=g) / HIDDEN**0.5).to(dtype)
        wl = w.transpose(1, 2).contiguous()  # nn.Linear layout for the loop
        wd, wld = w.to(TPU), wl.to(TPU)
        ref = torch._grouped_mm(rows.float(), w.float(), offs)
        def fwd() -> torch.Tensor:
            return torch_tpu.ops.ragged_dot(d["rows"], wd, d["sizes"], impl="xla")

        def fwd_nk() -> torch.Tensor:  # the same weights in nn.Linear layout [E, N, K], a transposed view
            return torch_tpu.ops.ragged_dot(d["rows"], wld.transpose(1, 2), d["sizes"], impl="xla")

        fns = {
            "ragged_dot": timed(fwd, True),
            "ragged_dot_xla": timed(fwd, True, host=False),
            "ragged_dot_pallas": timed(lambda: torch_tpu.ops.ragged_dot(d["rows"], wd, d["sizes"], impl="pallas"),
                                       True),
            "ragged_dot_nk_view": timed(fwd_nk, True),
            "ragged_dot_xla_nk_view": timed(fwd_nk, True, host=False),
            "tpu_hf_eager_loop": timed(lambda: hf_eager_loop(d["xt"], wld, d["idx"]), True),
            "cpu_grouped_mm": timed(lambda: torch._grouped_mm(rows, w, offs), False),
        }
        got = torch_tpu.ops.ragged_dot(d["rows"], wd, d["sizes"]).cpu().float()
    else:
        gy = torch.randn(TOKENS * TOP_K, FFN, generator=g).to(dtype)
        gyt = torch.zeros(TOKENS, FFN, dtype=dtype)  # the loop's per-token layout (one slot each)
        gd, gytd = gy.to(TPU), gyt.to(TPU)
        ref = torch._grouped_mm(rows.float().t(), gy.float(), offs)
        def wgrad() -> torch.Tensor:
            return torch_tpu.ops.ragged_dot_weight_grad(d["rows"], gd, d["sizes"])

        fns = {
            "ragged_dot": timed(wgrad, True),
            "ragged_dot_xla": timed(wgrad, True, host=False),
            "tpu_hf_eager_loop": timed(lambda: hf_eager_loop_wgrad(d["xt"], gytd, d["idx"]), True),
            "cpu_grouped_mm": timed(lambda: torch._grouped_mm(rows.t(), gy, offs), False),
        }
        got = torch_tpu.ops.ragged_dot_weight_grad(d["rows"], gd, d["sizes"]).cpu().float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    for f in fns.values():
        f()
    ms, med = per_call_ms(steady(fns, KERNEL_REPEATS))
    cpu = cpu_ms({k: fns[k] for k in ("ragged_dot", "ragged_dot_xla", "cpu_grouped_mm")})
    return {"form": form, "dtype": str(dtype).removeprefix("torch."), "group_sizes": sizes.tolist(),
            "rel_err_vs_cpu_f32": err, "ms": ms, "median_ms": med, "process_cpu_ms": cpu}


def decode_case(kind: str, steps: int = 4, batch: int = TOKENS) -> dict[str, Any]:
    """Decode tokens/s at batch 64 on tpu: HF eager experts loop vs grouped_mm vs the kernel."""
    import kernels
    import torch_tpu.kernels_repo as repo
    from transformers import DynamicCache

    repo.mark_transformers_layers()
    ids = torch.randint(0, 128, (batch, 8), generator=torch.Generator().manual_seed(5)).to(TPU)
    variants: dict[str, torch.nn.Module] = {}
    for name in ("eager_loop", "grouped_mm", "ragged_dot_kernel"):
        m = build_model(kind).eval()
        m.config._experts_implementation = "eager" if name == "eager_loop" else "grouped_mm"
        m = m.to(TPU)
        if name == "ragged_dot_kernel":
            with kernels.use_kernel_mapping(repo.kernel_mapping()):
                m = kernels.kernelize(m, device="tpu", mode=kernels.Mode.INFERENCE)
        variants[name] = m
        if name != "eager_loop":
            variants[name + "_xla"] = m  # the same model with the host kernels off
    outs = {}

    def decoder(m: torch.nn.Module, name: str) -> Callable[[], object]:
        def run() -> object:
            host_kernels(not name.endswith("_xla"))
            with torch.no_grad():
                cache = DynamicCache(config=m.config)
                out = m(input_ids=ids, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                toks = [tok]
                for _ in range(steps):
                    out = m(input_ids=tok, past_key_values=cache, use_cache=True)
                    tok = out.logits[:, -1:].argmax(-1)
                    toks.append(tok)
                outs[name] = torch.cat(toks, 1)
                sync()
            return outs[name]

        return run

    fns = {name: decoder(m, name) for name, m in variants.items()}
    for f in fns.values():
        f()
    same = all(torch.equal(outs[n].cpu(), outs["eager_loop"].cpu()) for n in outs)
    times = interleaved(fns, 3)
    best = {k: min(v) for k, v in times.items()}
    # prefill included in each run: tokens/s counts the decode steps' tokens over the whole run
    return {"model": kind, "batch": batch, "decode_steps": steps, "same_tokens": same,
            "tokens_per_s": {k: batch * (steps + 1) / v for k, v in best.items()}}


def build_model(kind: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                                  max_position_embeddings=64)
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                                  num_experts=4, decoder_sparse_step=1, norm_topk_prob=True))
    return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=32, num_local_experts=4))


def model_case(kind: str) -> dict[str, Any]:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    sides: dict[str, Any] = {}
    for dev in ("cpu", TPU):
        m = build_model(kind).to(dev)
        x = ids.to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

        def fwd(m: torch.nn.Module = m, x: torch.Tensor = x) -> object:
            m.eval()
            with torch.no_grad():
                return m(input_ids=x).logits

        def step(m: torch.nn.Module = m, x: torch.Tensor = x, opt: torch.optim.Optimizer = opt) -> object:
            m.train()
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            return loss

        sides[dev] = (timed(fwd, dev == TPU), timed(step, dev == TPU))
    fns = {f"{d}_{what}": sides[d][i] for d in ("cpu", TPU) for i, what in enumerate(("forward", "train_step"))}
    for f in fns.values():
        f()
    ms, med = per_call_ms(interleaved(fns, REPEATS))
    return {"model": kind, "ms": ms, "median_ms": med}


def ragged_rows() -> None:
    """Only the four ragged_dot rows (forward / weight gradient x float32 / bfloat16), printed, no
    result file: for A/B runs of two builds."""
    for form in ("forward", "weight_grad"):
        for dt in (torch.float32, torch.bfloat16):
            c = ragged_case(form, dt)
            ms, cpu = c["ms"], c["process_cpu_ms"]
            print(f"ragged_dot {form}/{c['dtype']}: ms best/median " + " ".join(
                f"{k} {ms[k]:.3f}/{c['median_ms'][k]:.3f}" for k in ("ragged_dot", "ragged_dot_xla", "cpu_grouped_mm",
                                                                      "tpu_hf_eager_loop"))
                  + f" | cpu/ragged_dot {ms['cpu_grouped_mm'] / ms['ragged_dot']:.2f}x, loop/ragged_dot "
                  f"{ms['tpu_hf_eager_loop'] / ms['ragged_dot']:.1f}x | process CPU ms "
                  + " ".join(f"{k} {v:.3f}" for k, v in cpu.items()), flush=True)


def run() -> dict[str, Any]:
    gmm = [gmm_case(form, dt) for form in ("up 2d x 3d", "wgrad 2d x 2d") for dt in (torch.float32, torch.bfloat16)]
    rag = [ragged_case(form, dt) for form in ("forward", "weight_grad") for dt in (torch.float32, torch.bfloat16)]
    models = [model_case(k) for k in ("qwen3_moe", "mixtral")]
    decode = [decode_case(k) for k in ("qwen3_moe", "mixtral")]
    ratios = []
    for c in rag:
        tag = f"ragged_dot {c['form']}/{c['dtype']}"
        ms = c["ms"]
        ratios.append(ratio(f"{tag} hf_eager_loop_tpu/ragged_dot", ms["tpu_hf_eager_loop"] / ms["ragged_dot"],
                            10.0, True))
        ratios.append(ratio(f"{tag} cpu_grouped_mm/ragged_dot", ms["cpu_grouped_mm"] / ms["ragged_dot"], 1.0, True))
        ratios.append(ratio(f"{tag} xla/ragged_dot", ms["ragged_dot_xla"] / ms["ragged_dot"], None, True))
    for c in decode:
        tps = c["tokens_per_s"]
        ratios.append(ratio(f"{c['model']} decode tok/s kernel/eager_loop", tps["ragged_dot_kernel"] / tps["eager_loop"],
                            None, True))
        ratios.append(ratio(f"{c['model']} decode tok/s kernel/grouped_mm", tps["ragged_dot_kernel"] / tps["grouped_mm"],
                            None, True))
        ratios.append(ratio(f"{c['model']} decode tok/s kernel host/xla",
                            tps["ragged_dot_kernel"] / tps["ragged_dot_kernel_xla"], None, True))
    for c in gmm:
        tag = f"{c['form'].split()[0]}/{c['dtype']}"
        ratios.append(ratio(f"{tag} cpu_loop/tpu_lowered", c["ms"]["cpu_grouped_mm"] / c["ms"]["tpu_lowered"],
                            None, True))
        ratios.append(ratio(f"{tag} tpu_loop/tpu_lowered", c["ms"]["tpu_loop"] / c["ms"]["tpu_lowered"], None, True))
    for c in models:
        ms = c["ms"]
        ratios.append(ratio(f"{c['model']} fwd tpu/cpu", ms["tpu_forward"] / ms["cpu_forward"], None, False))
        ratios.append(ratio(f"{c['model']} train tpu/cpu", ms["tpu_train_step"] / ms["cpu_train_step"], None, False))
    parts = [f"{c['form'].split()[0]}/{c['dtype']} ms tpu {c['ms']['tpu_lowered']:.1f} "
             f"cpu-loop {c['ms']['cpu_grouped_mm']:.1f} tpu-loop {c['ms']['tpu_loop']:.1f}" for c in gmm]
    parts += [f"ragged_dot {c['form']}/{c['dtype']} ms " + " ".join(f"{k} {v:.2f}" for k, v in c["ms"].items())
              for c in rag]
    parts += [f"{c['model']} decode tok/s " + " ".join(f"{k} {v:.0f}" for k, v in c["tokens_per_s"].items())
              for c in decode]
    parts += [f"{c['model']} fwd {c['ms']['tpu_forward']:.1f}/{c['ms']['cpu_forward']:.1f} ms "
              f"train {c['ms']['tpu_train_step']:.1f}/{c['ms']['cpu_train_step']:.1f} ms (tpu/cpu)" for c in models]
    host_kernels(True)
    summary = f"{NAME}: " + "; ".join(parts) + " | " + ", ".join(fmt_ratio(r) for r in ratios)
    return finish(NAME, {
        "description": __doc__.strip().splitlines()[0] if __doc__ else NAME,
        "host_kernels": host_kernels(True),
        "shape": {"tokens": TOKENS, "top_k": TOP_K, "experts": EXPERTS, "hidden": HIDDEN, "ffn": FFN},
        "grouped_mm": gmm,
        "ragged_dot": rag,
        "models": models,
        "decode": decode,
        "ratios": ratios,
        "summary": summary,
    })


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else NAME)
    p.add_argument("--ragged-only", action="store_true",
                   help="only the four ragged_dot rows, printed (no result file): for A/B runs of two builds")
    if p.parse_args().ragged_only:
        ragged_rows()
    else:
        run()
