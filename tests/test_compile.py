"""torch.compile(backend="tpu"): compiled == eager == CPU; mutations; graph breaks; recompiles."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch._dynamo
import torch_tpu
from torch_tpu._internal.compile import TpuBackend


@pytest.fixture(autouse=True)
def _reset_dynamo() -> None:
    torch._dynamo.reset()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def test_mlp_forward_matches_cpu_and_eager() -> None:
    m = _mlp()
    x = torch.randn(5, 8)
    ref = m(x)
    mt = copy.deepcopy(m).to("tpu")
    eager = mt(x.to("tpu")).cpu()
    out = torch.compile(mt, backend="tpu")(x.to("tpu"))
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), eager, atol=1e-6, rtol=1e-6)


def test_linear_on_many_rows_is_the_swapped_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """mm(x, t(W)) with many rows is lowered as t(dot(W, t(x))) behind an optimization_barrier
    (XLA:CPU packs a transposed weight slowly); forward and backward still match CPU. 640 rows: past
    the host GEMM's rows in compiled graphs (tests/test_host_gemm.py::test_compiled_rule)."""
    from torch_tpu import _C
    from torch_tpu._internal import compile as tpu_compile

    texts: list[str] = []
    build = tpu_compile._build

    def spy(desc: dict[str, Any]) -> int:
        texts.append(_C._graph_text(desc))
        return build(desc)

    monkeypatch.setattr(tpu_compile, "_build", spy)
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 1024, bias=False)
    x = torch.randn(640, 256, requires_grad=True)
    lin(x).square().sum().backward()
    mt = copy.deepcopy(lin).to("tpu")
    xt = x.detach().to("tpu").requires_grad_()
    out = torch.compile(mt, backend="tpu", dynamic=False)(xt)
    out.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu(), lin(x).detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mt.weight.grad.cpu(), lin.weight.grad, atol=1e-4, rtol=1e-5)
    assert texts and "optimization_barrier" in texts[0], texts[0][-2000:] if texts else "no program"
    assert "torch_tpu.gemm" not in texts[0]


def test_backend_class_and_fullgraph() -> None:
    m = _mlp().to("tpu")
    x = torch.randn(3, 8, device="tpu")
    out = torch.compile(m, backend=TpuBackend(), fullgraph=True)(x)
    torch.testing.assert_close(out.cpu(), m.cpu()(x.cpu()), atol=1e-5, rtol=1e-5)


def test_training_step_gradients_match_cpu() -> None:
    m = _mlp()
    mt = copy.deepcopy(m).to("tpu")
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))

    def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = step(m, x, y)
    loss_t = torch.compile(step, backend="tpu")(mt, x.to("tpu"), y.to("tpu"))
    torch.testing.assert_close(loss_t.cpu(), loss, atol=1e-6, rtol=1e-6)
    for p, pt in zip(m.parameters(), mt.parameters(), strict=True):
        torch.testing.assert_close(pt.grad.cpu(), p.grad, atol=1e-6, rtol=1e-5)


class _Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, self.lin(x))
        self.cache.add_(1.0)
        return self.cache.sum(0)


def test_input_mutation_static_cache_style() -> None:
    torch.manual_seed(0)
    m = _Cache()
    mt = copy.deepcopy(m).to("tpu")
    cm = torch.compile(mt, backend="tpu", fullgraph=True)
    for i in range(3):
        x, pos = torch.randn(1, 3), torch.tensor([i])
        torch.testing.assert_close(cm(x.to("tpu"), pos.to("tpu")).cpu(), m(x, pos), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mt.cache.cpu(), m.cache, atol=1e-5, rtol=1e-5)


def test_tensor_constants_made_while_tracing_are_real_on_first_run() -> None:
    # Tensors the traced code creates become graph constants; their device copies are made while
    # Dynamo's fake mode is active (Mistral's and Gemma2's sliding-window masks did this): a cold
    # compile's first run got FakeTensor operands and failed.
    import torch._functorch.config as functorch_config

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(3.0) + torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)

    x = torch.randn(4)
    with functorch_config.patch(enable_autograd_cache=False):  # the traced (cold) path
        out = torch.compile(f, backend="tpu", fullgraph=True)(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), f(x))


def test_graph_break_falls_back_correctly() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2
        torch._dynamo.graph_break()
        return y.cos() + 1

    x = torch.randn(7)
    torch.testing.assert_close(torch.compile(f, backend="tpu")(x.to("tpu")).cpu(), f(x), atol=1e-6, rtol=1e-6)


def test_scalar_changes_do_not_recompile_after_warmup() -> None:
    def f(x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s + s

    cf = torch.compile(f, backend="tpu")
    x = torch.randn(6, device="tpu")
    cf(x, 2.0)
    cf(x, 3.0)  # Dynamo turns the float into a graph input here (automatic dynamic)
    before = torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"]
    for s in (4.5, -1.0, 1e3):
        out = cf(x, s)
        torch.testing.assert_close(out.cpu(), x.cpu() * s + s)
    after = torch_tpu.cache_stats()["misses"] + torch_tpu.cache_stats()["disk_hits"]
    assert after == before


def test_new_shape_compiles_exactly_once() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x @ x.T).relu().sum(-1)

    cf = torch.compile(f, backend="tpu", dynamic=False)
    cf(torch.randn(4, 5, device="tpu"))
    base = torch_tpu.cache_stats()
    cf(torch.randn(6, 5, device="tpu"))
    mid = torch_tpu.cache_stats()
    out = cf(torch.randn(6, 5, device="tpu"))
    end = torch_tpu.cache_stats()
    new = lambda a, b: (b["misses"] + b["disk_hits"] + b["memory_hits"]) - (a["misses"] + a["disk_hits"] + a["memory_hits"])  # noqa: E731
    assert new(base, mid) >= 1
    assert new(mid, end) == 0
    assert out.shape == (6,)


def test_views_and_strided_outputs() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = x.t()[1:, ::2]
        b = x.reshape(-1, 2).permute(1, 0).contiguous()
        return a * 2, b, x.unsqueeze(0).expand(3, *x.shape).sum(0)

    x = torch.randn(4, 6)
    outs = torch.compile(f, backend="tpu")(x.to("tpu"))
    for o, r in zip(outs, f(x), strict=True):
        assert o.shape == r.shape
        torch.testing.assert_close(o.cpu(), r)


def test_default_backend_routes_tpu_graphs() -> None:
    m = _mlp()
    x = torch.randn(3, 8)
    ref = m(x)
    mt = copy.deepcopy(m).to("tpu")
    before = torch_tpu.dispatch_stats()["ops"]
    out = torch.compile(mt)(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    assert torch_tpu.dispatch_stats()["ops"] > before
    mt.compile()  # nn.Module.compile goes through torch.compile too
    torch.testing.assert_close(mt(x.to("tpu")).cpu(), ref, atol=1e-5, rtol=1e-5)
    # CPU graphs still go to Inductor untouched (only checked when a C++ compiler is present).


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_tiny_llama_forward_and_backward_compiled() -> None:
    m = _tiny_llama()
    mt = copy.deepcopy(m).to("tpu")
    ids = torch.randint(0, 256, (2, 12))
    loss = m(ids, labels=ids).loss
    loss.backward()
    cm = torch.compile(mt, backend="tpu")
    with _no_eager_fallback_warning():
        loss_t = cm(ids.to("tpu"), labels=ids.to("tpu")).loss
        loss_t.backward()
    torch.testing.assert_close(loss_t.cpu(), loss, atol=1e-5, rtol=1e-5)
    for p, pt in zip(m.parameters(), mt.parameters(), strict=True):
        torch.testing.assert_close(pt.grad.cpu(), p.grad, atol=1e-5, rtol=1e-4)
    assert torch_tpu.fallback_stats() == {}


def test_tiny_llama_static_cache_decode_no_recompiles() -> None:
    m = _tiny_llama().eval()
    ids = torch.randint(0, 256, (1, 6))
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    mt = copy.deepcopy(m).to("tpu")
    out = mt.generate(ids.to("tpu"), max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(out.cpu(), ref)
    before = torch_tpu.cache_stats()
    out = mt.generate(ids.to("tpu"), max_new_tokens=6, do_sample=False, cache_implementation="static")
    after = torch_tpu.cache_stats()
    assert torch.equal(out.cpu(), ref)
    assert after["misses"] == before["misses"] and after["disk_hits"] == before["disk_hits"]


def test_tiny_llama_compiled_static_cache_tokens_equal_eager() -> None:
    """Prefill and greedy decode of HF Llama (GQA: 4 query heads, 2 K/V heads) with a static cache
    under torch.compile: with the cache's mask HF repeats K/V (repeat_kv) before SDPA, and the
    compiled graphs give the fused op the grouped K/V instead (graph_passes); tokens equal CPU
    eager's."""
    import transformers
    from torch_tpu._internal import compile as tpu_compile

    torch._dynamo.reset()
    m = _tiny_llama().eval()
    mt = copy.deepcopy(m).to("tpu")

    def tokens(model: torch.nn.Module, device: str, step: Any) -> list[int]:
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        cfg = model.config
        cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=torch.float32,
                                   device=torch.device(device))
        ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
        out, pos = [], torch.arange(6, device=device)
        for _ in range(4):
            tok = step(model, ids, cache, pos)
            out.append(int(tok.item()))
            ids, pos = tok, pos[-1:] + 1
        return out

    def step(model: torch.nn.Module, ids: torch.Tensor, cache: Any, pos: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, cache=cache, cache_position=pos, position_ids=pos.unsqueeze(0),
                       use_cache=True, logits_to_keep=1).logits
        return logits.argmax(-1)

    before = tpu_compile.STATS["ungrouped_kv"]
    with torch.no_grad():
        ref = tokens(m, "cpu", step)
        with _no_eager_fallback_warning():
            got = tokens(mt, "tpu", torch.compile(step, backend="tpu", dynamic=False))
    assert got == ref
    # 2 layers in the prefill graph and in the decode graph
    assert tpu_compile.STATS["ungrouped_kv"] - before == 4


class _no_eager_fallback_warning:  # noqa: N801 - used as a context manager
    """Fails if a compiled graph had to run op by op."""

    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._log = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
        bad = [str(w.message) for w in self._log if "runs op by op" in str(w.message)]
        assert not bad, bad


def test_compiled_adamw_step_mutates_params_and_state() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 4)
    mt = copy.deepcopy(m).to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(mt.parameters(), lr=1e-2)
    for p, pt in zip(m.parameters(), mt.parameters(), strict=True):
        p.grad = torch.randn_like(p)
        pt.grad = p.grad.to("tpu")

    @torch.compile(backend="tpu")
    def step() -> None:
        opt_t.step()

    with _no_eager_fallback_warning():
        for _ in range(3):
            opt.step()
            step()
    for p, pt in zip(m.parameters(), mt.parameters(), strict=True):
        torch.testing.assert_close(pt.detach().cpu(), p.detach(), atol=1e-6, rtol=1e-5)
    s, st = opt.state_dict()["state"][0], opt_t.state_dict()["state"][0]
    torch.testing.assert_close(st["exp_avg"].cpu(), s["exp_avg"])
    torch.testing.assert_close(st["exp_avg_sq"].cpu(), s["exp_avg_sq"])
    assert float(st["step"]) == float(s["step"]) == 3.0


def test_dynamo_device_interface_is_ours() -> None:
    from torch._dynamo.device_interface import get_interface_for_device

    TpuBackend()
    iface = get_interface_for_device("tpu")
    assert iface.is_available() and iface.device_count() >= 1
    assert iface.is_dtype_supported(torch.float16) and iface.is_dtype_supported(torch.bfloat16)
    m = torch.nn.Linear(4, 4).to("tpu").half()
    x = torch.randn(2, 4, device="tpu").half()
    out = torch.compile(m, backend="tpu")(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.cpu().float(), m.cpu().float()(x.cpu().float()), atol=2e-2, rtol=2e-2)


def test_automatic_dynamic_shapes_specialize_per_shape() -> None:
    # Dynamo makes the batch dim symbolic on the second shape; the backend compiles each concrete
    # shape (guards make Dynamo come back for new ones) instead of running op by op.
    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 3, 2))
    mt = copy.deepcopy(m).to("tpu")
    cm = torch.compile(mt, backend="tpu")
    with _no_eager_fallback_warning():
        for n in (2, 3, 5):
            x = torch.randn(n, 4, 3, 3)
            torch.testing.assert_close(cm(x.to("tpu")).cpu(), m(x), atol=1e-5, rtol=1e-5)


# ---- fused SDPA in compiled graphs (and random ops reading the generator state)


def _fx_ops(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Records the ATen ops of every FX graph the backend describes (one list per graph)."""
    from torch_tpu._internal import compile as tpu_compile

    graphs: list[list[str]] = []
    describe = tpu_compile._Describer.describe

    def record(self: tpu_compile._Describer) -> Any:
        graphs.append([str(n.target) for n in self.gm.graph.nodes if n.op == "call_function"])
        return describe(self)

    monkeypatch.setattr(tpu_compile._Describer, "describe", record)
    # A graph served by AOTAutogradCache (an earlier run on this machine) is never described.
    patch = torch._functorch.config.patch(enable_autograd_cache=False)
    patch.__enter__()
    _PATCHES.append(patch)  # undone after the test (_undo_config_patches)
    return graphs


_PATCHES: list[Any] = []


@pytest.fixture(autouse=True)
def _undo_config_patches() -> Any:
    yield
    while _PATCHES:
        _PATCHES.pop().__exit__(None, None, None)


_FUSED = "aten._scaled_dot_product_fused_attention_overrideable.default"
_FUSED_BW = "aten._scaled_dot_product_fused_attention_overrideable_backward.default"


def _sdpa_fwd_bwd(fn: Any, cpu_inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ins = [x.detach().to("tpu").requires_grad_(x.requires_grad) for x in cpu_inputs]
    out = fn(*ins)
    (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).square().sum().backward()
    return out.detach().cpu(), [x.grad.cpu() if x.requires_grad else None for x in ins]


@pytest.mark.parametrize("case", ["causal_gqa", "float_mask", "bool_mask_3d"])
def test_compiled_sdpa_uses_fused_op_and_matches_cpu(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    F = torch.nn.functional  # noqa: N806
    torch.manual_seed(0)
    if case == "causal_gqa":
        shapes, mask = [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)], None
    elif case == "float_mask":
        shapes, mask = [(2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)], torch.randn(2, 1, 5, 7)
    else:
        shapes, mask = [(3, 5, 8), (3, 7, 8), (3, 7, 8)], torch.rand(5, 7) > 0.3
    qkv = [torch.randn(s, requires_grad=True) for s in shapes]
    inputs = qkv + ([mask.requires_grad_(mask.is_floating_point())] if mask is not None else [])

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=case == "causal_gqa",
                                              enable_gqa=case == "causal_gqa")

    ref = f(*inputs)
    (ref * torch.linspace(-1, 1, ref.shape[-1])).square().sum().backward()
    graphs = _fx_ops(monkeypatch)
    with _no_eager_fallback_warning():
        out, grads = _sdpa_fwd_bwd(torch.compile(f, backend="tpu"), inputs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, x in zip(grads, inputs, strict=True):
        if x.requires_grad:
            torch.testing.assert_close(g, x.grad, atol=1e-5, rtol=1e-4)
    # One forward and one backward graph, each with the fused op and no math decomposition.
    assert len(graphs) == 2, graphs
    assert _FUSED in graphs[0] and _FUSED_BW in graphs[1], graphs
    assert not any("_softmax" in op for g in graphs for op in g), graphs
    assert torch_tpu.fallback_stats() == {}


def test_compiled_sdpa_dropout_draws_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dropout inside the fused op: the graph reads the generator state at each run, so the same
    # seed gives eager's exact mask (forward and backward), and each call draws a new one.
    F = torch.nn.functional  # noqa: N806
    torch.manual_seed(0)
    inputs = [torch.randn(s, requires_grad=True) for s in [(2, 4, 6, 8), (2, 2, 7, 8), (2, 2, 7, 8)]]

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True)

    graphs = _fx_ops(monkeypatch)
    cf = torch.compile(f, backend="tpu")
    with _no_eager_fallback_warning():
        torch.tpu.manual_seed(3)  # type: ignore[attr-defined]
        out, grads = _sdpa_fwd_bwd(cf, inputs)
        again, _ = _sdpa_fwd_bwd(cf, inputs)
    assert _FUSED in graphs[0] and _FUSED_BW in graphs[1], graphs
    torch.tpu.manual_seed(3)  # type: ignore[attr-defined]
    eager, eager_grads = _sdpa_fwd_bwd(f, inputs)
    torch.testing.assert_close(out, eager, atol=1e-6, rtol=1e-6)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert not torch.equal(out, again)
    # Without dropout the result differs: some attention weights were dropped (and others scaled).
    assert not torch.allclose(out, f(*inputs).detach(), atol=1e-3)


def test_compiled_dropout_module_training() -> None:
    # nn.Dropout in a compiled training graph runs in the program (no op-by-op fallback), with
    # the generator state eager would use.
    m = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.5)).to("tpu")
    x = torch.randn(4, 8, device="tpu")
    cm = torch.compile(m, backend="tpu")
    with _no_eager_fallback_warning():
        torch.tpu.manual_seed(1)  # type: ignore[attr-defined]
        y = cm(x)
        y.sum().backward()
    torch.tpu.manual_seed(1)  # type: ignore[attr-defined]
    ref = m(x)
    torch.testing.assert_close(y.detach().cpu(), ref.detach().cpu(), atol=1e-6, rtol=1e-6)
    zeros = (y.detach().cpu() == 0).float().mean().item()
    assert 0.35 < zeros < 0.65
