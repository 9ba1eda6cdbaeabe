"""Bounded dynamic shapes under torch.compile(backend="tpu"): one Dynamo graph per symbolic
signature, one program per size bucket (padded with masks), results equal to CPU eager."""

from __future__ import annotations

import math

import pytest
import torch
import torch_tpu
from torch_tpu._internal import dynamic_shapes


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Dynamo remembers sizes per code object across tests (automatic dynamic): a model forward
    compiled by an earlier test would start this one with different symbols. Start clean."""
    torch._dynamo.reset()


def _programs() -> list[dict]:
    return torch_tpu.compile_stats()["graph_tiers"]


def _tiny_llama(layers: int = 1):  # noqa: ANN202
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_hf_generate_dynamic_cache_bucketed() -> None:
    """model.forward compiled, default DynamicCache: the KV length grows every token, Dynamo
    keeps one symbolic graph and the backend builds one program per power-of-two bucket."""
    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 5))
    new = 40  # KV length 5..44: buckets 16, 32, 64
    ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    model = model.to("tpu")
    model.forward = torch.compile(model.forward, backend="tpu")
    before = len(_programs())
    torch._dynamo.utils.counters.clear()
    out = model.generate(ids.to("tpu"), max_new_tokens=new, do_sample=False)
    assert torch.equal(out.cpu(), ref)  # greedy tokens equal CPU eager
    built = len(_programs()) - before
    assert built <= math.ceil(math.log2(5 + new)) + 2, _programs()[before:]
    # never fell back to eager through Dynamo's recompile limit
    assert not torch._dynamo.utils.counters["stats"].get("unique_graphs_limit", 0)
    padded = [b for b in dynamic_shapes.BUCKETS if b["kind"] == "padded"]
    assert {max(b["bucket"].values()) for b in padded} >= {16, 32, 64}
    # Steady state: the same generation again builds nothing new.
    before = len(_programs())
    again = model.generate(ids.to("tpu"), max_new_tokens=new, do_sample=False)
    assert torch.equal(again.cpu(), ref)
    assert len(_programs()) == before


def test_hf_generate_batched_left_padded() -> None:
    """Two prompts, one left-padded: the attention mask is built in the graph (arange, index,
    comparisons over the KV length) and still pads into buckets; tokens equal CPU eager."""
    model = _tiny_llama()
    model.config.pad_token_id = 0
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    ids[1, :2], mask[1, :2] = 0, 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
    model = model.to("tpu")
    model.forward = torch.compile(model.forward, backend="tpu")
    torch_tpu.reset_cache_stats()
    out = model.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=14, do_sample=False)
    assert torch.equal(out.cpu(), ref)
    assert dynamic_shapes.BUCKETS and all(b["kind"] == "padded" for b in dynamic_shapes.BUCKETS), \
        dynamic_shapes.BUCKETS


def _mixed(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a = torch.softmax(x @ w, dim=0)  # softmax over the dynamic dim
    s = a.sum(0) + x.mean(0) + x.amax(0) + torch.log_softmax(x, 0)[0]
    t = torch.cat([x, y], 0) * 2  # cat along the dynamic dim
    att = torch.nn.functional.scaled_dot_product_attention(y[None, None], x[None, None], x[None, None])
    return s, t, att, x.t() @ x, x.reshape(x.shape[0], 2, 4).transpose(0, 1)


def test_dynamic_true_buckets_match_cpu() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    wt = w.to("tpu")
    g = torch.compile(_mixed, backend="tpu", dynamic=True)
    torch_tpu.reset_cache_stats()
    for n in (3, 5, 9, 16, 17, 20):
        x, y = torch.randn(n, 8), torch.randn(2, 8)
        ref = _mixed(x, y, w)
        out = g(x.to("tpu"), y.to("tpu"), wt)
        for r, o in zip(ref, out, strict=True):
            assert o.shape == r.shape
            torch.testing.assert_close(o.cpu(), r, atol=1e-5, rtol=1e-5)
    kinds = [(b["kind"], b["bucket"]) for b in dynamic_shapes.BUCKETS]
    assert all(k == "padded" for k, _ in kinds), dynamic_shapes.BUCKETS
    assert sorted(max(b.values()) for _, b in kinds) == [16, 32]  # two programs for six sizes
    text = str(torch_tpu.explain(print_result=False))
    assert "<=32" in text and "dynamic-shape programs" in text


def test_layer_norm_embedding_self_attention_padded() -> None:
    torch.manual_seed(0)
    ln, emb = torch.nn.LayerNorm(8), torch.nn.Embedding(20, 8)
    ln_t, emb_t = torch.nn.LayerNorm(8).to("tpu"), torch.nn.Embedding(20, 8).to("tpu")
    ln_t.load_state_dict(ln.state_dict())
    emb_t.load_state_dict(emb.state_dict())

    def f(ids: torch.Tensor, ln: torch.nn.Module, emb: torch.nn.Module) -> torch.Tensor:
        h = ln(emb(ids))[:, None]  # non-causal self-attention over the dynamic length
        return torch.nn.functional.scaled_dot_product_attention(h, h, h).sum(1)

    g = torch.compile(f, backend="tpu")
    torch_tpu.reset_cache_stats()
    with torch.no_grad():
        for n in (3, 7, 18):
            ids = torch.randint(0, 20, (2, n))
            ids_t = ids.to("tpu")
            torch._dynamo.mark_dynamic(ids_t, 1)
            torch.testing.assert_close(g(ids_t, ln_t, emb_t).cpu(), f(ids, ln, emb), atol=1e-5, rtol=1e-5)
    assert [(b["kind"], list(b["bucket"].values())) for b in dynamic_shapes.BUCKETS] == [
        ("padded", [16]), ("padded", [32])]


def test_mark_dynamic_max_caps_the_bucket() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, 0) * x.sum(0, keepdim=True)

    g = torch.compile(f, backend="tpu")
    torch_tpu.reset_cache_stats()
    for n in (5, 7, 20, 24):
        x = torch.randn(n, 3)
        xt = x.to("tpu")
        torch._dynamo.mark_dynamic(xt, 0, min=2, max=24)
        torch.testing.assert_close(g(xt).cpu(), f(x), atol=1e-5, rtol=1e-5)
    assert sorted({b["bucket"][next(iter(b["bucket"]))] for b in dynamic_shapes.BUCKETS}) == [16, 24]


def test_training_graphs_are_padded_and_grads_match_cpu() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    lin_t = torch.nn.Linear(8, 8).to("tpu")
    lin_t.load_state_dict(lin.state_dict())

    def f(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (torch.softmax(m(x), dim=0) * x).sum() + x.mean()

    g = torch.compile(f, backend="tpu", dynamic=True)
    torch_tpu.reset_cache_stats()
    for n in (3, 9, 17):
        x = torch.randn(n, 8, requires_grad=True)
        xt = x.detach().to("tpu").requires_grad_()
        f(lin, x).backward()
        g(lin_t, xt).backward()
        torch.testing.assert_close(xt.grad.cpu(), x.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin_t.weight.grad.cpu(), lin.weight.grad, atol=1e-5, rtol=1e-5)
    # forward and backward: one padded program per bucket each (16, then 32)
    assert [(b["kind"], max(b["bucket"].values())) for b in dynamic_shapes.BUCKETS] == [
        ("padded", 16), ("padded", 16), ("padded", 32), ("padded", 32)]


def test_op_without_padded_rule_runs_exact_programs() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, [0]) + 1  # the padding would move to the front: no padded rule

    g = torch.compile(f, backend="tpu", dynamic=True)
    torch_tpu.reset_cache_stats()
    for n in (4, 6):
        x = torch.randn(n, 3)
        torch.testing.assert_close(g(x.to("tpu")).cpu(), f(x))
    entries = dynamic_shapes.BUCKETS
    assert [b["kind"] for b in entries] == ["exact", "exact"]
    assert "flip" in entries[0]["reason"]
    assert "exact" in str(torch_tpu.explain(print_result=False))


def test_scans_and_all_any_run_padded() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        # a scan along the padded dim sees only earlier elements; all/any mask padding with identity
        return torch.cumsum(x, 0) * (x > -5).all() + (x > 1).any(0)

    g = torch.compile(f, backend="tpu", dynamic=True)
    torch_tpu.reset_cache_stats()
    for n in (4, 6):
        x = torch.randn(n, 3)
        torch.testing.assert_close(g(x.to("tpu")).cpu(), f(x))
    assert [b["kind"] for b in dynamic_shapes.BUCKETS] == ["padded"]


def test_size_used_as_a_value_runs_exact_programs() -> None:
    table = torch.randn(64, 4)
    table_t = table.to("tpu")

    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.sum(0) + t[n:n + 1].sum(0)  # slicing a static dim at the symbolic size

    g = torch.compile(f, backend="tpu")
    torch_tpu.reset_cache_stats()
    for n in (3, 6, 20):
        x = torch.randn(n, 4)
        x_t = x.to("tpu")
        torch._dynamo.mark_dynamic(x_t, 0)
        torch.testing.assert_close(g(x_t, table_t).cpu(), f(x, table))
    assert [b["kind"] for b in dynamic_shapes.BUCKETS] == ["exact"] * 3
    assert "size is used as a value" in dynamic_shapes.BUCKETS[0]["reason"]


def test_prefix_view_comes_back_without_copy() -> None:
    """An output padded along a symbolic dim is a view of the bucket buffer; passed back in, the
    buffer itself is the program input (no pad, no copy)."""
    def step(cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([cache, new], 0)

    g = torch.compile(step, backend="tpu", dynamic=True)
    cache = torch.randn(3, 4)
    ct = cache.to("tpu")
    for _ in range(6):
        new = torch.randn(1, 4)
        cache = step(cache, new)
        ct = g(ct, new.to("tpu"))
        torch.testing.assert_close(ct.cpu(), cache)
    assert ct._base is not None and ct._base.shape[0] == 16


@pytest.mark.parametrize("v,hi,want", [(1, None, 16), (16, None, 16), (17, None, 32), (17, 20, 20), (300, None, 512)])
def test_next_bucket(v: int, hi: int | None, want: int) -> None:
    assert dynamic_shapes.next_bucket(v, hi) == want
