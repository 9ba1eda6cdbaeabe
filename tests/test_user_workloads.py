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


def test_generic_torch_event_times_like_cuda() -> None:
    """torch.Event(device="tpu", enable_timing=True) (the device-generic event, c10's DeviceGuard
    interface): record, query, synchronize, elapsed_time in ms; timing off or unrecorded raise."""
    import time

    start, end = torch.Event(device="tpu", enable_timing=True), torch.Event(device="tpu", enable_timing=True)
    start.record()
    y = torch.randn(64, 64, device="tpu") @ torch.randn(64, 64, device="tpu")
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert end.query()
    assert 20.0 <= start.elapsed_time(end) < 10_000.0
    untimed = torch.Event(device="tpu")
    untimed.record()
    untimed.synchronize()
    with pytest.raises((ValueError, RuntimeError), match="enable_timing"):
        untimed.elapsed_time(end)
    with pytest.raises((ValueError, RuntimeError), match="recorded"):
        torch.Event(device="tpu", enable_timing=True).elapsed_time(end)
    assert y.sum().item() == pytest.approx((y.cpu()).sum().item(), rel=1e-4)


def test_repeat_interleave_with_tensor_repeats_runs_on_tpu(no_fallback: None) -> None:
    """repeat_interleave with a repeats tensor: output_size= given runs on the device without a host
    read; without it, one counted host read of the sizes (as CUDA syncs), not a CPU fallback; the
    CPU's error for negative repeats; autograd through the self_Tensor form."""
    reps = torch.tensor([2, 0, 3, 1])
    x = torch.randn(4, 3, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    rt = reps.to("tpu")
    for dtype in (torch.int64, torch.int32):
        want = torch.repeat_interleave(reps.to(dtype))
        torch.testing.assert_close(torch.repeat_interleave(rt.to(dtype), output_size=6).cpu(), want)
        torch.testing.assert_close(torch.repeat_interleave(rt.to(dtype)).cpu(), want)
    before = torch_tpu.dispatch_stats()["host_syncs"]
    got = torch.repeat_interleave(xt, rt, dim=0, output_size=6)
    assert torch_tpu.dispatch_stats()["host_syncs"] == before
    want = torch.repeat_interleave(x, reps, dim=0)
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(torch.repeat_interleave(xt, rt, dim=0).cpu(), want)
    (want * torch.arange(6.0)[:, None]).sum().backward()
    (got * torch.arange(6.0, device="tpu")[:, None]).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        torch.repeat_interleave(torch.tensor([1, -1], device="tpu"))


def test_sdpa_3d_inputs_with_another_value_dim_match_cpu(no_fallback: None) -> None:
    """3-d SDPA whose value dim differs from the query's: PyTorch's meta of the fused op fails there,
    so those calls decompose; forward and grads vs CPU."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 40, 8), torch.randn(2, 30, 8), torch.randn(2, 30, 5)
    g = torch.randn(2, 40, 5)
    res = []
    for dev in ("cpu", "tpu"):
        x = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True)
        o.backward(g.to(dev))
        res.append([o.detach().cpu()] + [t.grad.cpu() for t in x])
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


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


def _overlap_case(case: str, device: str) -> torch.Tensor:
    t = torch.arange(6.0, device=device)
    if case == "expanded":
        torch.zeros(1, 3, device=device).expand(2, 3).add_(1)
    elif case == "partial":
        t[1:].add_(t[:-1])
    elif case == "transposed":
        s = t[:4].view(2, 2)
        s.add_(s.t())
    elif case == "out":
        torch.mul(t[:-1], 2, out=t[1:])
    elif case == "unary":
        torch.zeros(1, 3, device=device).expand(2, 3).exp_()
    elif case == "random":
        torch.zeros(1, 3, device=device).expand(2, 3).uniform_()
    elif case == "copy_expanded":
        torch.zeros(1, 3, device=device).expand(2, 3).copy_(torch.ones(2, 3, device=device))
    elif case == "copy_partial":
        t[1:].copy_(t[:-1])
    elif case == "fill_expanded":  # fill_/zero_/threshold_ do not check on the CPU either
        torch.zeros(1, 3, device=device).expand(2, 3).fill_(2)
    elif case == "same_view":  # full overlap (the same elements) is allowed
        t.add_(t.view(2, 3).view(6))
    elif case == "threshold":
        torch.nn.functional.threshold_(torch.zeros(1, 3, device=device).expand(2, 3), 0.0, 1.0)
    return t


@pytest.mark.parametrize("case", ["expanded", "partial", "transposed", "out", "unary", "random",
                                  "copy_expanded", "copy_partial", "fill_expanded", "same_view", "threshold"])
def test_inplace_memory_overlap_raises_like_cpu(case: str) -> None:
    """ATen's TensorIterator overlap checks (internal, partial) on writes, as the CPU kernels run them;
    twice each: the second call may be a dispatch-cache hit (typed kernel) and must raise too."""
    try:
        want = _overlap_case(case, "cpu")
    except RuntimeError as e:
        for _ in range(2):
            with pytest.raises(RuntimeError) as got:
                _overlap_case(case, "tpu")
            assert str(got.value) == str(e)
        return
    for _ in range(2):
        torch.testing.assert_close(_overlap_case(case, "tpu").cpu(), want)


def test_inplace_overlap_check_keeps_cache_hits_for_plain_writes() -> None:
    """A non-overlapping in-place add after an overlapping one (same op, same shapes) still works,
    and an overlapping one after cached plain ones still raises."""
    a = torch.arange(6.0, device="tpu")
    b = torch.arange(6.0, device="tpu")
    for _ in range(2):
        a[1:].add_(b[:-1])
    with pytest.raises(RuntimeError, match="some elements of the input tensor"):
        a[1:].add_(a[:-1])
    a[1:].add_(b[:-1])
    ref = torch.arange(6.0)
    for _ in range(3):
        ref[1:].add_(torch.arange(6.0)[:-1])
    torch.testing.assert_close(a.cpu(), ref)


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


def test_float_to_uint8_wraps_like_cpu() -> None:
    """c10 casts floats to uint8 through int64 (-1.7 -> 255, 256.5 -> 0); XLA's convert saturates."""
    x = torch.tensor([1.7, -1.7, 255.9, -0.5, 256.5, -129.0, 0.0])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        xd = x.to(dtype)
        assert xd.to("tpu").to(torch.uint8).cpu().tolist() == xd.to(torch.uint8).tolist()
        assert (xd.to("tpu") * 1).to(torch.uint8).cpu().tolist() == (xd * 1).to(torch.uint8).tolist()
