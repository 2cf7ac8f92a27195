"""The proposal q': compiled kernels vs the plain-torch reference (within fp32 rounding), an independent
softmax for the unscaled case, Saguaro's scaling, and draws from q' by the drafter's sampler."""

from __future__ import annotations

import pytest
import torch

from saguaro_vllm.ops import loader, proposal_probs, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, scope="module")
def compiled_ops():
    for dev in DEVICES:
        assert loader.implementation(dev) != "reference", loader.status().error


def make_params(n, seed):
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(n, generator=g) * 1.5 + 0.3
    temperature[::5] = 0.0  # greedy rows
    top_k = torch.randint(-1, 60, (n,), generator=g)
    top_p = torch.where(torch.rand(n, generator=g) < 0.5, torch.rand(n, generator=g) * 0.9 + 0.05, 1.0)
    saguaro_f = torch.randint(0, 9, (n,), generator=g)
    saguaro_c = torch.rand(n, generator=g)
    saguaro_c[1::4] = 0.0  # C = 0, sometimes with every kept token among the top F
    saguaro_c[2::4] = 1.0
    return temperature, top_k, top_p, saguaro_f, saguaro_c


CASES = [(1, 19, False), (7, 1000, False), (24, 1000, True), (16, 32000, False), (3, 5, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, device):
    n, vocab, ties = case
    seed = CASES.index(case)
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(n, vocab + 3, generator=g) * 4
    if ties:
        logits = (logits * 2).round() / 2
    logits = logits[:, 1 : 1 + vocab].to(device)  # non-contiguous rows
    temperature, top_k, top_p, f, c = (t.to(device) for t in make_params(n, seed))
    probs = proposal_probs(logits, temperature, top_k, top_p, f, c)
    ref = reference.proposal_probs(logits, temperature, top_k, top_p, f, torch.log(c))
    torch.testing.assert_close(probs, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(probs > 0, ref > 0)  # the same support: a token one side never draws, neither does the other
    torch.testing.assert_close(probs.sum(-1), torch.ones(n, device=device))
    greedy = ~(temperature > 0)
    assert torch.equal(probs[greedy].argmax(-1), logits[greedy].argmax(-1))
    assert bool((probs[greedy].max(-1).values == 1).all())


def _plain_proposal(logits, temperature, top_k=0, top_p=1.0):
    """An independent plain softmax with top-k then top-p (distinct values, so ties do not matter)."""
    z = logits / temperature
    if top_k:
        z = z.masked_fill(z < torch.topk(z, top_k, dim=-1).values[..., -1:], float("-inf"))
    p = z.softmax(-1)
    if top_p < 1.0:
        sp, order = p.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp >= top_p  # the mass above each token reaches top_p
        p = p.scatter(-1, order, sp.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


@pytest.mark.parametrize("device", DEVICES)
def test_unscaled_proposal_is_the_request_distribution(device):
    """With F = 0, q' is softmax(logits / T) restricted to the top-k and then top-p set."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 500, generator=g) * 3).to(device)
    for t, k, p in ((0.8, 0, 1.0), (1.0, 20, 1.0), (0.6, 0, 0.9), (1.2, 50, 0.7)):
        probs = proposal_probs(logits, t, k, p)
        torch.testing.assert_close(probs, _plain_proposal(logits, t, k, p), atol=1e-6, rtol=1e-5)
        n = logits.shape[0]  # the torch fast path (no top-k, top-p, scaling) and the kernels: the reference's q'
        ref = reference.proposal_probs(logits, torch.full((n,), t, device=device), torch.full((n,), k, device=device),
                                       torch.full((n,), p, device=device), torch.zeros(n, dtype=torch.int64,
                                                                                       device=device),
                                       torch.zeros(n, device=device))
        torch.testing.assert_close(probs, ref, atol=1e-6, rtol=1e-5)


def test_saguaro_scaling_worked_example():
    """q = [0.5, 0.3, 0.2]; F = 1, C = 0.5: q' = [0.25, 0.3, 0.2] / 0.75."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    probs = proposal_probs(logits, 1.0, saguaro_f=1, saguaro_c=0.5)
    torch.testing.assert_close(probs, torch.tensor([[0.25, 0.3, 0.2]]) / 0.75)
    probs = proposal_probs(logits, 1.0, top_k=1, saguaro_f=1, saguaro_c=0.0)
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0]]))  # C = 0 with nothing else kept


@pytest.mark.parametrize("device", DEVICES)
def test_samples_follow_the_proposal(device):
    """20000 draws (the drafter's sampler, one row each) from one scaled q': frequencies match q' (within
    5 sigma) and tokens of probability 0 never come."""
    from types import SimpleNamespace

    from saguaro_vllm.drafter.sampling import sample_proposals

    spec = SimpleNamespace(temperature=0.9, top_k=6, top_p=0.97)  # a SamplingSpec without importing pyzmq

    n, vocab = 20000, 8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.0, -0.5, -1.0, -3.0]).expand(n, vocab).to(device)
    gen = torch.Generator().manual_seed(0)
    tokens, probs = sample_proposals(logits, [spec] * n, [gen] * n, 2, 0.4)
    q = probs[0]
    assert bool((q[6:] == 0).all()) and q[1] < q[2]  # top-k cut; the second token scaled below the third
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    sigma = (q * (1 - q) / n).sqrt()
    assert bool(((freq - q).abs() <= 5 * sigma + 1e-9).all()), (freq, q)
    assert not bool((q[tokens] == 0).any())  # no draw of a token outside q's support


def test_rejects_bad_c():
    with pytest.raises(ValueError):
        proposal_probs(torch.zeros(1, 4), 1.0, saguaro_f=1, saguaro_c=1.5)
