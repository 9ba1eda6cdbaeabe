"""Eager _foreach_* ops on tpu (torch.optim's default foreach path, clip_grad_norm_): each lowered
overload runs as ONE program per call and matches PyTorch on the CPU; calls the lowering path
cannot take (empty lists, mixed devices, a 1-D scalars tensor) keep PyTorch's per-tensor loop,
never the CPU fallback."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch_tpu
from torch import nn

SHAPES = [(3, 2), (5,), (), (2, 1, 3)]


pytestmark = pytest.mark.usefixtures("no_fallback")


def _lists(
    k: int, seed: int, positive: bool = False, dtypes: list[torch.dtype] | None = None
) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ts = [torch.randn(s, generator=g) for s in SHAPES]
        if positive:
            ts = [t.abs() + 0.5 for t in ts]
        if dtypes:
            ts = [t.to(d) for t, d in zip(ts, dtypes, strict=True)]
        out.append(ts)
    return out


def _launches() -> int:
    return torch_tpu.dispatch_stats()["launches"]


def _tpu(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.to("tpu")
    if isinstance(x, list):
        return [_tpu(e) for e in x]
    return x


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol)


# (name, fn, number of tensor lists, positive inputs, extra args)
S3 = [0.5, -2.0, 1.5, 0.25]
CASES: list[tuple[str, Callable[..., object], int, bool]] = [
    ("add_.List", lambda a, b: torch._foreach_add_(a, b, alpha=0.3), 2, False),
    ("add_.Scalar", lambda a: torch._foreach_add_(a, 1.5), 1, False),
    ("add_.ScalarList", lambda a: torch._foreach_add_(a, S3), 1, False),
    ("add_.Tensor", lambda a, t: torch._foreach_add_(a, t, alpha=2.0), 1, False),
    ("add.List", lambda a, b: torch._foreach_add(a, b, alpha=-0.5), 2, False),
    ("add.Scalar", lambda a: torch._foreach_add(a, 2), 1, False),
    ("sub_.List", lambda a, b: torch._foreach_sub_(a, b), 2, False),
    ("sub.Scalar", lambda a: torch._foreach_sub(a, 0.75), 1, False),
    ("mul_.Scalar", lambda a: torch._foreach_mul_(a, 0.9), 1, False),
    ("mul_.Tensor", lambda a, t: torch._foreach_mul_(a, t), 1, False),
    ("mul_.List", lambda a, b: torch._foreach_mul_(a, b), 2, False),
    ("mul.ScalarList", lambda a: torch._foreach_mul(a, S3), 1, False),
    ("div_.ScalarList", lambda a: torch._foreach_div_(a, S3), 1, False),
    ("div_.Tensor", lambda a, t: torch._foreach_div_(a, t), 1, False),
    ("div.List", lambda a, b: torch._foreach_div(a, b), 2, True),
    ("addcmul_.Scalar", lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.1), 3, False),
    ("addcmul_.ScalarList", lambda a, b, c: torch._foreach_addcmul_(a, b, c, S3), 3, False),
    ("addcdiv_.Scalar", lambda a, b, c: torch._foreach_addcdiv_(a, b, c, value=-0.01), 3, True),
    ("addcdiv_.ScalarList", lambda a, b, c: torch._foreach_addcdiv_(a, b, c, S3), 3, True),
    ("lerp_.Scalar", lambda a, b: torch._foreach_lerp_(a, b, 0.1), 2, False),
    ("lerp_.List", lambda a, b, c: torch._foreach_lerp_(a, b, c), 3, False),
    ("sqrt", lambda a: torch._foreach_sqrt(a), 1, True),
    ("sqrt_", lambda a: torch._foreach_sqrt_(a), 1, True),
    ("rsqrt", lambda a: torch._foreach_rsqrt(a), 1, True),
    ("neg", lambda a: torch._foreach_neg(a), 1, False),
    ("reciprocal_", lambda a: torch._foreach_reciprocal_(a), 1, True),
    ("abs", lambda a: torch._foreach_abs(a), 1, False),
    ("exp", lambda a: torch._foreach_exp(a), 1, False),
    ("sign", lambda a: torch._foreach_sign(a), 1, False),
    ("pow.Scalar", lambda a: torch._foreach_pow(a, 2.0), 1, True),
    ("pow.List", lambda a, b: torch._foreach_pow(a, b), 2, True),
    ("pow.ScalarAndTensor", lambda a: torch._foreach_pow(2.0, a), 1, False),
    ("maximum_.List", lambda a, b: torch._foreach_maximum_(a, b), 2, False),
    ("minimum.List", lambda a, b: torch._foreach_minimum(a, b), 2, False),
    ("clamp_min_.Scalar", lambda a: torch._foreach_clamp_min_(a, 0.1), 1, False),
    ("clamp_max.ScalarList", lambda a: torch._foreach_clamp_max(a, S3), 1, False),
    ("copy_", lambda a, b: torch._foreach_copy_(a, b), 2, False),
    ("zero_", lambda a: torch._foreach_zero_(a), 1, False),
    ("norm.Scalar", lambda a: torch._foreach_norm(a), 1, False),
    ("norm.Scalar(ord=1)", lambda a: torch._foreach_norm(a, 1), 1, False),
    ("norm.Scalar(ord=inf)", lambda a: torch._foreach_norm(a, float("inf")), 1, False),
]


@pytest.mark.parametrize("name,fn,k,positive", CASES, ids=[c[0] for c in CASES])
def test_overload_matches_cpu_in_one_launch(
    name: str, fn: Callable[..., object], k: int, positive: bool
) -> None:
    cpu = _lists(k, seed=len(name), positive=positive)
    args: list[object] = list(cpu)
    if name.endswith(".Tensor"):
        args.append(torch.tensor(1.7))  # a 0-d tensor scalar (clip_grad_norm_'s clip_coef)
    dev = [_tpu(a) for a in args]
    if name.endswith(".Tensor"):
        dev[-1] = torch.tensor(1.7, device="tpu")
    before = _launches()
    got = fn(*dev)
    assert _launches() - before == 1, name
    want = fn(*args)
    if got is None:  # in place: compare every list (only the first is written)
        for dl, cl in zip(dev[:k], args[:k], strict=True):
            for d, c in zip(dl, cl, strict=True):  # type: ignore[call-overload]
                _close(d, c)
    else:
        for d, c in zip(got, want, strict=True):  # type: ignore[call-overload]
            assert d.device.type == "tpu" and d.dtype == c.dtype and d.shape == c.shape
            _close(d, c)


def test_mixed_dtypes_in_one_list() -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    a, b = _lists(2, seed=3, dtypes=dtypes)
    da, db = _tpu(a), _tpu(b)
    torch._foreach_lerp_(da, db, 0.25)
    torch._foreach_lerp_(a, b, 0.25)
    out = torch._foreach_add(da, 1.25)
    want = torch._foreach_add(a, 1.25)
    for d, c in zip(list(out) + da, list(want) + a, strict=True):
        assert d.dtype == c.dtype
        _close(d, c)


def test_scalar_list_values_do_not_recompile() -> None:
    (a,) = _lists(1, seed=4)
    da = _tpu(a)
    torch._foreach_div_(da, [1.5, 2.5, 3.5, 4.5])
    torch._foreach_div_(a, [1.5, 2.5, 3.5, 4.5])
    torch_tpu.reset_cache_stats()
    torch._foreach_div_(da, [0.5, 0.25, 8.0, -1.0])
    torch._foreach_div_(a, [0.5, 0.25, 8.0, -1.0])
    st = torch_tpu.cache_stats()
    assert st["misses"] == 0 and st["disk_hits"] == 0 and st["op_hits"] == 1
    for d, c in zip(da, a, strict=True):
        _close(d, c)


def test_unlowered_calls_keep_the_per_tensor_loop() -> None:
    # empty list: PyTorch's own error, as on the CPU
    with pytest.raises(RuntimeError, match="at least one tensor"):
        torch._foreach_add_([], 1.0)
    # a 1-D scalars tensor (one scalar per element): PyTorch's loop, one launch per element
    a, b, c = _lists(3, seed=5, positive=True)
    da, db, dc = _tpu(a), _tpu(b), _tpu(c)
    s = torch.tensor([0.1, -0.2, 0.3, 0.4], dtype=torch.float64)
    torch._foreach_addcdiv_(da, db, dc, s)
    torch._foreach_addcdiv_(a, b, c, s)
    for d, e in zip(da, a, strict=True):
        _close(d, e)
    # a list mixing host and tpu tensors: per-tensor ops on each tensor's own device
    mixed = [a[0].clone(), da[1]]
    torch._foreach_mul_(mixed, 3.0)
    _close(mixed[0], a[0] * 3.0)
    _close(mixed[1], a[1] * 3.0)
    assert mixed[0].device.type == "cpu"


def _model(dev: str) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(7)
    return [nn.Parameter(torch.randn(s, generator=g).to(dev)) for s in [(4, 3), (3,), (2, 2, 2), (5,)]]


OPTIMS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, dampening=0.0),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=0.05, amsgrad=True, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05),
    "adamw_tensor_lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.05)),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.05, amsgrad=True),
    # capturable: 0-d step tensors on the device, _foreach_pow(beta, steps), _foreach_neg_, ...
    "adam_capturable_amsgrad": lambda p: torch.optim.Adam(
        p, lr=0.05, amsgrad=True, weight_decay=0.1, capturable=p[0].device.type == "tpu"
    ),
    "adamw_capturable_tensor_lr": lambda p: torch.optim.AdamW(
        p, lr=torch.tensor(0.05, device=p[0].device), capturable=p[0].device.type == "tpu"
    ),
}


@pytest.mark.parametrize("name", list(OPTIMS))
def test_optimizer_foreach_matches_cpu(name: str) -> None:
    results = []
    for dev in ("cpu", "tpu"):
        ps = _model(dev)
        opt = OPTIMS[name](ps)
        for step in range(5):
            g = torch.Generator().manual_seed(100 + step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dev)
            opt.step()
            if name.startswith("adam"):
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * 0.9  # a scheduler: new values, same programs
        results.append((ps, opt))
    (cps, copt), (tps, topt) = results
    for c, t in zip(cps, tps, strict=True):
        _close(t.detach(), c.detach())
        for key, cv in copt.state[c].items():
            tv = topt.state[t][key]
            if isinstance(cv, torch.Tensor):
                _close(tv, cv)


def test_clip_grad_norm_matches_cpu() -> None:
    cps, tps = _model("cpu"), _model("tpu")
    g = torch.Generator().manual_seed(9)
    for c, t in zip(cps, tps, strict=True):
        c.grad = torch.randn(c.shape, generator=g) * 3
        t.grad = c.grad.to("tpu")
    before = _launches()
    tn = torch.nn.utils.clip_grad_norm_(tps, 0.5)
    launches = _launches() - before
    cn = torch.nn.utils.clip_grad_norm_(cps, 0.5)
    _close(tn, cn)
    for c, t in zip(cps, tps, strict=True):
        _close(t.grad, c.grad)
    # _foreach_norm and the _foreach_mul_ scaling are one launch each: the count does not grow with N
    many = [nn.Parameter(torch.randn(2, device="tpu")) for _ in range(3 * len(tps))]
    for p in many:
        p.grad = torch.ones_like(p)
    before = _launches()
    torch.nn.utils.clip_grad_norm_(many, 0.5)
    assert _launches() - before == launches


def _adamw_step_launches(n: int, capturable: bool = False) -> int:
    ps = [nn.Parameter(torch.randn(3, device="tpu")) for _ in range(n)]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(ps, lr=0.01, capturable=capturable)
    opt.step()  # state creation
    before = _launches()
    opt.step()
    return _launches() - before


def test_adamw_foreach_step_launches_do_not_grow_with_tensor_count() -> None:
    small, large = _adamw_step_launches(3), _adamw_step_launches(24)
    assert small == large, (small, large)
    assert large < 12, large
    small, large = _adamw_step_launches(3, capturable=True), _adamw_step_launches(24, capturable=True)
    assert small == large, (small, large)
    assert large < 24, large


def test_in_place_through_views() -> None:
    base = torch.randn(4, 3)
    dbase = base.to("tpu")
    views, dviews = [base[:, 1], base.t(), base[2:]], [dbase[:, 1], dbase.t(), dbase[2:]]
    torch._foreach_mul_(dviews[:1], 3.0)
    torch._foreach_mul_(views[:1], 3.0)
    torch._foreach_add_(dviews[1:], [0.5, -1.0])
    torch._foreach_add_(views[1:], [0.5, -1.0])
    _close(dbase, base)


def test_in_place_with_an_operand_aliasing_another_element() -> None:
    # element 1 reads element 0 after PyTorch's loop wrote it: the lowered path must not run
    (a,) = _lists(1, seed=11)
    a = [t.reshape(-1)[:1].clone() for t in a]
    da = _tpu(a)
    torch._foreach_add_(da, [da[1], da[0], da[3], da[2]])
    torch._foreach_add_(a, [a[1], a[0], a[3], a[2]])
    for d, c in zip(da, a, strict=True):
        _close(d, c)


@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw_amsgrad"])
def test_optimizer_foreach_in_fused_eager(name: str) -> None:
    from torch_tpu import EagerMode, set_eager_mode

    results = []
    for dev in ("cpu", "tpu"):
        ps = _model(dev)
        opt = OPTIMS[name](ps)
        with set_eager_mode(EagerMode.DEFER_AND_FUSE):
            for step in range(3):
                g = torch.Generator().manual_seed(200 + step)
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=g).to(dev)
                opt.step()
            results.append([p.detach().cpu() for p in ps])
    for t, c in zip(results[1], results[0], strict=True):
        _close(t, c)
