"""Automatic mixed precision on tpu (csrc/aten/autocast.cc, csrc/lowering/amp.cc).

torch.autocast("tpu") applies CUDA's cast policy (registered for AutocastPrivateUse1);
torch.amp.GradScaler("tpu") runs its unscale / update-scale steps on the device. Results are
compared with CPU autocast (same policy for the ops compared) or fp32 CPU references; a fixture
asserts that nothing ran on the CPU fallback.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

DEV = "tpu"
LOW = [torch.bfloat16, torch.float16]
# One rounding of a low-precision result (bf16: 8 bits of mantissa, f16: 11).
TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


pytestmark = pytest.mark.usefixtures("no_fallback")


def tpu(*ts):
    return [t.to(DEV) for t in ts]


# ------------------------------------------------------------------ registration / defaults
def test_policy_registered_for_autocast_privateuse1():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in [
        "aten::mm",
        "aten::linear",
        "aten::matmul",
        "aten::conv2d",
        "aten::scaled_dot_product_attention",
        "aten::softmax.int",
        "aten::layer_norm",
        "aten::nll_loss",
        "aten::sum",
        "aten::norm.Scalar",
        "aten::cat",
        "aten::index_copy",
        "aten::binary_cross_entropy",
    ]:
        assert has(op, "AutocastPrivateUse1"), op


def test_default_dtype_is_bfloat16():
    assert torch.get_autocast_dtype(DEV) == torch.bfloat16
    a, b = tpu(torch.randn(4, 8), torch.randn(8, 3))
    with torch.autocast(DEV):
        assert torch.is_autocast_enabled(DEV)
        assert (a @ b).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled(DEV)
    assert (a @ b).dtype == torch.float32


# ------------------------------------------------------------------ cast policy
@pytest.mark.parametrize("dtype", LOW)
def test_linear_matmul_lower_precision_match_cpu_autocast(dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 16), torch.randn(12, 16), torch.randn(12)
    y3 = torch.randn(2, 16, 5)
    with torch.autocast("cpu", dtype=dtype):
        ref = [
            F.linear(x, w, b),
            torch.matmul(x, w.t()),
            torch.mm(x, w.t()),
            torch.bmm(y3.transpose(1, 2), y3),
            torch.addmm(b, x, w.t()),
        ]
    xt, wt, bt, y3t = tpu(x, w, b, y3)
    with torch.autocast(DEV, dtype=dtype):
        got = [
            F.linear(xt, wt, bt),
            torch.matmul(xt, wt.t()),
            torch.mm(xt, wt.t()),
            torch.bmm(y3t.transpose(1, 2), y3t),
            torch.addmm(bt, xt, wt.t()),
        ]
    for r, g in zip(ref, got, strict=True):
        assert r.dtype == dtype and g.dtype == dtype
        torch.testing.assert_close(g.cpu().float(), r.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", LOW)
def test_fp32_ops_run_in_float32(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(6, 16), torch.randn(16, 16)
    xt, wt = tpu(x, w)
    with torch.autocast(DEV, dtype=dtype):
        h = xt @ wt  # low precision
        outs = {
            "softmax": h.softmax(-1),
            "log_softmax": F.log_softmax(h, -1),
            "layer_norm": F.layer_norm(h, (16,)),
            "group_norm": F.group_norm(h.unsqueeze(-1), 4),
            "exp": torch.exp(h / 8),
            "log": torch.log(h.abs() + 1),
            "pow": torch.pow(h, 2),
            "sum": h.sum(),
            "sum_dim": h.sum(1),
            "cumsum": h.cumsum(0),
            "norm": torch.norm(h),
            "mse_loss": F.mse_loss(h, torch.zeros_like(h)),
            "nll_loss": F.nll_loss(h, torch.tensor([0, 1, 2, 3, 4, 5], device=DEV)),
            "cross_entropy": F.cross_entropy(h, torch.tensor([0, 1, 2, 3, 4, 5], device=DEV)),
            "bce_logits": F.binary_cross_entropy_with_logits(h, torch.zeros_like(h)),
        }
    assert h.dtype == dtype
    # Reference: the same low-precision product, then the fp32 op on the CPU.
    hc = h.cpu().float()
    tgt = torch.tensor([0, 1, 2, 3, 4, 5])
    refs = {
        "softmax": hc.softmax(-1),
        "log_softmax": F.log_softmax(hc, -1),
        "layer_norm": F.layer_norm(hc, (16,)),
        "group_norm": F.group_norm(hc.unsqueeze(-1), 4),
        "exp": torch.exp(hc / 8),
        "log": torch.log((hc.abs() + 1).to(dtype).float()),  # abs/add stay low precision
        "pow": torch.pow(hc, 2),
        "sum": hc.sum(),
        "sum_dim": hc.sum(1),
        "cumsum": hc.cumsum(0),
        "norm": torch.norm(hc),
        "mse_loss": F.mse_loss(hc, torch.zeros_like(hc)),
        "nll_loss": F.nll_loss(hc, tgt),
        "cross_entropy": F.cross_entropy(hc, tgt),
        "bce_logits": F.binary_cross_entropy_with_logits(hc, torch.zeros_like(hc)),
    }
    for k, v in outs.items():
        assert v.dtype == torch.float32, k
        torch.testing.assert_close(v.cpu(), refs[k], rtol=1e-4, atol=1e-4, msg=k)


def test_promote_ops_use_widest_type():
    (a32,) = tpu(torch.randn(4, 3))
    with torch.autocast(DEV, dtype=torch.bfloat16):
        a16 = a32 @ torch.eye(3, device=DEV)
        assert a16.dtype == torch.bfloat16
        assert torch.cat([a16, a32]).dtype == torch.float32
        assert torch.stack([a16, a32]).dtype == torch.float32
        assert torch.cat([a16, a16]).dtype == torch.bfloat16
        assert torch.addcmul(a32, a16, a16).dtype == torch.float32
        # index_copy needs equal dtypes; promote makes the mixed call legal.
        out = torch.index_copy(a32, 0, torch.tensor([1, 3], device=DEV), a16[:2])
        assert out.dtype == torch.float32
    ref = a32.cpu().clone()
    ref[[1, 3]] = a16[:2].cpu().float()
    torch.testing.assert_close(out.cpu(), ref)


def test_ineligible_tensors_are_left_alone():
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    at, bt = tpu(a, b)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        assert (at @ bt).dtype == torch.float64  # double is never autocast
        assert (a.float() @ b.float()).dtype == torch.float32  # CPU tensors: tpu autocast only
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=False):
        assert (at.float() @ bt.float()).dtype == torch.float32


def test_binary_cross_entropy_is_banned():
    p, t = tpu(torch.rand(4), torch.rand(4))
    with torch.autocast(DEV, dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, t)


def test_sdpa_is_lower_precision():
    q, k, v = tpu(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with torch.autocast(DEV, dtype=torch.bfloat16):
        o = F.scaled_dot_product_attention(q, k, v)
    assert o.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu())
    torch.testing.assert_close(o.cpu().float(), ref.float(), **TOL[torch.bfloat16])


# ------------------------------------------------------------------ autograd through autocast
@pytest.mark.parametrize("dtype", LOW)
def test_backward_through_autocast_matches_cpu_autocast(dtype):
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    tpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    tpu_model.load_state_dict(cpu_model.state_dict())
    tpu_model.to(DEV)
    x, target = torch.randn(5, 8), torch.randn(5, 4)

    with torch.autocast("cpu", dtype=dtype):
        out_c = cpu_model(x)
        loss_c = F.mse_loss(out_c, target)
    loss_c.backward()
    xt, tt = tpu(x, target)
    with torch.autocast(DEV, dtype=dtype):
        out_t = tpu_model(xt)
        loss_t = F.mse_loss(out_t, tt)
    loss_t.backward()

    assert out_t.dtype == dtype and loss_t.dtype == torch.float32
    torch.testing.assert_close(loss_t.cpu(), loss_c, **TOL[dtype])
    for (n, pc), pt in zip(cpu_model.named_parameters(), tpu_model.parameters(), strict=True):
        assert pt.grad.dtype == torch.float32, n  # grads land in the parameters' dtype
        torch.testing.assert_close(pt.grad.cpu(), pc.grad, **TOL[dtype], msg=n)


# ------------------------------------------------------------------ GradScaler device ops
@pytest.mark.parametrize("gdtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_non_finite_check_and_unscale_matches_cpu(gdtype):
    torch.manual_seed(0)
    grads = [torch.randn(5, 3).to(gdtype) * 1000, torch.randn(7).to(gdtype), torch.randn(2, 2, 2).to(gdtype)]
    for inject in [None, float("inf"), float("nan"), float("-inf")]:
        gs = [g.clone() for g in grads]
        if inject is not None:
            gs[1][3] = inject
        found_c, inv_c = torch.zeros(()), torch.full((), 1 / 1024.0)
        gt = [g.to(DEV) for g in gs]
        found_t, inv_t = found_c.to(DEV), inv_c.to(DEV)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found_c, inv_c)
        torch._amp_foreach_non_finite_check_and_unscale_(gt, found_t, inv_t)
        assert found_t.item() == found_c.item() == (0.0 if inject is None else 1.0)
        for c, t in zip(gs, gt, strict=True):
            assert t.dtype == gdtype
            torch.testing.assert_close(t.cpu(), c, rtol=0, atol=0, equal_nan=True)
    # Grads that are views (a flat buffer's slices, a transpose), 0-d and empty grads.
    flat = torch.randn(26).to(gdtype)
    flat[13] = float("inf")
    views_c = [flat[:12].view(3, 4), flat[12:24].view(4, 3).t(), flat[24], flat[25:25]]
    flat_t = flat.to(DEV)
    views_t = [flat_t[:12].view(3, 4), flat_t[12:24].view(4, 3).t(), flat_t[24], flat_t[25:25]]
    found_c, found_t = torch.zeros(()), torch.zeros((), device=DEV)
    torch._amp_foreach_non_finite_check_and_unscale_(views_c, found_c, torch.full((), 0.25))
    torch._amp_foreach_non_finite_check_and_unscale_(views_t, found_t, torch.full((), 0.25, device=DEV))
    assert found_t.item() == found_c.item() == 1.0
    torch.testing.assert_close(flat_t.cpu(), flat, rtol=0, atol=0)
    # found_inf is sticky: a later clean list leaves it set; an empty list is a no-op.
    found = torch.ones((), device=DEV)
    torch._amp_foreach_non_finite_check_and_unscale_([grads[0].to(DEV)], found, torch.ones((), device=DEV))
    torch._amp_foreach_non_finite_check_and_unscale_([], found, torch.ones((), device=DEV))
    assert found.item() == 1.0


def test_update_scale_matches_cpu():
    seq = [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    for growth_interval in [1, 3]:
        sc, tc = torch.full((), 1024.0), torch.zeros((), dtype=torch.int32)
        st, tt = sc.to(DEV), tc.to(DEV)
        for f in seq:
            fc = torch.full((), float(f))
            torch._amp_update_scale_(sc, tc, fc, 2.0, 0.5, growth_interval)
            r = torch._amp_update_scale_(st, tt, fc.to(DEV), 2.0, 0.5, growth_interval)
            assert r is st
            assert st.item() == sc.item() and tt.item() == tc.item(), (growth_interval, f)
    # Growth never overflows float32; a non-power-of-two factor rounds like the CPU kernel.
    for start, growth, backoff in [(3.0e38, 2.0, 0.5), (1.7, 1.1, 0.3)]:
        for f in [0.0, 1.0]:
            sc, tc = torch.full((), start), torch.zeros((), dtype=torch.int32)
            st, tt = sc.to(DEV), tc.to(DEV)
            torch._amp_update_scale_(sc, tc, torch.full((), f), growth, backoff, 1)
            torch._amp_update_scale_(st, tt, torch.full((), f, device=DEV), growth, backoff, 1)
            assert st.item() == sc.item() and tt.item() == tc.item()
            assert math.isfinite(st.item())


# ------------------------------------------------------------------ GradScaler training step
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def test_grad_scaler_float16_training_step():
    x, target = torch.randn(6, 8), torch.randn(6, 4)

    # fp32 CPU reference step, no autocast, no scaler.
    ref = _mlp()
    before = [p.detach().clone() for p in ref.parameters()]
    opt_c = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(ref(x), target).backward()
    opt_c.step()
    ref_delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(ref.parameters(), before, strict=True)])

    model = _mlp().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0**10, growth_interval=2)
    xt, tt = tpu(x, target)

    def step(inject_inf=False):
        opt.zero_grad()
        with torch.autocast(DEV, dtype=torch.float16):
            out = model(xt)
            loss = F.mse_loss(out, tt)
        assert out.dtype == torch.float16 and loss.dtype == torch.float32
        scaler.scale(loss).backward()
        if inject_inf:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    # Step 1: taken; direction matches the fp32 step; scale unchanged (growth_interval=2).
    before_t = [p.detach().cpu().clone() for p in model.parameters()]
    step()
    delta = torch.cat(
        [(p.detach().cpu() - b).flatten() for p, b in zip(model.parameters(), before_t, strict=True)]
    )
    assert F.cosine_similarity(delta, ref_delta, dim=0) > 0.999
    torch.testing.assert_close(delta, ref_delta, rtol=0.02, atol=2e-4)
    assert scaler.get_scale() == 2.0**10 and scaler._get_growth_tracker() == 1
    assert scaler._scale.device.type == DEV

    # Step 2: second consecutive good step -> scale grows.
    step()
    assert scaler.get_scale() == 2.0**11 and scaler._get_growth_tracker() == 0

    # Step 3: an inf gradient -> step skipped (parameters unchanged), scale halves.
    params = [p.detach().cpu().clone() for p in model.parameters()]
    step(inject_inf=True)
    for p, b in zip(model.parameters(), params, strict=True):
        assert torch.equal(p.detach().cpu(), b)
    assert scaler.get_scale() == 2.0**10 and scaler._get_growth_tracker() == 0

    # Step 4: training resumes.
    step()
    assert any(not torch.equal(p.detach().cpu(), b) for p, b in zip(model.parameters(), params, strict=True))
    assert scaler._get_growth_tracker() == 1
