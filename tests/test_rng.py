"""Random numbers on tpu: seeding, generator state, distributions."""

from __future__ import annotations

import torch
import torch_tpu


def test_rng_reproducible_and_seedable() -> None:
    torch_tpu.reset_fallback_stats()  # earlier tests in the process may use the fallback on purpose
    torch.manual_seed(1234)  # seeds tpu too (through torch.tpu.manual_seed_all)
    a = torch.rand(1000, device="tpu")
    b = torch.randn(1000, device="tpu")
    torch.tpu.manual_seed(1234)
    assert torch.equal(a.cpu(), torch.rand(1000, device="tpu").cpu())
    assert torch.equal(b.cpu(), torch.randn(1000, device="tpu").cpu())
    state = torch.tpu.get_rng_state()
    c = torch.randint(0, 10, (100,), device="tpu")
    torch.tpu.set_rng_state(state)
    assert torch.equal(c.cpu(), torch.randint(0, 10, (100,), device="tpu").cpu())
    assert torch.tpu.initial_seed() == 1234
    u = torch.empty(20000, device="tpu").uniform_(-2, 3).cpu()
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean().item() - 0.5) < 0.05
    n = torch.empty(20000, device="tpu").normal_(1.0, 2.0).cpu()
    assert abs(n.mean().item() - 1.0) < 0.1 and abs(n.std().item() - 2.0) < 0.1
    p = torch.randperm(50, device="tpu").cpu()
    assert sorted(p.tolist()) == list(range(50))
    d = torch.nn.functional.dropout(torch.ones(20000, device="tpu"), 0.25).cpu()
    assert abs((d == 0).float().mean().item() - 0.25) < 0.02
    assert torch.allclose(d[d != 0], torch.tensor(1 / 0.75))
    bern = torch.bernoulli(torch.full((20000,), 0.3, device="tpu")).cpu()
    assert abs(bern.mean().item() - 0.3) < 0.02
    g = torch.Generator(device="tpu").manual_seed(7)
    x1 = torch.rand(10, device="tpu", generator=g)
    g.manual_seed(7)
    assert torch.equal(x1.cpu(), torch.rand(10, device="tpu", generator=g).cpu())
    assert torch_tpu.fallback_stats() == {}


def _offset() -> int:
    """The device generator's Philox offset (bytes 8..16 of its state)."""
    return int(torch.tpu.get_rng_state()[8:].view(torch.int64).item())


def test_generator_draws_match_cpu_in_eager_and_compiled() -> None:
    """Whether a call advances the generator follows PyTorch's CPU kernels (attention with
    dropout_p == 0 and native_dropout in eval mode draw nothing), and eager and compiled calls
    advance it by the same amount (one rule, lowering::rng_counters)."""
    import torch.nn.functional as F

    cases = {
        "sdpa p=0": (lambda q, x: F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)),
        "sdpa p=0.5": (lambda q, x: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)),
        "native_dropout eval": (lambda q, x: torch.native_dropout(x, 0.5, False)),
        "native_dropout p=0 train": (lambda q, x: torch.native_dropout(x, 0.0, True)),
        "dropout p=0.25": (lambda q, x: F.dropout(x, 0.25, True)),
    }
    q_cpu, x_cpu = torch.randn(1, 2, 4, 8), torch.randn(10)
    q, x = q_cpu.to("tpu"), x_cpu.to("tpu")
    for name, fn in cases.items():
        torch.manual_seed(0)
        fn(q_cpu, x_cpu)
        after = torch.rand(4)
        torch.manual_seed(0)
        cpu_draws = not torch.equal(after, torch.rand(4))
        start = _offset()
        fn(q, x)
        eager = _offset() - start
        compiled_fn = torch.compile(fn, backend="tpu", fullgraph=True)
        compiled_fn(q, x)  # compile
        start = _offset()
        compiled_fn(q, x)
        compiled = _offset() - start
        assert (eager > 0) == cpu_draws, (name, eager, cpu_draws)
        assert compiled == eager, (name, compiled, eager)
