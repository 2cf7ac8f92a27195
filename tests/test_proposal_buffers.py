"""The proposal ring (saguaro_vllm/proposal_buffers.py): slot ownership within and across processes, the
dense assembly against the loop-built reference it replaced, and the batched sampling that writes q into it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from saguaro_vllm.drafter.sampling import sample_proposals, sample_rows
from saguaro_vllm.proposal_buffers import FREE, WRITING, ProposalRing, SlotWriter, assemble
from saguaro_vllm.transport import SamplingSpec


@pytest.fixture
def ring():
    r = ProposalRing.create(rows=6, k=3, vocab=37, slots=2)
    yield r
    r.close()


def slot_probs(ring: ProposalRing, slot: int, rows: list[int], drafts: list[list[int]]) -> dict[int, torch.Tensor]:
    """answer row -> its q [len(drafts[row]), vocab], read from a published slot (test helper)."""
    buf = ring.slot(slot)
    return {j: buf[r, : len(drafts[j])].clone() for r, j in enumerate(rows)}


def test_slot_states_and_release(ring):
    other = ProposalRing.attach(ring.spec())  # the drafter's mapping of the same file
    w = SlotWriter(other, seq=1)
    assert w.available and ring.header[w.slot, 0] == WRITING
    w.put(4, torch.full((2, 37), 0.5))
    slot, rows = w.finish()
    assert rows == [4] and ring.held(slot, 1) and not ring.held(slot, 2)
    assert torch.equal(ring.slot(slot)[0, :2], torch.full((2, 37), 0.5))  # written through the other mapping
    w2 = SlotWriter(other, seq=2)  # the second slot, while the first is held
    assert w2.available and w2.slot != slot
    assert SlotWriter(other, seq=3).slot is None  # both taken: no overwrite of a held or WRITING slot
    ring.release_held()
    assert ring.header[slot, 0] == FREE and ring.header[w2.slot, 0] == WRITING  # WRITING is the drafter's
    w2.abandon()
    assert (ring.header[:, 0] == FREE).all()
    empty = SlotWriter(other, seq=4)
    assert empty.finish() == (-1, []) and (ring.header[:, 0] == FREE).all()  # nothing written: not published
    other.close()


def test_owner_removes_its_private_directory():
    r = ProposalRing.create(rows=1, k=1, vocab=8)
    d = os.path.dirname(r.path)
    assert os.stat(d).st_mode & 0o777 == 0o700 and os.stat(r.path).st_mode & 0o777 == 0o600
    r.close()
    assert not os.path.exists(d)


def test_attach_refuses_a_ring_of_another_shape(ring):
    with pytest.raises(ValueError, match="expected"):
        ProposalRing.attach({**ring.spec(), "vocab": 38})


def reference_dense(drafts, row_index, probs, k, vocab):
    """The loop-built `[rows, K, vocab]` tensor the proposer used to make (indexed by batch row)."""
    dense = torch.zeros(len(drafts), k, vocab, dtype=torch.float32)
    for i, toks in enumerate(drafts):
        for pos, tok in enumerate(toks):
            dense[i, pos, tok] = 1.0
    for j, q in probs.items():
        i = row_index[j]
        n = len(drafts[i])
        dense[i, :n] = torch.from_numpy(q[:n, :vocab])
    return dense


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_assembly_equals_the_loop_reference(seed):
    rng = np.random.default_rng(seed)
    k, vocab, batch = 4, 53, 9
    ring = ProposalRing.create(rows=batch, k=k, vocab=vocab, slots=2)
    # Earlier steps leave stale values everywhere in the slot: assembly must not depend on them.
    ring.slot(0).copy_(torch.rand(batch, k, vocab))
    row_index = sorted(rng.choice(batch + 3, size=batch, replace=False).tolist())  # answer row -> batch row
    answer_drafts = [rng.integers(0, vocab, int(rng.integers(0, k + 1))).tolist() for _ in range(batch)]
    sampled = [j for j in range(batch) if answer_drafts[j] and rng.random() < 0.5]
    probs = {j: rng.dirichlet(np.ones(vocab), size=len(answer_drafts[j])).astype(np.float32) for j in sampled}
    w = SlotWriter(ring, seq=7)
    for j in rng.permutation(sampled).tolist():  # any order of slot rows
        w.put(j, torch.from_numpy(probs[j]))
    slot, rows = w.finish()
    if not sampled:
        assert slot == -1
        slot = 0
    got, answer_rows = assemble(ring.slot(slot), rows, answer_drafts, k)
    batch_drafts = [[] for _ in range(batch + 3)]
    for j, i in enumerate(row_index):
        batch_drafts[i] = answer_drafts[j]
    want = reference_dense(batch_drafts, row_index, probs, k, vocab)
    assert sorted(answer_rows) == [j for j in range(batch) if answer_drafts[j]]
    for r, j in enumerate(answer_rows):  # what vLLM reads: each row's drafted positions
        n = len(answer_drafts[j])
        assert torch.equal(got[r, :n], want[row_index[j], :n]), (seed, j)
    assert got.data_ptr() == ring.slot(slot).data_ptr()  # a view of the slot, not a copy
    ring.close()


CHILD = textwrap.dedent("""
    import sys, torch
    from saguaro_vllm.proposal_buffers import ProposalRing, SlotWriter
    ring = ProposalRing.attach(eval(sys.argv[1]))
    for line in sys.stdin:
        seq = int(line)
        w = SlotWriter(ring, seq)
        if not w.available:
            print(-1, flush=True)
            continue
        for j in range(ring.rows):
            w.put(j, torch.full((ring.k, ring.vocab), float(seq * 100 + j)))
        slot, rows = w.finish()
        print(slot, flush=True)
""")


def test_two_processes_never_overwrite_a_held_slot():
    ring = ProposalRing.create(rows=3, k=2, vocab=4096, slots=2)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, repr(ring.spec())], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)

    def ask(seq: int) -> int:
        proc.stdin.write(f"{seq}\n")
        proc.stdin.flush()
        return int(proc.stdout.readline())

    def intact(slot: int, seq: int) -> bool:
        want = torch.arange(ring.rows, dtype=torch.float32).view(-1, 1, 1) + seq * 100
        return ring.held(slot, seq) and torch.equal(ring.slot(slot), want.expand(-1, ring.k, ring.vocab))

    try:
        held = []
        for seq in range(1, 41):
            if seq % 5 == 0:  # answers the proposer dropped (late) stay held until its next propose
                for late in (seq, seq + 1000):
                    slot = ask(late)
                    assert slot >= 0 and all(intact(s, q) for s, q in held)
                    held.append((slot, late))
                assert ask(seq + 2000) == -1  # no slot left: the drafter writes nothing
                assert len({s for s, _ in held}) == 2 and all(intact(s, q) for s, q in held)
            else:
                slot = ask(seq)
                assert slot >= 0 and intact(slot, seq)
                held.append((slot, seq))
            ring.release_held()  # the next propose: vLLM consumed the last answer
            held = []
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        ring.close()
    assert proc.returncode == 0


def test_batched_proposals_equal_the_per_row_proposals():
    """One `sample_proposals` call over rows with their own temperature, top-k, top-p, F and C gives each
    row the q' of a call for that row alone (within fp32 rounding: a row without top-k, top-p or scaling
    alone takes the torch softmax, the batch the kernel), and each row's token from its own generator."""
    torch.manual_seed(0)
    logits = torch.randn(7, 300) * 4
    specs = [SamplingSpec(temperature=t, top_k=k, top_p=p)
             for t, k, p in [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8),
                             (1.0, 0, 1.0), (1.3, 0, 0.8)]]
    f, c = [0, 2, 3, 0, 1, 4, 0], [1.0, 0.5, 0.2, 1.0, 0.0, 0.7, 1.0]
    gens = [torch.Generator().manual_seed(i) for i in range(7)]
    tokens, q = sample_proposals(logits, specs, gens, f, c)
    for i, spec in enumerate(specs):
        one_tok, one_q = sample_proposals(logits[i: i + 1], [spec], [torch.Generator().manual_seed(i)], f[i], c[i])
        torch.testing.assert_close(q[i], one_q[0], rtol=1e-5, atol=1e-6)  # fp32 rounding: a lone row may take the torch path
        assert int(tokens[i]) == int(one_tok[0]) and float(q[i, tokens[i]]) > 0
    assert float(q[2].max()) < float(torch.softmax(logits[2], -1).max())  # C = 0.2 on the top 3 took effect


def test_sample_rows_is_exact_and_reproducible():
    q = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0],
                      [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]], dtype=torch.float32)
    n = 20000
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    draws = torch.stack([sample_rows(q, gens) for _ in range(n)])  # [n, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6).double()
        assert (counts[q[row] == 0] == 0).all()  # a token of probability 0 is never drawn
        expected = q[row].double() * n
        nz = expected > 0
        chi2 = float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())
        assert chi2 < 20.0, (row, counts.tolist())  # 1-3 degrees of freedom: p < 2e-4 by chance
    again = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    assert torch.equal(torch.stack([sample_rows(q, again) for _ in range(50)]), draws[:50])
