"""The typed (unboxed) kernels of the hottest ops (csrc/aten/unboxed_kernels.h) serve dispatch-cache
hits over borrowed arguments and box everything else. They must behave exactly like the boxed
kernel: same results, same returned objects, same dispatch-cache traffic (one signature, one plan),
same errors, autograd and version counters; each call below runs with the typed fast path on and off
in the same process and is compared with PyTorch on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch_tpu
from torch_tpu import EagerMode, set_eager_mode


def _stats() -> dict[str, int]:
    served, boxed, registered = torch.ops.torch_tpu._unboxed_stats()
    cache = torch_tpu._C._dispatch_cache_stats()
    return {"served": served, "boxed": boxed, "registered": registered,
            "hits": int(cache["hits"]), "remembered": int(cache["remembered"])}


def _delta(before: dict[str, int]) -> dict[str, int]:
    after = _stats()
    return {k: after[k] - before[k] for k in ("served", "boxed", "hits", "remembered")}


@pytest.fixture
def fast_path() -> Iterator[Callable[[bool], None]]:
    yield lambda on: torch.ops.torch_tpu._set_unboxed_fast_path(on)
    torch.ops.torch_tpu._set_unboxed_fast_path(True)


def _args(device: str, k: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(k)
    a = torch.randn(3, 4, generator=g)
    return {
        "a": a.to(device), "b": torch.randn(3, 4, generator=g).to(device),
        "row": torch.randn(4, generator=g).to(device), "m": torch.randn(4, 5, generator=g).to(device),
        "i": torch.arange(12, dtype=torch.int32).reshape(3, 4).to(device),
        "mask": (a > 0).to(device), "s0": torch.tensor(1.5 + k),  # a 0-d CPU tensor operand
        "out": torch.empty(0, device=device),  # out= resizes it
        "idx": torch.tensor([[2, 0], [1, 2]]).to(device),
    }


# Each case: a call (out-of-place, Scalar overload, in-place, out=, promotion, broadcasting, a 0-d
# host operand, where/comparisons, reductions, softmax, matmuls), and its tpu/CPU results compared.
CASES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "add_alpha": lambda t: torch.add(t["a"], t["b"], alpha=2),
    "add_scalar": lambda t: t["a"] + 1,
    "sub_broadcast": lambda t: t["a"] - t["row"],
    "rsub": lambda t: 2 - t["a"],
    "mul_int_float": lambda t: t["i"] * t["a"],
    "mul_host_0d": lambda t: t["a"] * t["s0"],
    "div_mode": lambda t: torch.div(t["i"], 3, rounding_mode="floor"),
    "div_true": lambda t: t["i"] / 4,
    "pow": lambda t: t["a"].abs() ** 1.5,
    "maximum": lambda t: torch.maximum(t["a"], t["b"]),
    "compare": lambda t: (t["a"] > t["b"], t["a"] <= 0.25, t["i"] == 5, t["a"] != t["row"]),
    "where": lambda t: torch.where(t["mask"], t["a"], t["b"]),
    "masked_fill": lambda t: t["a"].masked_fill(t["mask"], -1.0),
    "unary": lambda t: (torch.exp(t["a"]), torch.tanh(t["a"]), torch.sigmoid(t["a"]), torch.relu(t["a"]),
                        torch.nn.functional.gelu(t["a"], approximate="tanh"), torch.nn.functional.silu(t["a"]),
                        torch.rsqrt(t["a"].abs() + 1), -t["a"]),
    "clamp": lambda t: (t["a"].clamp(-0.5, 0.5), t["a"].clamp(min=0.0), t["a"].clamp_max(0.1)),
    "reduce": lambda t: (t["a"].sum(1), t["a"].mean(0, keepdim=True), torch.softmax(t["a"], -1),
                         torch.log_softmax(t["a"], 0)),
    "matmul": lambda t: (t["a"] @ t["m"], torch.addmm(t["row"][:1], t["a"], t["m"][:, :1])),
    "inplace": lambda t: (t["a"].mul_(2).add_(t["b"], alpha=0.5).sub_(1).div_(3), t["a"]),
    "inplace_view": lambda t: (t["b"][1].add_(10), t["b"]),
    "out": lambda t: (torch.add(t["a"], t["b"], out=t["out"]), t["out"]),
    "fill_zero": lambda t: (t["a"].fill_(3.0), t["b"].zero_()),
    "embedding_gather": lambda t: (torch.nn.functional.embedding(t["idx"], t["a"]), t["a"].index_select(1, t["idx"][0]),
                                   torch.cat([t["a"], t["b"]], 1), t["a"].cumsum(0), t["a"].amax(1), t["a"].argmax(0)),
    "misc_unary_binary": lambda t: (torch.log1p(t["a"].abs()), torch.floor(t["a"]), torch.sign(t["a"]),
                                    torch.logical_and(t["mask"], t["a"] > 0.5), t["i"] & 6, t["i"] % 5,
                                    torch.remainder(t["a"], t["b"].abs() + 0.5)),
}


def _same(got: Any, exp: Any) -> None:
    if isinstance(exp, tuple):
        for g, e in zip(got, exp, strict=True):
            _same(g, e)
        return
    assert got.device.type == "tpu" and got.dtype == exp.dtype and got.shape == exp.shape
    assert got.stride() == exp.stride()
    torch.testing.assert_close(got.cpu(), exp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
def test_typed_kernels_match_the_boxed_path_and_cpu(mode: EagerMode, fast_path: Callable[[bool], None]) -> None:
    assert _stats()["registered"] > 50
    with set_eager_mode(mode):
        for k, (name, case) in enumerate(CASES.items()):
            fast_path(False)
            case(_args("tpu", k))  # the boxed kernel remembers the signatures
            traffic: dict[bool, list[dict[str, int]]] = {True: [], False: []}
            for on in (True, False, True, False):
                fast_path(on)
                t, c = _args("tpu", k), _args("cpu", k)  # fresh storages and values, same signatures
                before = _stats()
                got = case(t)
                delta = _delta(before)
                _same(got, case(c))
                if name in ("inplace", "out"):  # the argument itself is returned
                    assert got[0] is got[1]
                assert (delta["served"] > 0) == on and (delta["boxed"] == 0 or not on), (name, on, delta)
                traffic[on].append({x: delta[x] for x in ("hits", "remembered")})
            # One cache for both paths: the same hits, nothing new remembered, typed or boxed.
            assert traffic[True] == traffic[False], (name, traffic)
            assert traffic[True][0]["hits"] > 0 and traffic[True][0]["remembered"] == 0, (name, traffic)


def test_boxed_calls_fill_the_cache_the_typed_kernel_serves(fast_path: Callable[[bool], None]) -> None:
    x, y = torch.randn(7, 3), torch.randn(7, 3)
    fast_path(False)
    xt, yt = x.to("tpu"), y.to("tpu")
    torch.mul(xt, yt)  # remembered by the boxed kernel
    fast_path(True)
    before = _stats()
    assert torch.equal(torch.mul(xt, yt).cpu(), x * y)
    assert _delta(before) == {"served": 1, "boxed": 0, "hits": 1, "remembered": 0}


def test_autograd_and_version_counters_through_typed_kernels() -> None:
    xc = torch.linspace(-2, 2, 12).reshape(3, 4).requires_grad_()
    xt = xc.detach().to("tpu").requires_grad_()
    grads = []
    for x in (xt, xc, xt):
        x.grad = None
        for _ in range(2):
            y = (torch.sigmoid(x) * x + x.exp() / 3).sum()
            y.backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[2], grads[1])
    a = torch.zeros(4, device="tpu")
    v = a._version
    for _ in range(3):
        a.add_(1)
    assert a._version == v + 3 and torch.equal(a.cpu(), torch.full((4,), 3.0))
    leaf = torch.ones(2, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        leaf.mul_(2)


BAD_CALLS: tuple[Callable[[torch.Tensor, torch.Tensor], Any], ...] = (
    lambda a, b: a + b,
    lambda a, b: a.add_(torch.ones(2, 3, device="tpu")),
    lambda a, b: torch.add(a, b, out=torch.empty(3, device="tpu")),
)


def test_errors_are_the_boxed_paths(fast_path: Callable[[bool], None]) -> None:
    messages = []
    for on in (True, False):
        fast_path(on)
        a, b = torch.ones(3, device="tpu"), torch.ones(4, device="tpu")
        for bad in BAD_CALLS:
            with pytest.raises(RuntimeError) as err:
                bad(a, b)
            messages.append(str(err.value))
        assert torch.equal((a + 1).cpu(), torch.full((3,), 2.0))  # still usable
    assert messages[:3] == messages[3:]


def test_calls_reading_mark_dynamic_storages_take_the_boxed_path() -> None:
    x, other = torch.arange(5.0, device="tpu"), torch.arange(3.0, device="tpu")
    for _ in range(2):  # remembered signatures
        y = x * 2
        z = other * 2
    torch_tpu.mark_dynamic(x, 0, max=16)
    before = _stats()
    got = x * 2
    assert torch.equal(got.cpu(), torch.arange(5.0) * 2)
    delta = _delta(before)
    assert delta["served"] == 0 and delta["boxed"] >= 1, delta
    before = _stats()
    assert torch.equal((other * 2).cpu(), torch.arange(3.0) * 2)  # unmarked: still served
    assert _delta(before)["served"] == 1
    assert torch.equal(y.cpu(), torch.arange(5.0) * 2) and torch.equal(z.cpu(), torch.arange(3.0) * 2)
