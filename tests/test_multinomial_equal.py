"""multinomial (device Philox generator) and equal, lowered on tpu: sampling statistics against
the exact distribution (fixed seeds, so deterministic), determinism under manual_seed, and
torch.equal against the CPU."""

from __future__ import annotations

import pytest
import torch
import torch_tpu

pytestmark = pytest.mark.usefixtures("no_fallback")


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic over the categories with positive probability."""
    n = counts.sum()
    pos = probs > 0
    exp = probs[pos] / probs.sum() * n
    return float(((counts[pos].double() - exp) ** 2 / exp).sum())


# chi-square 0.999 quantiles by degrees of freedom: a correct sampler fails one seed in 1000,
# and the seeds are fixed.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


def test_with_replacement_1d_frequencies() -> None:
    torch.manual_seed(0)
    w = torch.tensor([0.2, 0.0, 0.6, 1.2, 0.0])  # unnormalized, zeros inside and at the end
    s = torch.multinomial(w.to("tpu"), 20000, replacement=True)
    assert s.device.type == "tpu" and s.dtype == torch.int64 and s.shape == (20000,)
    counts = torch.bincount(s.cpu(), minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    assert _chi2(counts, w) < CHI2_999[2]


def test_with_replacement_2d_rows_independent() -> None:
    torch.manual_seed(1)
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0], [0.0, 0.0, 5.0, 0.0, 5.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    s = torch.multinomial(w.to("tpu"), 6000, replacement=True).cpu()
    assert s.shape == (3, 6000)
    for r in range(3):
        counts = torch.bincount(s[r], minlength=5)
        assert (counts[w[r] == 0] == 0).all()
        assert _chi2(counts, w[r]) < CHI2_999[int((w[r] > 0).sum()) - 1]


def test_single_category_and_float64_bfloat16() -> None:
    torch.manual_seed(2)
    one = torch.tensor([0.0, 0.0, 3.0], device="tpu")
    assert (torch.multinomial(one, 50, replacement=True).cpu() == 2).all()
    for dt in (torch.float64, torch.bfloat16):
        w = torch.tensor([1.0, 0.0, 3.0], dtype=dt, device="tpu")
        s = torch.multinomial(w, 4000, replacement=True).cpu()
        counts = torch.bincount(s, minlength=3)
        assert counts[1] == 0 and _chi2(counts, w.float().cpu()) < CHI2_999[1]


def test_without_replacement_no_duplicates_no_zeros() -> None:
    torch.manual_seed(3)
    w = torch.rand(64, 10)
    w[:, 3] = 0
    w[::2, 7] = 0
    s = torch.multinomial(w.to("tpu"), 8, replacement=False).cpu()
    assert s.shape == (64, 8)
    for r in range(64):
        assert len(set(s[r].tolist())) == 8
        assert (w[r, s[r]] > 0).all()
    full = torch.multinomial(torch.rand(5, 6, device="tpu") + 0.1, 6).cpu()  # a permutation per row
    assert (full.sort(dim=1).values == torch.arange(6)).all()


def test_without_replacement_inclusion_probabilities() -> None:
    """Two draws without replacement from 4 categories: the first draw follows p, and the chance
    that i is drawn second is sum_j p_j p_i / (1 - p_j)."""
    torch.manual_seed(4)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    rows = 8000
    s = torch.multinomial(p.float().to("tpu").expand(rows, 4).contiguous(), 2).cpu()
    first = torch.bincount(s[:, 0], minlength=4)
    second = torch.bincount(s[:, 1], minlength=4)
    p_second = torch.stack([sum(p[j] * p[i] / (1 - p[j]) for j in range(4) if j != i) for i in range(4)])
    assert _chi2(first, p) < CHI2_999[3]
    assert _chi2(second, p_second) < CHI2_999[3]
    assert (s[:, 0] != s[:, 1]).all()


@pytest.mark.parametrize("replacement", [True, False])
def test_deterministic_under_manual_seed(replacement: bool) -> None:
    w = torch.tensor([[0.5, 1.0, 2.0, 0.25, 1.0]] * 3, device="tpu")
    torch.manual_seed(11)
    a = torch.multinomial(w, 4, replacement=replacement).cpu()
    b = torch.multinomial(w, 4, replacement=replacement).cpu()
    torch.manual_seed(11)
    c = torch.multinomial(w, 4, replacement=replacement).cpu()
    assert torch.equal(a, c)
    assert not torch.equal(a, b)  # the generator advances
    g = torch.Generator(device="tpu").manual_seed(11)
    d = torch.multinomial(w, 4, replacement=replacement, generator=g).cpu()
    assert torch.equal(a, d)
    out = torch.empty(3, 4, dtype=torch.int64, device="tpu")
    torch.manual_seed(11)
    torch.multinomial(w, 4, replacement=replacement, out=out)
    assert torch.equal(out.cpu(), a)


def _equal_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, generator=g)
    y = x.clone()
    y[1, 2] += 1e-6
    nan = x.clone()
    nan[0, 0] = float("nan")
    return [
        ("same", x, x.clone()),
        ("one_differs", x, y),
        ("nan", nan, nan.clone()),
        ("shape", x, x[:2]),
        ("broadcastable_shape", x[:1], x[:1].expand(3, 4)),
        ("transposed_view", x.t(), x.t().contiguous()),
        ("int_vs_float", torch.arange(6), torch.arange(6).float()),
        ("bool", x > 0, (x > 0).clone()),
        ("bool_differs", x > 0, x >= 0.5),
        ("signed_zero", torch.zeros(3), -torch.zeros(3)),
        ("empty", torch.empty(0, 3), torch.empty(0, 3)),
        ("scalar", torch.tensor(2.5), torch.tensor(2.5)),
    ]


@pytest.mark.parametrize(("name", "a", "b"), _equal_cases(), ids=[c[0] for c in _equal_cases()])
def test_equal_matches_cpu(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    syncs = torch_tpu.dispatch_stats()["host_syncs"]
    got = torch.equal(a.to("tpu"), b.to("tpu"))
    assert isinstance(got, bool)
    assert got == torch.equal(a, b), name
    assert torch_tpu.dispatch_stats()["host_syncs"] - syncs <= 1  # the one unavoidable read


def test_without_replacement_too_many_samples_raises() -> None:
    with pytest.raises(RuntimeError, match="n_sample > prob_dist"):
        torch.multinomial(torch.rand(2, 4), 5)
    with pytest.raises(RuntimeError, match="n_sample > prob_dist"):
        torch.multinomial(torch.rand(2, 4, device="tpu"), 5)


def test_single_draw_without_replacement_frequencies() -> None:
    """num_samples=1 (token sampling) takes the race's argmax instead of a sort."""
    torch.manual_seed(6)
    w = torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0])
    s = torch.multinomial(w.to("tpu").expand(20000, 5).contiguous(), 1).cpu()
    assert s.shape == (20000, 1)
    counts = torch.bincount(s.flatten(), minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    assert _chi2(counts, w) < CHI2_999[2]
    one = torch.multinomial(torch.tensor([0.0, 2.0, 0.0], device="tpu"), 1)
    assert one.shape == (1,) and one.item() == 1
