"""Autograd features on tpu vs the CPU: torch.autograd.grad, double backward, retain_graph,
gradient accumulation, and activation checkpointing with dropout (the device RNG state is saved
and restored so the recomputed forward draws the same mask)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_gen = torch.Generator().manual_seed(99)
X = torch.randn(4, 6, generator=_gen)
W = torch.randn(6, 5, generator=_gen)
X2 = torch.randn(4, 6, generator=_gen)


pytestmark = pytest.mark.usefixtures("no_fallback")


def _leaves(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return X.to(device, copy=True).requires_grad_(), W.to(device, copy=True).requires_grad_()


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) ** 2).sum() + (x.sigmoid() * 0.5).sum()


def _close(tpu: torch.Tensor, cpu: torch.Tensor, tol: float = 1e-5) -> None:
    assert tpu.device.type == "tpu"
    torch.testing.assert_close(tpu.cpu(), cpu, atol=tol, rtol=tol)


def test_autograd_grad() -> None:
    res = {}
    for d in ("cpu", "tpu"):
        x, w = _leaves(d)
        res[d] = torch.autograd.grad(_f(x, w), [x, w])
        assert x.grad is None and w.grad is None  # grad() does not accumulate
    for a, b in zip(res["cpu"], res["tpu"], strict=True):
        _close(b, a)


def test_double_backward() -> None:
    """Gradient of a function of the gradient (create_graph=True), e.g. a gradient penalty."""
    res = {}
    for d in ("cpu", "tpu"):
        x, w = _leaves(d)
        (gx,) = torch.autograd.grad(_f(x, w), [x], create_graph=True)
        penalty = (gx**2).sum()
        res[d] = torch.autograd.grad(penalty, [x, w])
    for a, b in zip(res["cpu"], res["tpu"], strict=True):
        _close(b, a, 1e-4)


def test_retain_graph_backward_twice() -> None:
    res = {}
    for d in ("cpu", "tpu"):
        x, w = _leaves(d)
        y = _f(x, w)
        y.backward(retain_graph=True)
        first = w.grad.clone()
        y.backward()  # the same graph again: gradients accumulate
        res[d] = (first, x.grad, w.grad)
    for a, b in zip(res["cpu"], res["tpu"], strict=True):
        _close(b, a)
    torch.testing.assert_close(res["tpu"][2].cpu(), 2 * res["tpu"][0].cpu())


def test_gradient_accumulation_two_micro_batches() -> None:
    res = {}
    for d in ("cpu", "tpu"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2)).to(d)
        for xb in (X, X2):
            (m(xb.to(d)).pow(2).mean() / 2).backward()
        accumulated = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        full = torch.cat([X, X2]).to(d)
        m(full).pow(2).mean().backward()
        res[d] = (accumulated, [p.grad for p in m.parameters()])
    for a, b in zip(res["cpu"][0], res["tpu"][0], strict=True):
        _close(b, a)
    for a, b in zip(res["tpu"][0], res["tpu"][1], strict=True):  # accumulation == one big batch
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-6, rtol=1e-5)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x))) * x


def _grads_ckpt(mode: str, preserve_rng_state: bool = True) -> list[torch.Tensor]:
    torch.manual_seed(0)
    blk = _Block().to("tpu")
    x = X.to("tpu", copy=True).requires_grad_()
    torch.manual_seed(1234)
    if mode == "none":
        y = blk(blk(x))
    else:
        y = checkpoint(blk, x, use_reentrant=mode == "reentrant", preserve_rng_state=preserve_rng_state)
        y = checkpoint(blk, y, use_reentrant=mode == "reentrant", preserve_rng_state=preserve_rng_state)
    y.pow(2).sum().backward()  # .backward(): reentrant checkpoint does not support autograd.grad
    return [x.grad.cpu(), blk.lin.weight.grad.cpu(), blk.lin.bias.grad.cpu()]


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpoint_with_dropout_matches(mode: str) -> None:
    ref = _grads_ckpt("none")
    got = _grads_ckpt(mode)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    # The check is meaningful: without restoring the device RNG the recomputed masks differ.
    unrestored = _grads_ckpt(mode, preserve_rng_state=False)
    assert any(not torch.equal(a, b) for a, b in zip(ref, unrestored, strict=True))


def test_rng_state_round_trip_and_fork_rng() -> None:
    x = torch.ones(64, device="tpu")
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.nn.functional.dropout(x, 0.5)
    torch.tpu.set_rng_state(state)
    b = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(a.cpu(), b.cpu())
    c = torch.nn.functional.dropout(x, 0.5)
    assert not torch.equal(b.cpu(), c.cpu())
    before = torch.tpu.get_rng_state()
    with torch.random.fork_rng(device_type="tpu"):
        torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(torch.tpu.get_rng_state(), before)


def test_hf_llama_gradient_checkpointing_with_attention_dropout() -> None:
    """Hugging Face activation checkpointing (non-reentrant) on a tiny Llama with attention dropout:
    the recomputed layers draw the same dropout masks, so the gradients are those without
    checkpointing; without restoring the RNG they are not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attention_dropout=0.3, use_cache=False)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0)).to("tpu")

    def grads(ckpt_kwargs: dict | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to("tpu")
        m.train()
        if ckpt_kwargs is not None:
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
        torch.manual_seed(5)
        m(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.cpu() for p in m.parameters()]

    ref = grads(None)
    got = grads({"use_reentrant": False})
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    unrestored = grads({"use_reentrant": False, "preserve_rng_state": False})
    assert any(not torch.equal(a, b) for a, b in zip(ref, unrestored, strict=True))
