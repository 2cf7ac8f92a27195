"""The drafter contract, without vLLM: drafts equal the draft model's own continuation, at most K per row,
outcomes of any shape (all accepted, some, none, skipped steps) keep the KV consistent, state is freed,
lost state is resynced, and the drafter process survives crashes via the client."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.sync_drafter import SyncDrafter
from saguaro_vllm.shared.proposal_buffers import ProposalRing
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

K = 4


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def make_drafter(model, num_blocks=64) -> SyncDrafter:
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=16))
    return SyncDrafter(runner, vocab_size=model.config.vocab_size, probs_ring=make_ring(model))


def make_ring(model, rows: int = 8) -> ProposalRing:
    """The proposal ring the proposer would share with the drafter (removed when garbage collected)."""
    return ProposalRing.create(rows=rows, k=K, vocab=model.config.vocab_size)


def ring_probs(drafter, resp) -> dict[int, np.ndarray]:
    """answer row -> its q [len(drafts), vocab] from the slot the answer names; gives the slot back (as the
    proposer's next step does)."""
    if resp.probs_slot < 0:
        return {}
    assert drafter.probs_ring.held(resp.probs_slot, resp.step)
    buf = drafter.probs_ring.slot(resp.probs_slot)
    out = {j: buf[r, : len(resp.drafts[j])].numpy().copy() for r, j in enumerate(resp.probs_rows)}
    drafter.probs_ring.release_held()
    return out


def count_slot_writes(monkeypatch) -> dict[str, int]:
    """Counts of `SlotWriter.put` (one row's q' copied) and `put_positions` (one batched in-place write)
    calls from now on."""
    from saguaro_vllm.shared.proposal_buffers import SlotWriter

    calls = {"put": 0, "put_positions": 0}
    for name in calls:
        original = getattr(SlotWriter, name)

        def counted(self, *a, _original=original, _name=name, **kw):
            calls[_name] += 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(SlotWriter, name, counted)
    return calls


def draft_logits_of(model, context: list[int]) -> torch.Tensor:
    """Reference: the draft's next-token logits after `context`, on a fresh runner."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=64, block_size=16))
    runner.add_request("ref")
    return runner.forward([("ref", list(context), 0)])[0, : model.config.vocab_size]


def greedy_continuation(model, context: list[int], k: int) -> list[int]:
    """Reference: the draft's greedy continuation, recomputed from scratch on a fresh runner."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=64, block_size=16))
    runner.add_request("ref")
    toks, out = list(context), []
    for _ in range(k):
        logits = runner.forward([("ref", toks[runner.num_computed("ref"):], runner.num_computed("ref"))])
        out.append(int(logits[0].argmax()))
        toks.append(out[-1])
    return out


def test_drafts_follow_any_outcome(draft_model):
    rng = np.random.default_rng(0)
    drafter = make_drafter(draft_model)
    contexts = {"a": list(rng.integers(2, 300, 23)), "b": list(rng.integers(2, 300, 5))}
    sent = {rid: 0 for rid in contexts}
    step = 0
    for round_ in range(8):
        rows = []
        for rid, ctx in contexts.items():
            rows.append(RowUpdate(rid, sent[rid], [int(t) for t in ctx[sent[rid]:]], K,
                                  SamplingSpec() if sent[rid] == 0 else None))
            sent[rid] = len(ctx)
        step += 1
        resp = drafter.step(StepRequest(step, rows, []))
        assert resp.resync == [] and resp.probs_slot == -1 and not resp.probs_rows
        for row, drafts in zip(rows, resp.drafts):
            assert len(drafts) == K
            assert drafts == greedy_continuation(draft_model, contexts[row.req_id], K)
            # Outcome: accept a random prefix of the drafts, then a bonus token (sometimes all K).
            a = int(rng.integers(0, K + 1))
            bonus = int(rng.integers(2, 300))
            contexts[row.req_id] = contexts[row.req_id] + drafts[:a] + [bonus]
            if round_ == 4 and row.req_id == "b":  # a skipped step: two outcomes arrive at once
                contexts["b"] += [int(rng.integers(2, 300))]
    drafter.step(StepRequest(step + 1, [], ["a", "b"]))
    assert drafter.reqs == {} and drafter.runner.num_free_blocks == 64


def test_resync_when_context_does_not_continue(draft_model):
    drafter = make_drafter(draft_model)
    resp = drafter.step(StepRequest(1, [RowUpdate("x", 5, [3, 4], K, None)], []))
    assert resp.resync == ["x"] and resp.drafts == [[]]
    resp = drafter.step(StepRequest(2, [RowUpdate("x", 0, [3, 4, 5, 6], K, SamplingSpec())], []))
    assert resp.resync == [] and len(resp.drafts[0]) == K


def test_sampled_rows_return_their_exact_proposal(draft_model):
    drafter = make_drafter(draft_model)
    spec = SamplingSpec(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    resp = drafter.step(StepRequest(1, [RowUpdate("s", 0, [5, 6, 7], K, spec),
                                        RowUpdate("g", 0, [5, 6, 7], K, SamplingSpec())], []))
    probs = ring_probs(drafter, resp)
    q = probs[0]
    assert set(probs) == {0} and q.shape == (K, draft_model.config.vocab_size)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    assert ((q > 0).sum(-1) <= 20).all()
    for pos, tok in enumerate(resp.drafts[0]):
        assert q[pos, tok] > 0  # every drafted token has positive proposal mass


def test_out_of_blocks_gives_no_drafts_not_errors(draft_model):
    drafter = make_drafter(draft_model, num_blocks=3)
    long = list(range(2, 40))  # 38 tokens: 3 blocks of 16
    resp = drafter.step(StepRequest(1, [RowUpdate("big", 0, long, K, SamplingSpec()),
                                        RowUpdate("small", 0, [5, 6], K, SamplingSpec())], []))
    assert resp.drafts[0] and resp.drafts[1] == [] or resp.drafts[1] and resp.drafts[0] == []
    assert drafter.num_out_of_blocks >= 1


@pytest.fixture()
def client_cfg(tiny_pair):
    return {"draft_path": tiny_pair[1], "device": "cpu", "draft_cores": [], "dtype": "float32",
            "vocab_size": 0, "num_speculative_tokens": K,
            "saguaro": {"block_size": 16, "kv_cache_gb": 0.01, "max_tokens_per_forward": 256,
                        "step_timeout_s": 20.0, "startup_timeout_s": 120.0, "log_interval_s": 0}}


def test_drafter_process_restarts_after_a_crash(client_cfg, tiny_pair):
    import logging

    from saguaro_vllm.drafter.model.loader import read_model_info
    from saguaro_vllm.worker.drafter_client import DrafterClient, DrafterUnavailable

    client_cfg["vocab_size"] = read_model_info(tiny_pair[1]).vocab_size
    client = DrafterClient(client_cfg, logging.getLogger("test"))
    try:
        assert client.wait_ready()
        row = RowUpdate("r", 0, [5, 6, 7], K, SamplingSpec())
        assert len(client.step(StepRequest(1, [row], [])).drafts[0]) == K
        os.kill(client.proc.pid, signal.SIGKILL)
        client.proc.wait()
        gen = client.generation
        with pytest.raises(DrafterUnavailable):
            client.step(StepRequest(2, [RowUpdate("r", 3, [8], K, None)], []))
        assert client.generation == gen + 1 and client.restarts == 1
        assert client.wait_ready()
        assert len(client.step(StepRequest(3, [row], [])).drafts[0]) == K
    finally:
        proc = client.proc
        client.close()
        if proc is not None:
            deadline = time.monotonic() + 5
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.poll() is not None, "drafter process outlived its client"


def test_drafter_that_cannot_load_disables_speculation(client_cfg, tmp_path):
    import logging

    from saguaro_vllm.worker.drafter_client import DrafterClient, DrafterUnavailable

    client_cfg["draft_path"] = str(tmp_path)  # no model there
    client = DrafterClient(client_cfg, logging.getLogger("test"))
    assert not client.wait_ready()
    assert "no config.json" in client.disabled_reason or "config" in client.disabled_reason
    with pytest.raises(DrafterUnavailable):
        client.step(StepRequest(1, [], []))


def test_sampled_q_is_written_in_place_once_per_position(draft_model, monkeypatch):
    """`mode: sync` writes each draft position's q' of all sampled rows into the ring slot with one batched
    write (no per-row copies at publish), and the slot holds exactly the softmax the tokens were drawn from."""
    calls = count_slot_writes(monkeypatch)
    drafter = make_drafter(draft_model)
    t1 = SamplingSpec(temperature=1.0, seed=3)
    ctxs = {"a": [5, 6, 7], "b": [9, 2], "g": [4, 4, 8]}
    resp = drafter.step(StepRequest(1, [RowUpdate("a", 0, ctxs["a"], K, t1), RowUpdate("b", 0, ctxs["b"], K, t1),
                                        RowUpdate("g", 0, ctxs["g"], K, SamplingSpec())], []))
    assert calls == {"put": 0, "put_positions": K}
    probs = ring_probs(drafter, resp)
    assert set(probs) == {0, 1}
    for row, rid in enumerate(("a", "b")):
        for pos, tok in enumerate(resp.drafts[row]):
            logits = draft_logits_of(draft_model, ctxs[rid] + resp.drafts[row][:pos])
            np.testing.assert_allclose(probs[row][pos], torch.softmax(logits, -1).numpy(), rtol=1e-4, atol=1e-7)
            assert probs[row][pos][tok] > 0


def test_slot_writer_compacts_rows_cut_after_writing(draft_model):
    from saguaro_vllm.shared.proposal_buffers import SlotWriter

    ring = make_ring(draft_model, rows=4)
    writer = SlotWriter(ring, seq=1)
    vocab = draft_model.config.vocab_size
    q = torch.arange(3 * vocab, dtype=torch.float32).reshape(3, vocab)
    writer.put_positions([7, 8, 9], [0, 0, 0], q)
    writer.compact(lambda row: row != 8)  # row 8's drafts were cut after its q' was written
    slot, rows = writer.finish()
    assert rows == [7, 9] and writer.written == {7: 1, 9: 1}
    assert torch.equal(ring.slot(slot)[0, 0], q[0]) and torch.equal(ring.slot(slot)[1, 0], q[2])
