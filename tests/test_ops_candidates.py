"""Candidate selection: compiled kernels vs the plain-torch reference (exact tokens and scores)."""

from __future__ import annotations

import pytest
import torch

from saguaro_vllm.ops import (
    loader,
    reference,
    select_candidates,
    select_candidates_padded,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, scope="module")
def compiled_ops():
    for dev in DEVICES:
        assert loader.implementation(dev) != "reference", loader.status().error


def make_case(batch, K, vocab, max_f, dtype, device, seed, noncontig=False, ties=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, K + 1, vocab + (5 if noncontig else 0), generator=g) * 2
    if ties:
        scores = scores.round()  # many equal values: the order must break ties by token id
    scores = scores.to(dtype)
    if noncontig:
        scores = scores[..., 3 : 3 + vocab]
    drafted = torch.randint(0, vocab, (batch, K), generator=g)
    # Half the drafted tokens are the depth's best token, so the exclusion changes the result.
    best = scores[:, :K].float().argmax(-1)
    pick = torch.rand(batch, K, generator=g) < 0.5
    drafted = torch.where(pick, best, drafted)
    fanout = torch.randint(0, max_f + 1, (batch, K + 1), generator=g, dtype=torch.int32)
    return scores.to(device), drafted.to(device), fanout.to(device)


CASES = [  # (batch, K, vocab, max fan-out, dtype, ties, non-contiguous)
    (1, 1, 19, 3, torch.float32, False, False),
    (3, 5, 1000, 7, torch.bfloat16, False, True),
    (16, 4, 1000, 24, torch.float32, True, False),
    (3, 0, 111, 4, torch.float16, True, True),
    (16, 5, 32000, 5, torch.float32, False, False),
    (1, 3, 5, 6, torch.float32, True, False),  # fan-out beyond the vocabulary: padded with -1
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, device):
    batch, K, vocab, max_f, dtype, ties, noncontig = case
    scores, drafted, fanout = make_case(batch, K, vocab, max_f, dtype, device, CASES.index(case), noncontig, ties)
    tokens, values = select_candidates_padded(scores, drafted, fanout, max_f)
    ref_tokens, ref_values = reference.select_candidates(scores, drafted, fanout, max_f)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(values, ref_values)
    # Properties: the drafted token never appears at its depth; ranks beyond f_j are padding.
    if K:
        assert not bool((tokens[:, :K] == drafted[..., None]).any())
    rank = torch.arange(max_f, device=device)
    assert bool((tokens[rank.expand_as(tokens) >= fanout[..., None]] == -1).all())


def test_worked_example():
    """K = 1, x_1 = 5; depth 0 takes the best two tokens other than 5, depth 1 its best token."""
    scores = torch.tensor([[[0.0, 3.0, 1.0, 3.0, 0.5, 9.0], [7.0, 0.0, 0.0, 0.0, 0.0, 1.0]]])
    cand = select_candidates(scores, torch.tensor([[5]]), torch.tensor([[2, 1]]))
    assert cand.tokens.tolist() == [1, 3, 0]  # tie 3.0/3.0 goes to the lower id
    assert cand.depths.tolist() == [0, 0, 1]
    assert cand.owners.tolist() == [0, 0, 0]
    assert cand.keys == [(0, 0, 1), (0, 0, 3), (0, 1, 0)]
