"""Moving modules to/from tpu keeps Parameter objects (weight tying, optimizers built before)."""

from __future__ import annotations

import weakref

import torch


def _tied_pair() -> torch.nn.Sequential:
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.weight = a.weight
    return torch.nn.Sequential(a, b)


def test_to_tpu_keeps_tied_weights_and_identity() -> None:
    m = _tied_pair()
    w = m[0].weight
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m.to("tpu")
    assert m[0].weight is m[1].weight is w and w.device.type == "tpu"
    x = torch.randn(3, 4)
    ref = _tied_pair()
    ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    ref[1].weight = ref[0].weight
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for model, o, data in ((m, opt, x.to("tpu")), (ref, ref_opt, x)):
        model(data).square().sum().backward()
        o.step()
    # The optimizer created before the move updates the moved (shared) parameter.
    torch.testing.assert_close(m[0].weight.cpu(), ref[0].weight, rtol=1e-6, atol=1e-6)
    assert m[1].weight is m[0].weight
    m.cpu()
    assert m[0].weight is m[1].weight is w and w.device.type == "cpu"
    m.tpu()
    assert m[0].weight is m[1].weight and w.device.type == "tpu"
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_weakref_on_parameter_still_moves_and_reties() -> None:
    m = _tied_pair()
    keep = weakref.ref(m[0].weight)  # swap_tensors refuses tensors with weakrefs
    m.to("tpu")
    assert keep is not None
    assert m[0].weight is m[1].weight and m[0].weight.device.type == "tpu"


def test_gpt2_lm_head_stays_tied() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
    m.to("tpu")
    assert m.lm_head.weight is m.transformer.wte.weight


def test_cpu_only_moves_unchanged() -> None:
    lin = torch.nn.Linear(2, 2)
    w = lin.weight
    lin.to(torch.float64)
    assert lin.weight is w and w.dtype == torch.float64
