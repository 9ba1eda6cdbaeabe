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
