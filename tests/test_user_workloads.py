"""What a user hits from outside: mistakes, odd inputs and models not covered elsewhere, vs PyTorch CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch_tpu


@pytest.mark.parametrize("call", ["add", "mm"])
def test_caller_shape_mistake_is_pytorchs_error_not_a_fallback(call: str) -> None:
    """A call the CPU refuses too raises PyTorch's error; no 'runs on the CPU' warning, no fallback count."""
    a, b = (torch.randn(3), torch.randn(4)) if call == "add" else (torch.randn(2, 3), torch.randn(4, 2))
    fn = torch.add if call == "add" else torch.mm
    with pytest.raises(RuntimeError) as cpu_err:
        fn(a, b)
    torch_tpu.reset_fallback_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError) as tpu_err:
            fn(a.to("tpu"), b.to("tpu"))
    assert str(tpu_err.value) == str(cpu_err.value)
    assert not [w for w in caught if "runs on the CPU" in str(w.message)]
    assert torch_tpu.fallback_stats() == {}


def test_shape_mistake_under_fallback_error_names_the_shape_problem() -> None:
    code = (
        "import torch\n"
        "try:\n"
        "    torch.randn(3, device='tpu') + torch.randn(4, device='tpu')\n"
        "except RuntimeError as e:\n"
        "    print(type(e).__name__, '|', e)\n"
    )
    env = dict(os.environ, TORCH_TPU_FALLBACK="error")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused its arguments" in out.stdout and "broadcast" in out.stdout, out.stdout
    assert "no tpu lowering" not in out.stdout and "At:" not in out.stdout, out.stdout


def test_compiled_function_with_cpu_tensors_runs_like_eager() -> None:
    """CPU tensors inside a compiled graph (a CPU mask moved to tpu, CPU math, `.cpu()` of a result)
    run on the CPU between tpu pieces, as with CUDA; forward and backward equal CPU, no warning."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    dev = torch.nn.Linear(4, 4).to("tpu")
    dev.load_state_dict(lin.state_dict())
    mask = (torch.arange(12).reshape(3, 4) % 2).float()

    def step(layer: torch.nn.Module, x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = layer(x) * m.to(x.device)
        return y.sum(), y.detach().cpu(), m * 2

    torch._dynamo.reset()
    x = torch.randn(3, 4)
    xd = x.to("tpu").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loss, host, doubled = torch.compile(step, backend="tpu")(dev, xd, mask)
    loss.backward()
    xc = x.clone().requires_grad_()
    ref_loss, ref_host, ref_doubled = step(lin, xc, mask)
    ref_loss.backward()
    assert host.device.type == "cpu" and doubled.device.type == "cpu" and loss.device.type == "tpu"
    torch.testing.assert_close(loss.cpu(), ref_loss.detach())
    torch.testing.assert_close(host, ref_host)
    torch.testing.assert_close(doubled, ref_doubled)
    torch.testing.assert_close(xd.grad.cpu(), xc.grad)
    torch.testing.assert_close(dev.weight.grad.cpu(), lin.weight.grad)


def test_torch_tpu_eager_mode_names_as_in_the_reference() -> None:
    """torch.tpu.EagerMode / set_eager_mode / the settable torch.tpu.eager_mode; refused inside compile."""
    modes = torch.tpu.EagerMode
    assert torch.tpu.eager_mode == modes.DEFER_NEVER
    x = torch.randn(4, 3)
    try:
        torch.tpu.eager_mode = modes.DEFER_AND_FUSE
        assert torch_tpu.get_eager_mode() == modes.DEFER_AND_FUSE
        y = (x.to("tpu") * 2).exp()
        with torch.tpu.set_eager_mode(modes.DEFER_NEVER_AND_LAUNCH_BLOCKING):
            assert torch.tpu.eager_mode == modes.DEFER_NEVER_AND_LAUNCH_BLOCKING
            z = y + 1
        assert torch.tpu.eager_mode == modes.DEFER_AND_FUSE
        torch.testing.assert_close(z.cpu(), (x * 2).exp() + 1)
        with pytest.raises(TypeError, match="EagerMode"):
            torch.tpu.eager_mode = "fast"
    finally:
        torch.tpu.eager_mode = modes.DEFER_NEVER

    def switches(t: torch.Tensor) -> torch.Tensor:
        torch.tpu.set_eager_mode(modes.DEFER_AND_FUSE)
        return t + 1

    torch._dynamo.reset()
    with pytest.raises(Exception, match="inside torch.compile"):
        torch.compile(switches, backend="tpu", fullgraph=True)(x.to("tpu"))
    assert torch.tpu.eager_mode == modes.DEFER_NEVER


def test_event_timing_and_stream_helpers_like_cuda() -> None:
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record()
    y = torch.randn(64, 64, device="tpu") @ torch.randn(64, 64, device="tpu")
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) > 0.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.tpu.Event().elapsed_time(end)
    torch.tpu.set_stream(torch.tpu.current_stream())
    with torch.tpu.device_of(y):
        assert torch.tpu.current_device() == y.get_device()


def test_random_factories_stay_inside_compiled_graphs_with_eager_draws() -> None:
    """torch.randn/rand/randint(_like) in a compiled function: one program (no eager pieces), the
    same numbers as eager under the same seed, and the generator advanced as eager advances it."""
    a = torch.zeros(4, 5, device="tpu")

    def draws(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.randn(3, 2, device="tpu"), torch.rand(7, device="tpu", dtype=torch.bfloat16),
                torch.randint(2, 9, (5,), device="tpu"), torch.randint(4, (2, 2), device="tpu"),
                torch.randn_like(t), torch.rand_like(t), torch.randint_like(t, 3, 9), t + 1)

    torch._dynamo.reset()
    before = torch_tpu.compile_stats()["partitioned_graphs"]
    torch.manual_seed(11)
    eager = [draws(a), draws(a)]
    torch.manual_seed(11)
    compiled = torch.compile(draws, backend="tpu", fullgraph=True)
    got = [compiled(a), compiled(a)]
    assert torch_tpu.compile_stats()["partitioned_graphs"] == before
    for e_call, c_call in zip(eager, got, strict=True):
        for e, c in zip(e_call, c_call, strict=True):
            assert e.dtype == c.dtype and e.shape == c.shape
            assert torch.equal(e.cpu(), c.cpu())
    assert not torch.equal(got[0][0].cpu(), got[1][0].cpu())


def test_graph_with_a_tensor_constant_is_saved_to_the_aot_cache() -> None:
    """A graph holding a tensor constant (torch.tensor([...]) in forward, as GPT-2's does) is saved
    to AOTAutograd's cache (was dropped with 'Can't pickle ... WeakValueDictionary': the constant was
    copied to the host under AOTAutograd's fake mode)."""
    import torch._functorch.config as functorch_config

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.flatten(), torch.tensor([], device=x.device), torch.tensor([2.0, 3.0], device=x.device)]) * 2

    torch._dynamo.reset()
    x = torch.arange(4.0).reshape(2, 2)
    with functorch_config.patch(strict_autograd_cache=True, enable_autograd_cache=True):
        out = torch.compile(f, backend="tpu", fullgraph=True)(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), f(x))


def _rnn_grads(module: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    outs = module(*inputs)
    flat: list[torch.Tensor] = []
    stack = [outs]
    while stack:
        o = stack.pop(0)
        if isinstance(o, torch.Tensor):
            flat.append(o)
        else:
            stack.extend(o)
    sum((o.float() * (k + 1)).sum() for k, o in enumerate(flat)).backward()
    return [o.detach() for o in flat] + [p.grad for p in module.parameters()] + [i.grad for i in inputs]


@pytest.mark.parametrize("case", ["lstm", "gru", "lstm_cell", "gru_cell", "lstm_bf16"])
def test_recurrent_layers_match_cpu(case: str, no_fallback: None) -> None:
    """nn.LSTM / nn.GRU / their cells call the fused cell ops PyTorch provides for CUDA only (no
    CPU kernel to fall back to: they failed outright on tpu); forward, state and gradients vs CPU."""
    import copy

    torch.manual_seed(0)
    modules = {
        "lstm": lambda: torch.nn.LSTM(5, 4, num_layers=2, bidirectional=True, batch_first=True),
        "gru": lambda: torch.nn.GRU(5, 4, num_layers=2, bias=False),
        "lstm_cell": lambda: torch.nn.LSTMCell(5, 4, bias=False),
        "gru_cell": lambda: torch.nn.GRUCell(5, 4),
        "lstm_bf16": lambda: torch.nn.LSTM(5, 4, proj_size=3, batch_first=True).to(torch.bfloat16),
    }
    cpu = modules[case]()
    dtype = next(cpu.parameters()).dtype
    x = torch.randn(3, 6, 5) if "cell" not in case else torch.randn(6, 5)
    extra = [torch.randn(6, 4)] if case == "gru_cell" else []
    inputs = [t.to(dtype).requires_grad_() for t in [x, *extra]]
    ref = _rnn_grads(cpu, *inputs)
    dev = copy.deepcopy(cpu).to("tpu")
    got = _rnn_grads(dev, *[t.detach().to("tpu").requires_grad_() for t in inputs])
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g.cpu(), r, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prelu_runs_on_tpu(dtype: torch.dtype, no_fallback: None) -> None:
    """nn.PReLU's forward (_prelu_kernel) was a CPU fallback; values and grads vs CPU, NaN kept."""
    x = torch.randn(2, 3, 4, 5).to(dtype)
    x[0, 0, 0, 0] = float("nan")
    w = torch.tensor([0.25, -1.5, 2.0]).to(dtype)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.prelu(xr, wr)
    ref.nan_to_num(0).sum().backward()
    xd, wd = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
    out = torch.nn.functional.prelu(xd, wd)
    out.nan_to_num(0).sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), equal_nan=True)
    torch.testing.assert_close(xd.grad.cpu(), xr.grad, equal_nan=True)
    torch.testing.assert_close(wd.grad.cpu(), wr.grad, equal_nan=True)


@pytest.mark.xfail(strict=True, reason="dispatch/plan (csrc/aten/plan_call.cc, helper i13's area): in-place ops "
                   "do not run ATen's memory-overlap checks (assert_no_internal_overlap / "
                   "assert_no_partial_overlap), so writes through an expanded view or into an overlapping "
                   "input succeed instead of raising like the CPU")
@pytest.mark.parametrize("case", ["expanded", "partial"])
def test_inplace_memory_overlap_raises_like_cpu(case: str) -> None:
    def write(device: str) -> None:
        if case == "expanded":
            torch.zeros(1, 3, device=device).expand(2, 3).add_(1)
        else:
            t = torch.arange(5.0, device=device)
            t[1:].add_(t[:-1])

    with pytest.raises(RuntimeError, match="unsupported operation"):
        write("cpu")
    with pytest.raises(RuntimeError, match="unsupported operation"):
        write("tpu")


@pytest.mark.parametrize("kwargs", [dict(lr=0.1), dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, maximize=True)])
def test_fused_adagrad_runs_on_tpu(kwargs: dict, no_fallback: None) -> None:
    """torch.optim.Adagrad(fused=True) (_fused_adagrad_, was a CPU fallback): parameters and
    state sums after 3 steps vs the CPU's fused kernel; eager and compiled."""
    import copy

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(10, 6), torch.randn(10, 3)

    def run(device: str, compiled: bool) -> list[torch.Tensor]:
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.Adagrad(model.parameters(), fused=True, **kwargs)
        xd, yd = x.to(device), y.to(device)

        def step() -> None:
            opt.zero_grad()
            ((model(xd) - yd) ** 2).mean().backward()
            opt.step()

        fn = torch.compile(step, backend="tpu") if compiled else step
        for _ in range(3):
            fn()
        return [p.detach().cpu() for p in model.parameters()] + [s["sum"].cpu() for s in opt.state.values()]

    ref = run("cpu", False)
    for compiled in (False, True):
        torch._dynamo.reset()
        for r, g in zip(ref, run("tpu", compiled), strict=True):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_lgamma_runs_on_tpu(dtype: torch.dtype, no_fallback: None) -> None:
    """torch.lgamma (torch.distributions' log-probs, mvlgamma) was a CPU fallback: values near
    the poles, at +-inf/NaN, large arguments, and its gradient vs CPU."""
    x = torch.cat([torch.linspace(-12, 12, 961), torch.tensor(
        [0.0, -0.0, 1.0, 2.0, -3.0, -1e-8, 1e-8, -7.000001, 1e10, 1e30, float("inf"), -float("inf"), float("nan")])])
    x = x.to(dtype)
    torch.testing.assert_close(torch.lgamma(x.to("tpu")).cpu(), torch.lgamma(x), atol=1e-5, rtol=1.3e-6,
                               equal_nan=True)
    xs = torch.linspace(0.1, 10, 50, dtype=dtype).requires_grad_()
    xd = xs.detach().to("tpu").requires_grad_()
    torch.lgamma(xs).sum().backward()
    torch.lgamma(xd).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xs.grad)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
def test_cdist_runs_on_tpu(p: float, no_fallback: None) -> None:
    """torch.cdist's direct path (_cdist_forward/_cdist_backward, was a CPU fallback): broadcast
    batch dims, zero distances and zero coordinate differences; values and both gradients vs CPU."""
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(2, 1, 3, 4, generator=g), torch.randn(3, 5, 4, generator=g)
    x2[1, 0] = x1[0, 0, 0]  # a zero distance
    x2[2, 1, 0] = x1[1, 0, 1, 0]  # a zero coordinate difference
    a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    ref = torch.cdist(a, b, p=p)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    ad, bd = x1.to("tpu").requires_grad_(), x2.to("tpu").requires_grad_()
    out = torch.cdist(ad, bd, p=p)
    out.backward(grad.to("tpu"))
    torch.testing.assert_close(out.detach().cpu(), ref.detach())
    torch.testing.assert_close(ad.grad.cpu(), a.grad)
    torch.testing.assert_close(bd.grad.cpu(), b.grad)
