"""Fused scaled-dot-product attention (_scaled_dot_product_fused_attention_overrideable + backward):
tpu vs PyTorch's math path on the CPU, the fused op actually running, dropout's forward/backward
mask agreement, and a tiny Llama (GQA + causal) forward/backward."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import torch_tpu
from torch.utils._python_dispatch import TorchDispatchMode

FUSED = "aten._scaled_dot_product_fused_attention_overrideable.default"
FUSED_BWD = "aten._scaled_dot_product_fused_attention_overrideable_backward.default"
MATH_OPS = ("aten.bmm", "aten._softmax", "aten._safe_softmax", "aten.mm", "aten.matmul")


class OpLog(TorchDispatchMode):
    """Records the ATen ops that reach the backend (SDPA itself is composite and decomposes
    above this point into either the fused op or the math path's matmul/softmax ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs(b: int, hq: int, hk: int, seq_q: int, seq_k: int, e: int, ev: int, dtype: torch.dtype,
            mask: str | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    q = torch.randn(b, hq, seq_q, e, dtype=dtype)
    k = torch.randn(b, hk, seq_k, e, dtype=dtype)
    v = torch.randn(b, hk, seq_k, ev, dtype=dtype)
    m: torch.Tensor | None = None
    if mask == "float":
        m = torch.randn(b, 1, seq_q, seq_k, dtype=dtype)
    elif mask == "float2d":
        m = torch.randn(seq_q, seq_k, dtype=dtype)
    elif mask == "bool":
        m = torch.rand(b, 1, seq_q, seq_k) > 0.3
        m[..., 0] = True  # no fully masked rows here (tested separately)
    return [q, k, v], m


def _check(qkv: list[torch.Tensor], m: torch.Tensor | None, atol: float, rtol: float, **kw: object) -> None:
    """Forward and every gradient (q, k, v, float mask) on tpu vs the CPU; the fused op must run."""
    ref_in = [x.clone().requires_grad_() for x in qkv]
    ref_m = m.clone().requires_grad_() if m is not None and m.is_floating_point() else m
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=ref_m, **kw)
    grad = torch.randn_like(ref)
    ref.backward(grad)

    t_in = [x.to("tpu").requires_grad_() for x in qkv]
    t_m = None if m is None else m.to("tpu")
    if t_m is not None and t_m.is_floating_point():
        t_m.requires_grad_()
    torch_tpu.reset_fallback_stats()
    with OpLog() as log:
        out = F.scaled_dot_product_attention(*t_in, attn_mask=t_m, **kw)
        out.backward(grad.to("tpu"))
    assert FUSED in log.ops and FUSED_BWD in log.ops, log.ops
    assert not [o for o in log.ops if o.startswith(MATH_OPS)], log.ops
    assert torch_tpu.fallback_stats() == {}

    torch.testing.assert_close(out.cpu(), ref.detach(), atol=atol, rtol=rtol)
    for t, r in zip(t_in, ref_in, strict=True):
        torch.testing.assert_close(t.grad.cpu(), r.grad, atol=atol, rtol=rtol)
    if ref_m is not None and ref_m.requires_grad:
        torch.testing.assert_close(t_m.grad.cpu(), ref_m.grad, atol=atol, rtol=rtol)


CASES = {
    "plain": (dict(), None),
    "float_mask": (dict(), "float"),
    "float_mask_2d": (dict(), "float2d"),
    "bool_mask": (dict(), "bool"),
    "causal": (dict(is_causal=True), None),
    "causal_l_lt_s": (dict(is_causal=True, seq_q=3), None),
    "causal_l_gt_s": (dict(is_causal=True, seq_k=4), None),
    "gqa_causal": (dict(is_causal=True, enable_gqa=True, hq=8, hk=2), None),
    "gqa_bool_mask": (dict(enable_gqa=True, hq=8, hk=2), "bool"),
    "value_head_dim": (dict(ev=6, scale=0.3), "float"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_cpu_float32(case: str) -> None:
    torch.manual_seed(0)
    kw, mask = CASES[case]
    shape = dict(b=2, hq=4, hk=4, seq_q=5, seq_k=7, e=8, ev=8)
    sdpa_kw = {k: kw[k] for k in ("is_causal", "enable_gqa", "scale") if k in kw}
    shape.update({k: v for k, v in kw.items() if k in shape})
    qkv, m = _inputs(**shape, dtype=torch.float32, mask=mask)
    _check(qkv, m, atol=2e-5, rtol=2e-5, **sdpa_kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    qkv, m = _inputs(2, 4, 2, 6, 6, 8, 8, dtype, "float")
    _check(qkv, m, atol=2e-2, rtol=2e-2, enable_gqa=True)
    qkv, _ = _inputs(2, 4, 4, 6, 6, 8, 8, dtype, None)
    _check(qkv, None, atol=2e-2, rtol=2e-2, is_causal=True)


def test_fully_masked_row_gives_zeros_like_cpu() -> None:
    torch.manual_seed(2)
    qkv, m = _inputs(1, 2, 2, 4, 5, 8, 8, torch.float32, "bool")
    m[0, 0, 1, :] = False  # query row 1 attends to nothing: the math path's _safe_softmax -> 0
    _check(qkv, m, atol=2e-5, rtol=2e-5)


def test_loose_shift_bound_is_recomputed_exactly() -> None:
    # Without a mask the forward shifts each row by a bound from the keys' per-dim extremes; with
    # large-norm inputs that bound sits hundreds above the row maximum, every exp underflows, and
    # the rows must be computed again with the exact maxima (else: zeros / NaN).
    torch.manual_seed(3)
    qkv, _ = _inputs(1, 2, 2, 5, 7, 8, 8, torch.float32, None)
    qkv[0] = qkv[0] * 30
    qkv[1] = qkv[1] * 30
    _check(qkv, None, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("case", ["gqa_bool_mask_dead_row", "gqa_causal", "float_mask", "loose_bound", "head_dim_4"])
def test_large_scores_take_the_blocked_forward(case: str, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Scores over 8 MiB ([B*Hkv, G*L, S] = [2, 1100, 1030] f32) run as a loop over blocks of query
    # rows (509 here: 2 blocks and an 82-row tail), forward and backward (dK/dV accumulated over
    # the blocks); rows, masks and GQA groups must line up.
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", str(tmp_path))
    torch.manual_seed(9)
    if case == "float_mask":
        qkv, m = _inputs(1, 2, 2, 1100, 1030, 8, 8, torch.float32, "float")
        _check(qkv, m, atol=2e-5, rtol=2e-5)
    elif case == "gqa_causal":
        qkv, _ = _inputs(1, 4, 2, 550, 1030, 8, 8, torch.float32, None)
        _check(qkv, None, atol=2e-5, rtol=2e-5, enable_gqa=True, is_causal=True)
    elif case == "loose_bound":
        # Query rows of the first block and the tail have large norms (their blocks are
        # recomputed with exact maxima), the second block's rows take the bounded shift.
        qkv, _ = _inputs(1, 2, 2, 1100, 1030, 8, 8, torch.float32, None)
        qkv[0][:, :, :509] *= 30
        qkv[0][:, :, 1018:] *= 30
        _check(qkv, None, atol=2e-3, rtol=1e-4, is_causal=True)
    elif case == "head_dim_4":
        # Head dim 4: the blocked forward's scores are elementwise multiply-adds against the
        # transposed keys; the first block's rows are recomputed with exact maxima (as a dot).
        qkv, _ = _inputs(1, 4, 2, 1100, 1030, 4, 4, torch.float32, None)
        qkv[0][:, :, :300] *= 30
        _check(qkv, None, atol=2e-3, rtol=1e-4, enable_gqa=True)
    else:
        qkv, m = _inputs(1, 4, 2, 550, 1030, 8, 8, torch.float32, "bool")
        m[0, 0, 549, :] = False  # the tail's last row attends to nothing
        _check(qkv, m, atol=2e-5, rtol=2e-5, enable_gqa=True)
    texts = [f.read_text() for f in tmp_path.glob("*.mlir")]

    def looped(op: str) -> bool:
        return any(t.startswith(f"// aten::{op}\n") and "stablehlo.while" in t for t in texts)

    assert looped("_scaled_dot_product_fused_attention_overrideable")
    # The backward loops too, except with a float mask (its gradient is the whole dS).
    assert looped("_scaled_dot_product_fused_attention_overrideable_backward") == (case != "float_mask")


def test_three_d_inputs_in_fused_eager_mode() -> None:
    # [H, L, E] inputs (no batch dim) with a 2-d float mask, recorded into a fused-eager program.
    torch.manual_seed(8)
    qkv = [torch.randn(4, 6, 8) for _ in range(3)]
    m = torch.randn(6, 6)
    with torch_tpu.set_eager_mode(torch_tpu.EagerMode.DEFER_AND_FUSE):
        _check(qkv, m, atol=2e-5, rtol=2e-5)


def test_unsupported_calls_take_the_math_path() -> None:
    # 5-d inputs and GQA without enable_gqa are not the fused op's: the math path runs, still on tpu.
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 3, 4, 8) for _ in range(3))
    torch_tpu.reset_fallback_stats()
    with OpLog() as log:
        out = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"))
    assert FUSED not in log.ops
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v), atol=2e-5, rtol=2e-5)
    assert torch_tpu.fallback_stats() == {}


def _dropout_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, grad: torch.Tensor,
                 enable_gqa: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    t = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*t, dropout_p=p, enable_gqa=enable_gqa)
    out.backward(grad.to("tpu"))
    return out.detach().cpu(), [x.grad.cpu() for x in t]


def test_dropout_forward_and_backward_use_the_same_mask() -> None:
    # With V = identity (S == Ev) the output *is* the dropped, rescaled probability matrix, so the
    # keep-mask can be read off the forward; the CPU math path given that mask must then produce
    # the tpu backward's gradients exactly (within float tolerance).
    torch.manual_seed(4)
    b, hq, hk, seq, e, p = 2, 4, 2, 16, 8, 0.3
    q = torch.randn(b, hq, seq, e)
    k = torch.randn(b, hk, seq, e)
    v = torch.eye(seq).expand(b, hk, seq, seq).contiguous()
    grad = torch.randn(b, hq, seq, seq)
    torch_tpu.reset_fallback_stats()
    with OpLog() as log:
        out, grads = _dropout_run(q, k, v, p, grad, enable_gqa=True)
    assert FUSED in log.ops and FUSED_BWD in log.ops
    assert torch_tpu.fallback_stats() == {}
    keep = out != 0  # softmax probabilities are > 0 everywhere here

    # Statistics: about p of the entries dropped; kept ones scaled by 1/(1-p).
    dropped = 1 - keep.float().mean().item()
    assert abs(dropped - p) < 0.05, dropped
    probs = torch.softmax((q @ k.repeat_interleave(hq // hk, 1).transpose(-1, -2)) / math.sqrt(e), -1)
    torch.testing.assert_close(out[keep], (probs / (1 - p))[keep], atol=1e-5, rtol=1e-5)
    # Heads and batches draw different masks.
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    kr = ref_in[1].repeat_interleave(hq // hk, 1)
    vr = ref_in[2].repeat_interleave(hq // hk, 1)
    ref, _ = torch.ops.aten._scaled_dot_product_attention_math(
        ref_in[0], kr, vr, None, p, False, dropout_mask=keep)
    ref.backward(grad)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_in, strict=True):
        torch.testing.assert_close(g, r.grad, atol=1e-5, rtol=1e-4)


def test_dropout_is_seeded_and_fresh_per_call() -> None:
    torch.manual_seed(5)
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    v = torch.eye(8).expand(1, 2, 8, 8).contiguous()
    grad = torch.ones(1, 2, 8, 8)
    torch.manual_seed(7)
    a, _ = _dropout_run(q, k, v, 0.5, grad, False)
    b, _ = _dropout_run(q, k, v, 0.5, grad, False)
    torch.manual_seed(7)
    c, _ = _dropout_run(q, k, v, 0.5, grad, False)
    assert torch.equal(a, c)
    assert not torch.equal(a != 0, b != 0)


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_tiny_llama_forward_backward_matches_cpu() -> None:
    m = _tiny_llama()
    mt = copy.deepcopy(m).to("tpu")
    ids = torch.randint(0, 128, (2, 10))
    loss = m(ids, labels=ids).loss
    loss.backward()
    torch_tpu.reset_fallback_stats()
    with OpLog() as log:
        loss_t = mt(ids.to("tpu"), labels=ids.to("tpu")).loss
        loss_t.backward()
    assert log.ops.count(FUSED) == 2 and log.ops.count(FUSED_BWD) == 2
    assert torch_tpu.fallback_stats() == {}
    torch.testing.assert_close(loss_t.cpu(), loss, atol=1e-5, rtol=1e-5)
    for p, pt in zip(m.parameters(), mt.parameters(), strict=True):
        torch.testing.assert_close(pt.grad.cpu(), p.grad, atol=1e-5, rtol=1e-4)


def test_compiled_sdpa_matches_cpu() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(6)
    qkv, m = _inputs(1, 4, 2, 5, 5, 8, 8, torch.float32, "float")

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum(-1)

    t = [x.to("tpu").requires_grad_() for x in qkv]
    out = torch.compile(f, backend="tpu")(*t, m.to("tpu"))
    out.sum().backward()
    r = [x.clone().requires_grad_() for x in qkv]
    ref = f(*r, m)
    ref.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=2e-5, rtol=2e-5)
    for a, b in zip(t, r, strict=True):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=2e-5, rtol=2e-5)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv (Llama/Mistral/Qwen attention with a mask): [B, Hk, S, E] ->
    [B, Hk * n_rep, S, E], head h = kv head h // n_rep."""
    b, hk, s, e = x.shape
    return x[:, :, None, :, :].expand(b, hk, n_rep, s, e).reshape(b, hk * n_rep, s, e)


def _repeat_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         causal: bool) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, g), _repeat_kv(v, g), attn_mask=mask, is_causal=causal)


def _compiled_programs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The StableHLO text of every program compiled graphs build from now on."""
    from torch_tpu import _C
    from torch_tpu._internal import compile as tpu_compile

    texts: list[str] = []
    build = tpu_compile._build

    def spy(desc: dict) -> int:  # type: ignore[type-arg]
        texts.append(_C._graph_text(desc))
        return build(desc)

    monkeypatch.setattr(tpu_compile, "_build", spy)
    return texts


# B=2, Hq=6, Hk=2 (G=3), L=5, S=7, E=8: the repeat would build K/V as 2x2x3x7x8 = 2x6x7x8.
REPEAT_KV_CASES = {"causal": (None, True), "float_mask": ("float", False), "bool_mask": ("bool", False)}


@pytest.mark.parametrize("case", list(REPEAT_KV_CASES))
@pytest.mark.parametrize("grouped", [True, False])
def test_compiled_repeat_kv_attends_grouped(case: str, grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's repeat_kv + SDPA in a compiled graph: the fused op gets the 2 K/V heads (no G-fold
    copy of K or V in the program: exact text expectation), outputs equal CPU's. With the graph
    pass off (the old program) the copies are there, so the expectation guards the rewrite."""
    import torch._dynamo
    import torch._functorch.config
    from torch_tpu._internal import compile as tpu_compile
    from torch_tpu._internal import graph_passes

    torch._dynamo.reset()
    monkeypatch.setattr(graph_passes, "ENABLED", [grouped])
    texts = _compiled_programs(monkeypatch)
    torch.manual_seed(3)
    mask_kind, causal = REPEAT_KV_CASES[case]
    (q, k, v), m = _inputs(2, 6, 2, 5, 7, 8, 8, torch.float32, mask_kind)
    before = tpu_compile.STATS["ungrouped_kv"]
    f = torch.compile(_repeat_kv_attention, backend="tpu", dynamic=False)
    # Programs built here, not served from AOTAutograd's cache (its key does not see the switch).
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        out = f(q.to("tpu"), k.to("tpu"), v.to("tpu"), None if m is None else m.to("tpu"), causal)
    ref = _repeat_kv_attention(q, k, v, m, causal)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)
    assert len(texts) == 1
    repeated = ("tensor<2x2x3x7x8xf32>", "tensor<2x6x7x8xf32>")
    if grouped:
        assert tpu_compile.STATS["ungrouped_kv"] == before + 1
        assert not [r for r in repeated if r in texts[0]], texts[0]
        # The scores: one product per K/V head, its 3 query heads' 5 rows stacked (4 = B * Hk).
        assert "tensor<4x15x8xf32>, tensor<4x7x8xf32>) -> tensor<4x15x7xf32>" in texts[0], texts[0]
    else:
        assert tpu_compile.STATS["ungrouped_kv"] == before
        assert all(r in texts[0] for r in repeated), texts[0]


def test_compiled_repeat_kv_attention_trains_like_cpu() -> None:
    """Forward and backward through compiled repeat_kv attention (the forward's fused op takes the
    grouped K/V; the backward graph keeps the repeat it saved): gradients equal CPU's."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(4)
    qkv, m = _inputs(2, 6, 2, 5, 7, 8, 8, torch.float32, "float")
    t = [x.to("tpu").requires_grad_() for x in qkv]
    out = torch.compile(_repeat_kv_attention, backend="tpu", dynamic=False)(*t, m.to("tpu"), False)
    grad = torch.randn(out.shape)
    out.backward(grad.to("tpu"))
    r = [x.clone().requires_grad_() for x in qkv]
    ref = _repeat_kv_attention(*r, m, False)
    ref.backward(grad)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=2e-5, rtol=2e-5)
    for a, b in zip(t, r, strict=True):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=2e-5, rtol=2e-5)
