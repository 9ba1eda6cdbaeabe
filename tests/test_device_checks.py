"""Device-side error checks: bad indices raise like PyTorch CPU (same exception type), at the next
host read in strict / fused eager and compiled graphs, at the op in debug eager; in-range calls
(negative indices where PyTorch wraps them) equal CPU; the process keeps working afterwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch_tpu import _C, EagerMode, set_eager_mode

T = torch.Tensor
Case = Callable[[T, T], T]  # (x of shape (3, 2), index) -> result

# op -> (function of x and idx, a good idx, a bad idx); the CPU kernel decides the exception type.
CASES: dict[str, tuple[Case, list, list]] = {
    "getitem": (lambda x, i: x[i], [2, -1, -3], [3]),
    "getitem_neg": (lambda x, i: x[i], [-1], [-4]),
    "index_select": (lambda x, i: x.index_select(0, i), [2, 0], [3]),
    "index_select_neg": (lambda x, i: x.index_select(0, i), [0], [-1]),
    "gather": (lambda x, i: x.gather(0, i.view(1, -1).expand(1, 2)), [2], [-1]),
    "embedding": (lambda x, i: F.embedding(i, x), [1, 2], [3]),
    "index_put": (lambda x, i: x.clone().index_put_((i,), torch.tensor(7.0, device=x.device)), [-1], [5]),
    "setitem": (lambda x, i: _setitem(x, i), [1], [-4]),
    "scatter": (lambda x, i: x.clone().scatter_(0, i.view(1, -1).expand(1, 2), 1.0), [1], [3]),
    "scatter_add": (lambda x, i: x.clone().scatter_add_(0, i.view(1, -1).expand(1, 2), x[:1]), [1], [-1]),
    "scatter_reduce": (
        lambda x, i: x.clone().scatter_reduce_(0, i.view(1, -1).expand(1, 2), x[:1], "amax"), [2], [3]),
    "take": (lambda x, i: x.take(i), [-6, 5], [6]),
    "put": (lambda x, i: x.clone().put_(i, torch.ones(i.numel(), device=x.device)), [-1], [-7]),
    "index_add": (lambda x, i: x.clone().index_add_(0, i, x[: i.numel()]), [2], [-1]),
    "index_copy": (lambda x, i: x.clone().index_copy_(0, i, x[: i.numel()]), [0], [3]),
    "index_fill": (lambda x, i: x.clone().index_fill_(0, i, 5.0), [-1], [3]),
    # targets of x's 3 rows over 2 classes; -100 (ignore_index) is fine
    "cross_entropy": (lambda x, i: F.cross_entropy(x, i), [1, -100, 0], [0, 2, 1]),
    "nll_loss": (lambda x, i: F.nll_loss(x.log_softmax(1), i, reduction="none"), [0, 1, 1], [-1, 0, 0]),
    # one_hot's composite scatters (checked) on tpu; CPU raises RuntimeError too
    "one_hot": (lambda x, i: F.one_hot(i, 3), [2, 0], [3]),
    "max_unpool2d": (lambda x, i: F.max_unpool2d(x.view(1, 1, 3, 2)[:, :, :2], i.view(1, 1, 2, 2), 2), [0, 1, 2, 15],
                     [0, 1, 2, 16]),
    "multinomial": (lambda x, i: torch.multinomial(i.to(x.dtype), 1) * 0, [0.5, 1.0], [0.5, -0.1]),
    "multinomial_sum": (lambda x, i: torch.multinomial(i.to(x.dtype), 1) * 0, [0.0, 1.0], [0.0, 0.0]),
    # integer division by zero: RuntimeError("ZeroDivisionError") on the CPU; float division is unchecked
    "floor_divide": (lambda x, i: _ints(i) // i, [2, -3], [2, 0]),
    "remainder": (lambda x, i: _ints(i) % i, [2, -3], [0, 1]),
    "div_trunc": (lambda x, i: _ints(i).div(i, rounding_mode="trunc"), [2, -3], [0, 0]),
    "fmod": (lambda x, i: torch.fmod(_ints(i), i), [2, -3], [1, 0]),
}


def _ints(i: T) -> T:
    return torch.tensor([7, -7], device=i.device)


def _setitem(x: T, i: T) -> T:
    y = x.clone()
    y[i] = 9.0
    return y


def _cpu_error(name: str) -> type[BaseException]:
    fn, _, bad = CASES[name]
    with pytest.raises((IndexError, RuntimeError)) as e:
        fn(torch.arange(6.0).reshape(3, 2), torch.tensor(bad))
    return e.type


def _x(dev: str) -> T:
    return torch.arange(6.0, device=dev).reshape(3, 2)


@pytest.mark.parametrize("mode", ["strict", "debug", "fused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_eager(name: str, mode: str) -> None:
    fn, good, bad = CASES[name]
    exc = _cpu_error(name)
    eager = {"strict": EagerMode.DEFER_NEVER, "debug": EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
             "fused": EagerMode.DEFER_AND_FUSE}[mode]
    with set_eager_mode(eager):
        got = fn(_x("tpu"), torch.tensor(good, device="tpu")).cpu()
        torch.testing.assert_close(got, fn(_x("cpu"), torch.tensor(good)))
        with pytest.raises(exc) as e:
            r = fn(_x("tpu"), torch.tensor(bad, device="tpu"))  # debug eager raises here
            r.cpu()  # others: at the next host read
        assert e.type is exc  # not a subclass: IndexError vs RuntimeError as on CPU
        assert "device-side check" in str(e.value) and "test_device_checks.py" in str(e.value)
        # The process keeps working, and the error was consumed.
        assert _x("tpu").sum().item() == 15.0


@pytest.mark.parametrize(
    "name", ["getitem", "gather", "embedding", "index_put", "index_select", "take", "cross_entropy", "index_copy"]
)
def test_compiled(name: str) -> None:
    fn, good, bad = CASES[name]
    exc = _cpu_error(name)
    torch._dynamo.reset()
    cfn = torch.compile(lambda x, i: fn(x, i) * 2, backend="tpu", dynamic=False)
    got = cfn(_x("tpu"), torch.tensor(good, device="tpu")).cpu()
    torch.testing.assert_close(got, fn(_x("cpu"), torch.tensor(good)) * 2)
    r = cfn(_x("tpu"), torch.tensor(bad, device="tpu"))
    with pytest.raises(exc, match="device-side check .* in graph"):
        torch.tpu.synchronize()
    del r
    assert _x("tpu").sum().item() == 15.0


def test_error_names_line_and_off_switch() -> None:
    x = _x("tpu")
    y = x[torch.tensor([10], device="tpu")]  # the line named below
    line = test_error_names_line_and_off_switch.__code__.co_firstlineno + 2
    with pytest.raises(IndexError, match=rf"aten::index\.Tensor, launched at .*test_device_checks.py:{line}\)"):
        print(y)
    _C._set_device_checks(False)
    try:  # checks off: the old clamping behaviour, no error
        assert x[torch.tensor([10], device="tpu")].cpu().tolist() == [[4.0, 5.0]]
    finally:
        _C._set_device_checks(True)
    with pytest.raises(IndexError):
        x[torch.tensor([10], device="tpu")].cpu()


def test_first_error_wins_and_item_raises() -> None:
    x = _x("tpu")
    a = x.gather(0, torch.tensor([[5, 0]], device="tpu"))  # RuntimeError on CPU
    b = F.embedding(torch.tensor([7], device="tpu"), x)  # IndexError on CPU
    with pytest.raises(RuntimeError, match="aten::gather"):
        b.sum().item()
    del a
    assert x.sum().item() == 15.0


def test_failed_launch_is_named_among_many() -> None:
    # One status per device counts the checked launches that passed: the first failure names its
    # own op and line, not a neighbour's; a later failure of another op is not reported.
    x = _x("tpu")
    good, bad = torch.tensor([0, 2], device="tpu"), torch.tensor([1, 9], device="tpu")
    first = test_failed_launch_is_named_among_many.__code__.co_firstlineno
    with set_eager_mode(EagerMode.DEFER_NEVER):
        for _ in range(3):
            x.index_select(0, good)
            F.embedding(good, x)
        F.embedding(bad, x)  # first + 10: the first failure
        x.index_select(0, bad)
        with pytest.raises(IndexError, match=rf"aten::embedding, launched at .*test_device_checks.py:{first + 10}\)"):
            torch.tpu.synchronize()
        # A long run without host reads reads the status every 4096 checked launches, so the
        # error surfaces at a later op, still naming the failed one.
        with pytest.raises(IndexError, match=rf"launched at .*test_device_checks.py:{first + 18}\)"):
            for i in range(4200):
                x.index_select(0, bad if i == 5 else good)  # first + 18
        assert x.index_select(0, good).sum().item() == 10.0


def test_one_status_read_per_sync() -> None:
    # Checked launches add to one status buffer per device: a host read reads it once, not once
    # per checked op, and a read with no checked launch since the last one reads nothing.
    x = _x("tpu")
    i = torch.tensor([2, 0], device="tpu")
    with set_eager_mode(EagerMode.DEFER_NEVER):
        torch.tpu.synchronize()
        s0 = _C._device_check_stats()
        for _ in range(5):
            y = x.index_select(0, i)
        torch.tpu.synchronize()
        torch.tpu.synchronize()
        s1 = _C._device_check_stats()
    assert s1["checked_launches"] - s0["checked_launches"] == 5
    assert s1["status_reads"] - s0["status_reads"] == 1
    torch.testing.assert_close(y.cpu(), _x("cpu").index_select(0, torch.tensor([2, 0])))


def test_integer_value_errors_like_cpu() -> None:
    """Python-scalar divisors and exponents: ZeroDivisionError and negative integer powers raise like
    the CPU, also when `t ** -3` is a dispatch-cache hit after `t ** 3` (the scalar's value is no part
    of the signature); float division by zero and a tensor exponent do not raise."""
    x = torch.tensor([3, -4])
    calls = [lambda t: t // 0, lambda t: t % 0, lambda t: t ** 3, lambda t: t ** -3, lambda t: t ** -1,
             lambda t: t // 5, lambda t: t.float() / 0, lambda t: t ** torch.tensor([-1, 2], device=t.device)]
    for call in calls:
        try:
            want = call(x)
        except RuntimeError as e:
            with pytest.raises(RuntimeError, match=str(e)):
                call(x.to("tpu")).cpu()
            continue
        torch.testing.assert_close(call(x.to("tpu")).cpu(), want)
    assert x.to("tpu").sum().item() == -1


def test_float_division_is_not_device_checked() -> None:
    """Only integer results carry the division checks: float //, %, fmod and ** launch unchecked."""
    x = torch.tensor([3.0, -4.0], device="tpu")
    with set_eager_mode(EagerMode.DEFER_NEVER):
        torch.tpu.synchronize()
        s0 = _C._device_check_stats()
        for _ in range(2):
            y = (x // 0.5) + (x % 0.7) + torch.fmod(x, x) + x ** 3 + x.div(x, rounding_mode="floor")
        torch.tpu.synchronize()
        s1 = _C._device_check_stats()
        z = torch.tensor([3, -4], device="tpu") // torch.tensor([2, 2], device="tpu")
        torch.tpu.synchronize()
        s2 = _C._device_check_stats()
    assert s1["checked_launches"] == s0["checked_launches"]
    assert s2["checked_launches"] == s1["checked_launches"] + 1
    assert y.isnan().sum().item() == 0 and z.tolist() == [1, -2]
