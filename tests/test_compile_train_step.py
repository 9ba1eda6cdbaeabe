"""One program per training step (torch.tpu.optimizers.SingleTraceTrainer): a tiny Llama's 20-step
loss curve equals eager's, with one launch per step after the first."""

from __future__ import annotations

import copy

import pytest
import torch
import torch_tpu
import transformers


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).train()


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


_OPTS = {
    "adamw_fused": (torch.optim.AdamW, {"lr": 3e-3, "fused": True}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 3e-3, "foreach": True}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


@pytest.mark.parametrize("name", list(_OPTS))
def test_llama_20_steps_one_program_each(name: str) -> None:
    cls, kwargs = _OPTS[name]
    ref = _llama()
    model = copy.deepcopy(ref).to("tpu")
    opt_ref = cls(ref.parameters(), **{k: v for k, v in kwargs.items() if k != "fused"})
    trainer = torch.tpu.optimizers.SingleTraceTrainer(model, cls(model.parameters(), **kwargs), _loss)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 12), generator=gen) for _ in range(4)]
    ref_losses, losses, launches = [], [], []
    for step in range(20):
        ids = batches[step % 4]
        loss = _loss(ref, ids)
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ref_losses.append(float(loss))
        before = torch_tpu.dispatch_stats()["launches"]
        losses.append(trainer(ids.to("tpu")))
        launches.append(torch_tpu.dispatch_stats()["launches"] - before)
    got = torch.stack(losses).cpu()
    torch.testing.assert_close(got, torch.tensor(ref_losses), atol=2e-5, rtol=2e-5)
    assert got[-4:].mean() < got[:4].mean()  # it trains
    assert launches[2:] == [1] * 18, launches  # one program per step (after state creation)
    assert trainer.programs_built == (2 if name == "sgd_momentum" else 1)
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), atol=1e-4, rtol=1e-4)
    state = trainer.optimizer.state_dict()["state"][0]
    assert ("exp_avg" in state and float(state["step"]) == 20) or "momentum_buffer" in state


def test_lr_change_does_not_retrace_and_bad_optimizer_is_refused() -> None:
    model = torch.nn.Linear(4, 2).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = torch.tpu.optimizers.SingleTraceTrainer(model, opt, lambda m, x: m(x).square().mean())
    x = torch.randn(3, 4, device="tpu")
    trainer(x)
    w = model.weight.detach().cpu().clone()
    opt.param_groups[0]["lr"] = 0.0  # a scheduler's change: an operand, not a new program
    trainer(x)
    assert trainer.programs_built == 1
    torch.testing.assert_close(model.weight.detach().cpu(), w * (1 - 0.0), atol=0, rtol=0)
    with pytest.raises(TypeError, match="SGD, Adam and AdamW"):
        torch.tpu.optimizers.SingleTraceTrainer(model, torch.optim.RMSprop(model.parameters()), lambda m, x: x)
