"""The proposal ring (saguaro_vllm/shared/proposal_buffers.py): slot ownership within and across processes, the
dense assembly against the loop-built reference it replaced, and the batched sampling that writes q into it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from saguaro_vllm.shared import proposal_buffers
from saguaro_vllm.drafter.sampling import sample_proposals, sample_rows
from saguaro_vllm.shared.proposal_buffers import (
    FREE,
    WRITING,
    ProposalRing,
    SlotWriter,
    assemble,
    fit_rows,
    ring_bytes,
    ring_rows,
)
from saguaro_vllm.shared.transport import SamplingSpec


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


@pytest.mark.parametrize("with_unread", [False, True])
@pytest.mark.parametrize("elsewhere", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_assembly_equals_the_loop_reference(seed, elsewhere, with_unread, monkeypatch):
    """`elsewhere`: the target's device is not the slot's (a host ring feeding a CUDA target): the sampled
    rows move once and the one-hot rows are built on the target's side (taken on CPU by declaring the
    devices different). `with_unread`: some deterministic rows belong to greedy requests, whose q vLLM never
    reads (`test_greedy_requests_q_is_never_read`): in the slot they are left exactly as they were, every
    other row is still the reference's."""
    from saguaro_vllm.shared import proposal_buffers

    if elsewhere:
        monkeypatch.setattr(proposal_buffers, "_same_device", lambda a, b: False)
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
    unread = {j for j in range(batch) if answer_drafts[j] and j not in sampled and rng.random() < 0.5
              } if with_unread else set()
    before = ring.slot(slot).clone()
    got, answer_rows = assemble(ring.slot(slot), rows, answer_drafts, k, device="cpu" if elsewhere else None,
                                unread=unread)
    batch_drafts = [[] for _ in range(batch + 3)]
    for j, i in enumerate(row_index):
        batch_drafts[i] = answer_drafts[j]
    want = reference_dense(batch_drafts, row_index, probs, k, vocab)
    assert sorted(answer_rows) == [j for j in range(batch) if answer_drafts[j]]
    for r, j in enumerate(answer_rows):  # what vLLM reads: each row's drafted positions
        n = len(answer_drafts[j])
        if j in unread and not elsewhere:
            assert torch.equal(got[r], before[r]), (seed, j)  # not written: no zero-fill, no one-hot
        else:
            assert torch.equal(got[r, :n], want[row_index[j], :n]), (seed, j)
    # a view of the slot, not a copy; or, for another device, its own tensor
    assert (got.data_ptr() == ring.slot(slot).data_ptr()) != elsewhere
    ring.close()


CHILD = textwrap.dedent("""
    import sys, torch
    from saguaro_vllm.shared.proposal_buffers import ProposalRing, SlotWriter
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


# ---- sizing: the ring's rows come from saguaro.max_sampled_rows, its memory from the rows written ----------
def test_ring_rows_come_from_the_cap_not_max_num_seqs():
    assert ring_rows("auto", 1024) == 256 and ring_rows("auto", 32) == 32
    assert ring_rows(64, 1024) == 64 and ring_rows(4096, 1024) == 1024 and ring_rows(0, 1024) == 0
    assert ring_bytes(256, 5, 128256) == 4096 + 2 * 256 * 5 * 128256 * 4  # 1.31 GB, not 5.25 GB at 1024 rows


def test_a_large_ring_uses_only_what_the_batch_wrote():
    """A ring for max_num_seqs 1024, K 5, vocab 128256 reserves its slots but allocates, after a 16-row
    sampled batch, about what those 16 rows need (the file is sparse and nothing is pre-touched)."""
    k, vocab = 5, 128256
    rows = ring_rows("auto", 1024)
    if proposal_buffers.ring_dir(ring_bytes(rows, k, vocab))[0] is None:
        pytest.skip("neither /dev/shm nor the temp dir can hold this ring's worst case here")
    ring = ProposalRing.create(rows=rows, k=k, vocab=vocab)
    try:
        assert ring.nbytes == os.stat(ring.path).st_size == ring_bytes(rows, k, vocab)
        assert ring.resident_bytes() <= 64 * 1024  # created: (at most) the header page
        w = SlotWriter(ProposalRing.attach(ring.spec()), seq=1)
        q = torch.full((k, vocab), 1.0 / vocab)
        for j in range(16):
            w.put(j, q)
        _, written = w.finish()
        assert written == list(range(16))
        need = 16 * k * vocab * 4  # 41 MB
        used = ring.resident_bytes()
        assert need <= used <= need + 2 * 2**20, (used, need)  # plus the header and page/extent rounding
        assert used < ring.nbytes / 25
    finally:
        ring.close()


def _fake_statvfs(monkeypatch, free: dict[str, int]):
    """os.statvfs reporting `free` bytes for the given directories (others as they are)."""
    real = os.statvfs

    class Fake:
        def __init__(self, n):
            self.f_bavail, self.f_frsize = n // 4096, 4096

    monkeypatch.setattr(os, "statvfs", lambda d: Fake(free[d]) if d in free else real(d))


def test_create_refuses_a_directory_that_cannot_hold_the_worst_case(monkeypatch, tmp_path):
    import tempfile

    _fake_statvfs(monkeypatch, {"/dev/shm": 64 * 2**20, tempfile.gettempdir(): 64 * 2**20, str(tmp_path): 2**20})
    with pytest.raises(OSError) as err:
        ProposalRing.create(rows=256, k=5, vocab=128256)
    msg = str(err.value)
    assert "saguaro.max_sampled_rows" in msg and "1.22 GiB" in msg and "/dev/shm: 64.0 MiB free" in msg
    assert "--shm-size=3g" in msg and "lower saguaro.max_sampled_rows to 13" in msg
    with pytest.raises(OSError, match="1.0 MiB free"):  # the directory the front end chose: re-checked
        ProposalRing.create(rows=256, k=5, vocab=128256, base_dir=str(tmp_path))
    small = ProposalRing.create(rows=1, k=5, vocab=1000)  # a ring that fits is created
    assert os.path.dirname(os.path.dirname(small.path)) == "/dev/shm" or not os.path.isdir("/dev/shm")
    small.close()


def test_sampled_rows_that_do_not_fit_beside_the_drafted_rows_are_capped():
    # 3 sampled rows (0, 1, 2), 2 greedy rows with drafts (3, 4), one without (5); a 4-row slot keeps 2.
    drafts = [[1], [2], [3], [4], [5], []]
    assert fit_rows([0, 1, 2], drafts, 4) == ([0, 1], [2])
    assert fit_rows([0, 1, 2], drafts, 8) == ([0, 1, 2], [])
    assert fit_rows([0, 1], [[1], [2], [3], [4]], 2) == ([], [0, 1])  # greedy rows fill the slot: none fits


def test_drafter_and_proposer_cap_the_same_rows():
    """The drafter publishes only the sampled rows that fit (the others lose their drafts, counted in the
    answer), so the proposer assembles a tensor with one row per drafted row; a proposer that receives more
    (an old drafter) applies the same rule, counts and logs once."""
    import types

    from saguaro_vllm.drafter.sync_drafter import SyncDrafter
    from saguaro_vllm.worker.metrics import SaguaroMetrics, saguaro_samples
    from saguaro_vllm.worker.proposer import SaguaroProposer
    from saguaro_vllm.shared.transport import StepResponse

    k, vocab = 2, 11
    ring = ProposalRing.create(rows=4, k=k, vocab=vocab)
    drafter = SyncDrafter.__new__(SyncDrafter)  # only what `_publish_probs` reads
    drafter.probs_ring, drafter.num_no_probs_slot = ProposalRing.attach(ring.spec()), 0
    req = types.SimpleNamespace(step=1, rows=[types.SimpleNamespace(req_id=f"r{i}") for i in range(6)])
    q = [torch.full((vocab,), 1.0 / vocab)] * k
    drafts = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], []]
    slot, rows = drafter._publish_probs(req, drafts, {0: q, 1: q, 2: q}, None)
    assert rows == [0, 1] and drafts[2] == [] and drafter.probs_capped == 1 and ring.held(slot, 1)
    probs, answer_rows = assemble(ring.slot(slot), rows, drafts, k)
    assert answer_rows == [0, 1, 3, 4] and probs.shape == (4, k, vocab)
    ring.release_held()

    logged = []
    proposer = SaguaroProposer.__new__(SaguaroProposer)
    proposer.ring, proposer.k, proposer._capped_logged = ring, k, False
    proposer.runner = types.SimpleNamespace(device=torch.device("cpu"))
    proposer.logger = types.SimpleNamespace(warning=lambda *a: logged.append(a), info=lambda *a: None)
    proposer.metrics = SaguaroMetrics({}, proposer.logger)
    w = SlotWriter(ProposalRing.attach(ring.spec()), seq=2)  # an old drafter: all 3 sampled rows published
    for j in range(3):
        w.put(j, torch.full((k, vocab), 1.0 / vocab))
    slot, rows = w.finish()
    drafts = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], []]
    resp = StepResponse(2, drafts, {}, 0.0, probs_slot=slot, probs_rows=rows)
    capped = proposer._take_probs(resp, drafts, list(range(6)), [f"r{i}" for i in range(6)])
    assert capped == 1 and drafts[2] == [] and proposer._last_prob_req_ids == ["r0", "r1", "r3", "r4"]
    proposer._on_capped(capped, 4)
    proposer._on_capped(2, 4)
    assert len(logged) == 1 and "saguaro.max_sampled_rows" in logged[0][0]  # once, then only counted
    assert proposer.metrics.snapshot()["sampled_rows_capped"] == 3
    proposer.metrics.on_ring(ring.nbytes)
    samples = saguaro_samples()
    assert samples["vllm:saguaro_proposal_ring_bytes"] == ring.nbytes
    assert samples["vllm:saguaro_sampled_rows_capped_total"] >= 3
    proposer._last_probs = None
    ring.close()


@pytest.mark.engine
def test_engine_with_a_small_ring_caps_sampled_rows_and_reports_the_ring(tiny_pair):
    """A real engine whose ring (max_sampled_rows 2) is smaller than its sampled batch (6 rows): the rows
    beyond it go without drafts (counted), the others are still verified with exact q, every request
    completes, and /metrics carries the ring's reserved bytes."""
    import json
    import pathlib

    from engine_runs import Job, run_engine

    target, draft = tiny_pair
    vocab = json.loads((pathlib.Path(draft) / "config.json").read_text())["vocab_size"]
    spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3,
            "saguaro": {"mode": "sync", "max_sampled_rows": 2, "log_interval_s": 0}}
    prompts = ["def f(x):\n    return", "the quick brown fox", "import os\nimport", "for i in range(",
               "class A:\n    def", "print(\"hello"]
    params = [{"temperature": 1.0, "seed": i, "max_tokens": 24, "ignore_eos": True} for i in range(6)]
    run = run_engine(target, [Job("sampled", prompts, params)], speculative_config=spec,
                     engine_kwargs={"max_num_seqs": 8})["sampled"]
    assert run.saguaro["vllm:saguaro_proposal_ring_bytes"] == ring_bytes(2, 3, vocab)
    assert run.counter("vllm:saguaro_sampled_rows_capped") > 0
    assert run.spec.draft_tokens > 0 and run.spec.accepted > 0  # the rows that fit still speculate
    assert [len(t) for t in run.token_ids] == [24] * 6


def test_transport_choice_host_unless_both_sides_are_cuda_and_reach_each_other():
    """`proposal_transport: auto`: the device ring only where the drafter's GPU can write the target's."""
    from saguaro_vllm.shared.proposal_buffers import transport_for

    yes, no = (lambda a, b: True), (lambda a, b: False)
    assert transport_for("cpu", "cpu") == "host"
    assert transport_for("cuda:0", "cpu", yes) == "host"  # a CPU drafter: the host ring, one copy per step
    assert transport_for("cpu", "cuda:0", yes) == "host"
    assert transport_for("cuda:0", "cuda:0", no) == "device"  # the same GPU needs no peer access
    assert transport_for("cuda:0", "cuda:4", yes) == "device"
    assert transport_for("cuda:0", "cuda:4", no) == "host"
    assert transport_for("cuda:0", "cuda:4", lambda a, b: (a, b) == (0, 4)) == "host"  # both directions needed

    def invisible(a, b):
        raise AssertionError("Invalid peer device id")

    assert transport_for("cuda:0", "cuda:4", invisible) == "host"


def test_cuda_ipc_spec_round_trips_as_json(monkeypatch):
    """The device ring's handle travels in the drafter's bootstrap JSON: torch's `reduce_tensor` fields,
    bytes as base64, types by name, rebuilt into the same `rebuild_cuda_tensor` arguments (no pickle).
    Checked with torch's own functions replaced, since there is no GPU here (benchmarks/device_check.sh
    opens a real handle in a second process)."""
    import json

    import torch.multiprocessing.reductions as reductions

    from saguaro_vllm.shared.proposal_buffers import export_cuda_tensor, import_cuda_tensor

    args = (torch.Tensor, torch.Size([2, 3, 5, 7]), (105, 35, 7, 1), 0, torch.UntypedStorage, torch.float32, 3,
            b"\x00\x01handle\xff", 840, 0, False, b"refcounter", 64, b"event\x00", True)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, args))
    seen = {}
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: seen.setdefault("args", a))
    spec = json.loads(json.dumps(export_cuda_tensor(torch.empty(0))))
    import_cuda_tensor(spec)
    got = seen["args"]
    assert got[0] is torch.Tensor and got[4] is torch.UntypedStorage and got[5] is torch.float32
    assert tuple(got[1]) == tuple(args[1]) and tuple(got[2]) == args[2]
    assert got[6:] == (3, b"\x00\x01handle\xff", 840, 0, False, b"refcounter", 64, b"event\x00", True)
    assert got[3] == 0


def test_front_end_checks_only_the_header_for_a_device_ring(monkeypatch):
    """With the slots in GPU memory, /dev/shm only holds the header page: a 64 MiB /dev/shm is enough."""
    from saguaro_vllm.shared import proposal_buffers
    from saguaro_vllm.frontend import resolve
    from saguaro_vllm.frontend.config import parse_speculative_config

    cfg = parse_speculative_config({"method": "saguaro", "model": "x", "num_speculative_tokens": 5,
                                    "saguaro": {"proposal_transport": "device"}})[0]
    monkeypatch.setattr(proposal_buffers, "free_bytes", lambda d: 64 * 2**20)
    assert resolve.resolve_proposal_ring(cfg, 128256, 1024, "device")["bytes"] <= 4096
    with pytest.raises(Exception, match="max_sampled_rows"):
        resolve.resolve_proposal_ring(cfg, 128256, 1024, "host")
    assert resolve._ring_transport(cfg, "cuda:4", is_cpu_platform=False) == "device"
    assert resolve._ring_transport(cfg, "cpu", is_cpu_platform=True) == "host"


def test_put_rows_writes_each_row_where_its_q_goes(monkeypatch):
    """`put_rows` lands every (row, position) where `put` would, whether it copies row by row (q on the
    slot's device) or stacks and moves once (q elsewhere: taken on CPU by declaring the devices different)."""
    from saguaro_vllm.shared import proposal_buffers

    ring = ProposalRing.create(rows=4, k=3, vocab=11)
    try:
        items = [(5, [torch.full((11,), 1.0), torch.full((11,), 2.0)]), (2, torch.full((3, 11), 3.0))]
        for seq, stacked in ((1, False), (2, True)):
            calls = []
            monkeypatch.setattr(proposal_buffers, "_same_device", lambda a, b: not stacked)
            monkeypatch.setattr(SlotWriter, "put_positions", _spy(SlotWriter.put_positions, calls))
            writer = SlotWriter(ring, seq=seq)
            writer.put_rows(items)
            monkeypatch.undo()
            slot, rows = writer.finish()
            buf = ring.slot(slot)
            assert rows == [5, 2] and len(calls) == (1 if stacked else 0)
            assert (buf[0, 0] == 1).all() and (buf[0, 1] == 2).all() and (buf[1] == 3).all()
            ring.release_held()
    finally:
        ring.close()


def _spy(fn, calls):
    def spied(*a, **kw):
        calls.append(a)
        return fn(*a, **kw)
    return spied


def test_draft_positions_equal_the_loop_reference():
    rng = np.random.default_rng(0)
    for _ in range(50):
        drafts = [rng.integers(0, 100, int(rng.integers(0, 6))).tolist() for _ in range(int(rng.integers(0, 9)))]
        want = [(r, p, t) for r, d in enumerate(drafts) for p, t in enumerate(d)]
        rows, pos, toks = proposal_buffers.draft_positions(drafts)
        assert all(x.dtype == torch.long for x in (rows, pos, toks))
        assert list(zip(rows.tolist(), pos.tolist(), toks.tolist(), strict=True)) == want


def test_published_rows_follow_the_answer_order():
    """`mode: async` adds q' of hits first and of jit rows later; the slot rows still follow the answer rows,
    the batch's order, in which the target's sampler reads them without a copy (test_draft_prob_view.py)."""
    import types

    from saguaro_vllm.drafter.sync_drafter import SyncDrafter

    k, vocab = 2, 11
    ring = ProposalRing.create(rows=6, k=k, vocab=vocab)
    try:
        drafter = SyncDrafter.__new__(SyncDrafter)
        drafter.probs_ring, drafter.num_no_probs_slot = ring, 0
        req = types.SimpleNamespace(step=1, rows=[types.SimpleNamespace(req_id=f"r{i}") for i in range(5)])
        drafts = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
        probs = {}
        for i in (3, 1, 4, 0):  # hits 3 and 1, then jit rows 4 and 0
            probs[i] = [torch.full((vocab,), float(i))] * k
        slot, rows = drafter._publish_probs(req, drafts, probs, None)
        assert rows == [0, 1, 3, 4]
        assert [int(ring.slot(slot)[r, 0, 0]) for r in range(4)] == [0, 1, 3, 4]
    finally:
        ring.close()


def test_proposer_leaves_greedy_requests_rows_alone():
    """A batch mixing greedy and sampled requests: the greedy requests' rows keep whatever the slot held
    (vLLM never reads them), a sampled request with a deterministic (n-gram) draft still gets its one-hot
    row, the sampled rows their q; every drafted request has a row."""
    import types

    from saguaro_vllm.shared.transport import StepResponse
    from saguaro_vllm.worker.metrics import SaguaroMetrics
    from saguaro_vllm.worker.proposer import SaguaroProposer

    k, vocab = 2, 13
    ring = ProposalRing.create(rows=5, k=k, vocab=vocab)
    try:
        ring.slot(0).fill_(0.25)  # what earlier steps left
        w = SlotWriter(ProposalRing.attach(ring.spec()), seq=3)
        w.put(1, torch.full((k, vocab), 1.0 / vocab))
        slot, rows = w.finish()
        assert (slot, rows) == (0, [1])
        proposer = SaguaroProposer.__new__(SaguaroProposer)
        proposer.ring, proposer.k, proposer._capped_logged = ring, k, False
        req_ids = ["g0", "s1", "g2", "s3"]  # s3: sampled request, n-gram draft without q
        proposer.runner = types.SimpleNamespace(device=torch.device("cpu"),
                                                input_batch=types.SimpleNamespace(greedy_reqs={"g0", "g2"}))
        proposer.logger = types.SimpleNamespace(warning=lambda *a: None, info=lambda *a: None)
        proposer.metrics = SaguaroMetrics({}, proposer.logger)
        drafts = [[4, 5], [6, 7], [8, 9], [10, 11]]
        resp = StepResponse(3, [list(d) for d in drafts], {}, 0.0, probs_slot=slot, probs_rows=rows)
        assert proposer._take_probs(resp, drafts, [0, 1, 2, 3], req_ids) == 0
        probs, ids = proposer.take_last_draft_probs(), proposer.take_last_draft_prob_req_ids()
        assert ids == ["s1", "g0", "g2", "s3"] and probs.shape == (4, k, vocab)
        assert torch.equal(probs[0], torch.full((k, vocab), 1.0 / vocab))
        assert (probs[1] == 0.25).all() and (probs[2] == 0.25).all()  # untouched
        onehot = torch.zeros(k, vocab)
        onehot[0, 10] = onehot[1, 11] = 1.0
        assert torch.equal(probs[3], onehot)
    finally:
        ring.close()
