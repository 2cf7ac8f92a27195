"""What tells a TP test which sampling path each rank took, without an engine: `tp_sampling.py`'s per-rank count
of the steps it took rank 0's tokens in, and verify_trace.py's reading of one step (the engine tests in
tests/test_tp.py and tests/test_real_vocab.py rest on both)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verify_trace import PLACEHOLDER, _step


def _runner(all_greedy: bool) -> SimpleNamespace:
    return SimpleNamespace(drafter=SimpleNamespace(is_saguaro_proposer=True),
                           input_batch=SimpleNamespace(sampling_metadata=SimpleNamespace(all_greedy=all_greedy)))


class _Group:
    def __init__(self, rank: int, rank0_tokens: torch.Tensor):
        self.world_size, self.rank_in_group, self.rank0_tokens = 2, rank, rank0_tokens

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        assert src == 0
        tensor.copy_(self.rank0_tokens)
        return tensor


@pytest.mark.parametrize("rank, role", [(0, "sent"), (1, "received")])
def test_each_rank_counts_the_steps_it_took_rank0_tokens_in(monkeypatch, rank, role):
    import vllm.distributed

    from saguaro_vllm.patches import TP_RANK0_TOKEN_STEPS
    from saguaro_vllm.patches.tp_sampling import wrap_sample

    rank0 = torch.tensor([[4, 9, PLACEHOLDER]], dtype=torch.int32)
    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: _Group(rank, rank0))
    own = torch.tensor([[4, 7, PLACEHOLDER]], dtype=torch.int32)
    sample = wrap_sample(lambda self, logits, md: SimpleNamespace(sampled_token_ids=own.clone()))
    metadata = SimpleNamespace(draft_token_ids=torch.tensor([4, 5]))
    before = dict(TP_RANK0_TOKEN_STEPS)
    out = sample(_runner(all_greedy=False), None, metadata)
    assert torch.equal(out.sampled_token_ids, rank0)
    sample(_runner(all_greedy=True), None, metadata)  # greedy rows: every rank's argmax, no broadcast
    sample(_runner(all_greedy=False), None, None)  # no drafts this step
    sample(_runner(all_greedy=False), None, SimpleNamespace(draft_token_ids=torch.tensor([])))
    grown = {k: v - before.get(k, 0) for k, v in TP_RANK0_TOKEN_STEPS.items()}
    assert {k: v for k, v in grown.items() if v} == {role: 1}


def test_a_step_record_counts_drafts_accepts_rejections_and_replaced_rows():
    p = PLACEHOLDER
    # rows: 2 drafts, both accepted + bonus | no drafts | 3 drafts, 1 accepted + recovered | 2 drafts, 0 accepted
    own = torch.tensor([[1, 2, 3, p], [8, p, p, p], [4, 5, p, p], [6, p, p, p]], dtype=torch.int32)
    kept = torch.tensor([[1, 2, 3, p], [8, p, p, p], [4, 5, p, p], [7, 1, p, p]], dtype=torch.int32)
    step = _step([2, 0, 3, 2], "onehot", own, kept)
    assert (step.batch, step.drafted, step.path, step.draft_tokens) == (4, 3, "onehot", 7)
    # counted on the kept tokens: 2 + 1 + 1 accepted; rows 2 and 3 rejected a draft; row 3 replaced
    assert (step.accepted, step.rejected, step.replaced) == (4, 2, 1)
