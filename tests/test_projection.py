"""The replay trace and the projection (docs/projection.md): a real SSD drafter run (tiny draft model, no
vLLM engine) records its trace; the recorder is bounded; replaying the trace under the run's own timings
takes the live run's decisions, hit for hit; the CLI commands run on such a trace."""
from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest
import torch

from saguaro_vllm.tools.cli import main as cli_main
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.round_planner import RoundPlanner
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
from saguaro_vllm.drafter.sync_drafter import SyncDrafter
from saguaro_vllm.drafter.trace import WIDTH, TraceRecorder, read_trace
from saguaro_vllm.projection.clocks import ModelClock, TraceClock
from saguaro_vllm.projection.cost_model import CostModel, from_trace
from saguaro_vllm.projection.replay import SSDReplay
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

K = 4


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def _outcome(model, context, drafts, rng) -> list[int]:
    """A target that accepts a random prefix and then usually picks the draft's best other token (a likely
    hit), sometimes its 2nd-4th best (a hit only with a wider fan-out), sometimes a random token (a miss)."""
    a = int(rng.integers(0, len(drafts) + 1))
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=64, block_size=16))
    runner.add_request("ref")
    logits = runner.forward([("ref", context + drafts[:a], 0)])[0, : model.config.vocab_size].clone()
    if a < len(drafts):
        logits[drafts[a]] = float("-inf")
    order = torch.argsort(logits, descending=True).tolist()
    u = rng.random()
    bonus = order[0] if u < 0.55 else order[int(rng.integers(1, 4))] if u < 0.8 else int(rng.integers(2, 300))
    if a < len(drafts) and bonus == drafts[a]:
        bonus = order[0]
    return drafts[:a] + [bonus]


def record_run(model, drafter, trace_path, rounds=14, seed=0, max_bytes=1 << 30, sampling=None) -> list[list[str]]:
    """Drive `drafter` like the server loop (answer, pre-draft between requests, cut short at random), with
    a trace; returns the live status of every step's rows."""
    rng = np.random.default_rng(seed)
    drafter.trace = TraceRecorder(trace_path, max_bytes, {"mode": "async" if isinstance(drafter, SSDDrafter)
                                                           else "sync", "k": K,
                                                           "options": getattr(drafter, "opts", {})})
    contexts = {r: list(map(int, rng.integers(2, 300, n))) for r, n in (("a", 23), ("b", 5), ("c", 40))}
    sent = dict.fromkeys(contexts, 0)
    statuses = []
    for step in range(1, rounds + 1):
        rows = []
        for rid, ctx in contexts.items():
            rows.append(RowUpdate(rid, sent[rid], ctx[sent[rid]:], K,
                                  (sampling or SamplingSpec()) if sent[rid] == 0 else None))
            sent[rid] = len(ctx)
        resp = drafter.step(StepRequest(step, rows, [], sent_at=time.monotonic()))
        drafter.answered()
        for _ in range(int(rng.integers(0, 12))):  # the next request comes after a random share of the pre-draft
            drafter.advance()
        statuses.append(list(resp.row_status))
        for row, drafts in zip(rows, resp.drafts):
            ctx = contexts[row.req_id]
            contexts[row.req_id] = ctx + (_outcome(model, ctx, drafts, rng) if drafts else [int(rng.integers(2, 300))])
    drafter.trace.close()
    return statuses


@pytest.fixture(scope="module")
def ssd_trace(draft_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "ssd.jsonl.gz"
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=256, block_size=16))
    # every round pre-drafts: this loop's "verification" is a random share of the pre-draft itself, which
    # the fallback would rightly judge too short for it (`test_replay_repeats_the_live_fallback`)
    drafter = SSDDrafter(runner, vocab_size=draft_model.config.vocab_size, options={"fallback": "off"})
    statuses = record_run(draft_model, drafter, path)
    return path, statuses


def test_replay_repeats_the_live_fallback(draft_model, tmp_path):
    """With the fallback on, the same loop pre-drafts in its first rounds, then measures that pre-drafting
    cannot pay here and drafts as `sync` does (every row jit, no glue forward), probing pre-drafting again
    later; the replay under the run's own timings takes the same decision in every round and repeats the
    rows' statuses (all but a few: a branch the live drafter lost to its KV cache's order of frees can be
    one the replay counts as ready)."""
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=256, block_size=16))
    drafter = SSDDrafter(runner, vocab_size=draft_model.config.vocab_size, options={})
    answers = []
    step = drafter.step
    drafter.step = lambda req: answers.append(step(req)) or answers[-1]
    path = tmp_path / "fallback.jsonl.gz"
    statuses = record_run(draft_model, drafter, path, rounds=40)
    header, steps = read_trace(path)
    modes = [a.ssd["predrafted"] for a in answers]
    assert modes[1] and modes.count(False) >= 3, modes  # pre-drafted first, then fell back
    glued = [any(f[0] == "glue" for f in s.get("fwd", [])) for s in steps]
    for n in range(1, len(steps)):
        if not modes[n]:  # the round before did not pre-draft: no glue ran, every row was drafted now
            assert not glued[n - 1] and set(statuses[n]) <= {"jit", "new"}, (n, statuses[n])
    result = SSDReplay(header, steps, TraceClock(steps)).run()
    assert [s["predrafted"] for s in result.per_step] == modes
    rows = [(a, b) for s, live in zip(result.per_step, statuses) for a, b in zip(s["status"], live)]
    assert sum(a == b for a, b in rows) >= 0.95 * len(rows), rows


def test_trace_records_outcomes_candidates_and_times(ssd_trace):
    path, statuses = ssd_trace
    header, steps = read_trace(path)
    assert header["mode"] == "async" and header["k"] == K and header["width"] == WIDTH
    assert len(steps) == len(statuses)
    assert [[r["st"] for r in s["rows"]] for s in steps] == statuses
    looked_up = [r for s in steps for r in s["rows"] if r["st"] in ("hit", "jit", "ngram")]
    assert looked_up and all(0 <= r["a"] <= r["k"] and r["t"] >= 0 for r in looked_up if r["a"] >= 0)
    glued = [s for s in steps if "cand" in next(iter(s.get("pre", {}).get("rows", {}).values()), {})]
    assert glued, "no pre-draft recorded its candidates"
    for s in glued:
        for row in s["pre"]["rows"].values():
            assert len(row["cand"]) == len(row["p"]) and all(len(c) == WIDTH for c in row["cand"])
            assert all(p == sorted(p, reverse=True) for p in row["p"])  # the predictor's order: best first
    phases = {f[0] for s in steps for f in s["fwd"]}
    assert {"glue", "now"} <= phases and all(f[3] > 0 for s in steps for f in s["fwd"])
    assert all(s["answer_s"] > 0 for s in steps) and any(s["verify_s"] > 0 for s in steps[1:])


def test_trace_is_bounded(draft_model, tmp_path):
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=256, block_size=16))
    drafter = SSDDrafter(runner, vocab_size=draft_model.config.vocab_size, options={"fanout_budget": 4})
    path = tmp_path / "small.jsonl.gz"
    record_run(draft_model, drafter, path, rounds=30, max_bytes=6000)
    assert drafter.trace.full
    assert path.stat().st_size < 6000 + 70000  # the bound plus at most one flushed block of the compressor
    header, steps = read_trace(path)  # what was written before the bound is readable
    assert header["k"] == K and 0 < len(steps) < 30


def test_tracing_off_by_default(draft_model):
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=64, block_size=16))
    assert SSDDrafter(runner, vocab_size=draft_model.config.vocab_size, options={}).trace is None
    assert TraceRecorder.open({"trace_dir": None}, {}) is None


def test_replay_under_the_live_timings_gives_the_live_hits(ssd_trace):
    """The issue's acceptance test: the replay of a recorded trace through the product's policy code, fed
    the run's own timings, hits and misses exactly where the live drafter did, row by row."""
    path, statuses = ssd_trace
    header, steps = read_trace(path)
    result = SSDReplay(header, steps, TraceClock(steps)).run()
    replayed = [s["status"] for s in result.per_step]
    assert replayed == statuses
    flat = [x for row in statuses for x in row]
    assert flat.count("hit") >= 3 and flat.count("jit") + flat.count("ngram") >= 3, flat  # both occurred
    plans = [s["plan"] for s in result.per_step if s["plan"]]
    live_plans = [s["pre"]["plan"] + [s["pre"]["pays"]] for s in steps if "plan" in s.get("pre", {})]
    assert plans == live_plans


def test_replay_measures_the_fanouts_coverage_as_the_live_run(draft_model, tmp_path, monkeypatch):
    """The branch-hit floor's parts (the share of planned rounds' outcomes within their planned fan-out,
    counted whether the branch steps ran or were skipped, and the share of covered outcomes that hit where
    they ran) come out of the replay as the live drafter measured them. Every third round skips its branch
    steps (the same rule in the live run and the replay, so that both kinds of round occur whatever this
    machine's timings), and the run has outcomes both within and outside the fan-out."""
    def every_third_skips(self, plan, batch, k):
        self.pay_calls = getattr(self, "pay_calls", 0) + 1
        return self.pay_calls % 3 != 0

    monkeypatch.setattr(RoundPlanner, "branches_pay_off", every_third_skips)
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=256, block_size=16))
    # every round pre-drafts (this loop's "verification" is a random share of the pre-draft itself, which
    # the fallback would rightly judge too short for it)
    drafter = SSDDrafter(runner, vocab_size=draft_model.config.vocab_size, options={"fallback": "off"})
    path = tmp_path / "skips.jsonl.gz"
    statuses = record_run(draft_model, drafter, path, rounds=30)
    header, steps = read_trace(path)
    pays = [s["pre"]["pays"] for s in steps if "plan" in s.get("pre", {})]
    assert pays.count(True) >= 5 and pays.count(False) >= 3, pays
    replay = SSDReplay(header, steps, TraceClock(steps))
    result = replay.run()
    assert [s["status"] for s in result.per_step] == statuses
    live, replayed = drafter.planner, replay.planner
    assert live.coverage is not None and 0.05 < live.coverage < 0.95
    assert replayed.coverage == pytest.approx(live.coverage) and replayed.completion == pytest.approx(live.completion)
    assert replayed.branch_hit_floor() == pytest.approx(live.branch_hit_floor())


def test_a_hit_sent_short_plans_the_next_predraft_for_the_drafts_wanted(draft_model, tmp_path, monkeypatch):
    """A hit whose branches were cut short is sent with fewer drafts than wanted when its top-up does not
    pay; the next pre-draft still plans branch steps for the drafts the next round wants (short rounds must
    not beget short rounds), live and in the replay: a replay planning for the short round's count (3 steps
    where the live run planned 5) parts from the run it replays. Here no top-up is ever drafted (the same
    rule live and in the replay), so every cut-short hit is sent short, and every round pre-drafts (this
    loop's "verification" is a random share of the pre-draft itself: the fallback would rightly stop it)."""
    def misses_only(self, candidates, base_tokens):
        return [c.row for c in candidates if not c.topup]

    monkeypatch.setattr(RoundPlanner, "draft_now", misses_only)
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=256, block_size=16))
    drafter = SSDDrafter(runner, vocab_size=draft_model.config.vocab_size, options={"fallback": "off"})
    path = tmp_path / "short.jsonl.gz"
    statuses = record_run(draft_model, drafter, path, rounds=30, seed=3)
    header, steps = read_trace(path)
    short = [n for n, s in enumerate(steps[:-1]) if any(r["st"] == "hit" and 0 < r["served"] < r["want"]
                                                        for r in s["rows"]) and "plan" in s.get("pre", {})]
    assert len(short) >= 2, short  # hits sent short, each followed by a planned pre-draft
    result = SSDReplay(header, steps, TraceClock(steps)).run()
    live_plans = [s["pre"]["plan"] + [s["pre"]["pays"]] if "plan" in s.get("pre", {}) else None for s in steps]
    assert [s["plan"] for s in result.per_step] == live_plans
    assert [s["status"] for s in result.per_step] == statuses


def test_replay_under_a_cost_model_runs_the_policy(ssd_trace):
    """Under the cost model fitted from the same trace (its JSON round trip included) the replay runs the
    policy on the virtual clock: every step after the first is timed and counted."""
    path, _ = ssd_trace
    header, steps = read_trace(path)
    cost = from_trace(header, steps)
    again = CostModel.from_json(json.loads(json.dumps(cost.to_json())))
    assert again.verify_s(3, 5.0) == pytest.approx(cost.verify_s(3, 5.0))
    result = SSDReplay(header, steps, ModelClock(cost)).run()
    assert result.steps == len(steps) - 1 and result.seconds > 0 and result.tokens > 0
    assert result.hit_rate is not None and sum(result.budgets.values()) > 0
    assert all(s["verify_s"] > 0 for s in result.per_step[1:])


def test_replay_follows_the_cost_model(ssd_trace):
    """The same trace under GPU-like costs (a draft forward nearly free of its rows): the planner's budget
    grows past 64 branches (up to what its rank model values, ~105 here; the cap, max_fanout_budget, is 128)
    and the cache hits at least as often as on this machine; with the
    recorded times shrunk, the replay no longer repeats the live decisions (the test above can fail)."""
    from saguaro_vllm.drafter.predictor import StepCostModel

    path, statuses = ssd_trace
    header, steps = read_trace(path)
    gpu = CostModel({1: {1.0: 0.05, 6.0: 0.052}, 64: {1.0: 0.06, 6.0: 0.08}}, StepCostModel(2e-3, 1e-6), {},
                    {}, "gpu-like")
    result = SSDReplay(header, steps, ModelClock(gpu)).run()
    live = SSDReplay(header, steps, TraceClock(steps)).run()
    assert max(result.budgets) > 64  # above the CPU-sized budgets and the cap before 2026-12-06 (64)
    assert result.hit_rate >= live.hit_rate
    shrunk = [{**s, "verify_s": 0.2 * s.get("verify_s", 0.0)} for s in steps]
    assert [s["status"] for s in SSDReplay(header, shrunk, TraceClock(shrunk)).run().per_step] != statuses


def test_sync_trace_records_accepted_counts(draft_model, tmp_path):
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=256, block_size=16))
    drafter = SyncDrafter(runner, vocab_size=draft_model.config.vocab_size)
    path = tmp_path / "sync.jsonl.gz"
    record_run(draft_model, drafter, path, rounds=6)
    header, steps = read_trace(path)
    rows = [r for s in steps[1:] for r in s["rows"]]
    assert header["mode"] == "sync" and all(0 <= r["a"] <= K for r in rows)
    assert all(r["served"] == K for s in steps for r in s["rows"])
    assert any(r["a"] < K for r in rows)


def test_cli_project_and_calibrate_from_trace(ssd_trace, tmp_path):
    path, _ = ssd_trace
    cost_path = tmp_path / "cost.json"
    assert cli_main(["calibrate", "--from-trace", str(path), "--out", str(cost_path)]) == 0
    cost = json.loads(cost_path.read_text())
    assert cost["draft_forward"]["source"] and cost["target_verify"]["points"]
    out = tmp_path / "proj"
    assert cli_main(["project", str(path), "--cost-model", str(cost_path), "--out", str(out),
                     "--batch-sizes", "1,4"]) == 0
    report = json.loads((out / "projection.json").read_text())["runs"][0]
    assert {p["batch"] for p in report["projected"]} == {1, 4}
    engines = {e["engine"] for e in report["projected"]}
    assert {"vllm-ar", "vllm-draft_model", "saguaro-sync", "saguaro-async"} <= engines
    assert report["measured"]["tokens_per_s"] > 0
    live = report["live_replay"]
    assert live["hit_rate"] == pytest.approx(report["measured"]["hit_rate"])


def test_cost_model_needs_sources_and_interpolates():
    obj = {"schema": 1, "target_verify": {"source": "measured", "points": [
        {"batch": 1, "tokens_per_row": 1, "s": 0.10}, {"batch": 1, "tokens_per_row": 6, "s": 0.15},
        {"batch": 4, "tokens_per_row": 1, "s": 0.12}, {"batch": 4, "tokens_per_row": 6, "s": 0.30}]},
        "draft_forward": {"source": "measured", "fixed_s": 0.01, "per_token_s": 0.002},
        "overheads": {"proposer_step_s": {"value": 0.003, "source": "measured"}}}
    cost = CostModel.from_json(obj)
    assert cost.verify_s(1, 3.5) == pytest.approx(0.125)
    assert cost.verify_s(2, 1.0) == pytest.approx(0.10 + 0.02 / 3)  # between the batches
    assert cost.verify_s(4, 11.0) == pytest.approx(0.48)  # extrapolated along the last segment
    assert cost.forward_s(3, 3) == pytest.approx(0.016) and cost.overhead("proposer", 8) == 0.003
    for broken in ({**obj, "draft_forward": {**obj["draft_forward"], "source": ""}},
                   {**obj, "overheads": {"proposer_step_s": {"value": 0.003}}},
                   {**obj, "overheads": {"made_up_s": {"value": 1, "source": "x"}}}):
        with pytest.raises(ValueError):
            CostModel.from_json(broken)


def _b1_steps(n: int) -> list[dict]:
    """A batch-1 trace without timings: a new request (a 7-token prompt), then neural rounds whose accepted
    count cycles through 0..5."""
    steps = [{"step": 0, "rows": [{"id": "r", "st": "new", "new": 1, "feed": 7, "want": 5, "nd": 5}]}]
    for i in range(1, n):
        steps.append({"step": i, "rows": [{"id": "r", "st": "jit", "a": i % 6, "k": 5, "rank": 0, "new": i % 6 + 1,
                                           "fast": False, "want": 5, "nd": 5, "served": 5}]})
    return steps


def test_tile_gives_a_steps_rows_the_outcomes_of_other_steps():
    """A batch tiled from a batch-1 trace: each copy runs the trace from another step, so one step's rows do
    not all share one outcome (with 64 copies of one outcome per step, one step of a=0 read as acceptance
    0.00 and SSD projected at 0.67x `sync` at batch 64, T=1); each copy is one request per pass."""
    from saguaro_vllm.projection.engines import tile

    steps = _b1_steps(12)
    tiled = tile(steps, 4)
    assert len(tiled) == 12 and all(len(s["rows"]) == 4 for s in tiled)
    assert all(len({r.get("a") for r in s["rows"]}) > 1 for s in tiled)
    for s in tiled:
        assert len({r["id"] for r in s["rows"]}) == 4
    copy1 = [next(r for r in s["rows"] if r["id"].startswith("r#1")) for s in tiled]  # starts 3 steps in
    assert [r.get("a") for r in copy1] == [3, 4, 5, 0, 1, 2, 3, 4, 5, None, 1, 2]
    assert copy1[9]["st"] == "new" and copy1[9]["id"] == "r#1.1" and copy1[8]["id"] == "r#1"
    assert [r.get("a") for r in tile(steps, 1)[3]["rows"]] == [3]  # one copy: the trace as it is


def test_sync_projection_feeds_a_new_requests_prompt_and_counts_no_tokens_for_it():
    """`sync` and `draft_model` count the tokens the SSD replay and `measured` count: none for a request's
    first step (its prefill), whose first draft forward feeds its prompt."""
    from saguaro_vllm.projection.engines import project_spec

    cost = CostModel.from_json({"schema": 1, "target_verify": {"source": "assumed", "points": [
        {"batch": 1, "tokens_per_row": 1, "s": 0.01}, {"batch": 1, "tokens_per_row": 6, "s": 0.01}]},
        "draft_forward": {"source": "assumed", "fixed_s": 0.001, "per_token_s": 0.001}})
    steps = _b1_steps(6)
    steps.insert(3, {"step": 99, "rows": [{"id": "q", "st": "new", "new": 1, "feed": 50, "want": 5, "nd": 5}]})
    out = project_spec("saguaro-sync", steps, 5, cost)
    tokens = sum(i % 6 + 1 for i in (1, 2, 3, 4, 5))  # the new request's step adds none
    # 6 periods, each the drafting after the step before (the first one's: its 7-token prompt; none after
    # the last step) plus a verification
    seconds = 6 * 0.01 + 6 * 5 * 0.001 + 0.001 * (7 + 1 + 1 + 50 + 1 + 1) + 0.001 * 4 * 6
    assert out["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-3)


def test_a_short_round_whose_drafts_were_all_accepted_gets_a_recorded_rank():
    """A round of fewer than K drafts (a cut-short hit sent short) whose drawn outcome accepted more than it
    has: all its drafts accepted, and the rank of a recorded round whose drafts were all accepted (its
    bonus, like theirs, follows the target with nothing excluded), not "no rank", which never hit."""
    from saguaro_vllm.projection.replay import OutcomePool

    rows = [{"id": "r", "st": "hit", "a": 5, "k": 5, "rank": 2, "t": 7}]
    pool = OutcomePool([{"rows": rows}, {"rows": [{**rows[0], "a": 1, "rank": 0}]}], seed=1)
    draws = {pool.draw(False, 3)[:2] for _ in range(40)}
    assert draws == {(3, 2), (1, 0)}


def _write_trace(path, steps, mode="sync"):
    path.write_text("\n".join(json.dumps(x) for x in [{"kind": "header", "version": 1, "mode": mode, "k": 5},
                                                        *({"kind": "step", **s} for s in steps)]) + "\n")
    return str(path)


def _timed_steps(n: int, verify_s: float, forward_s: float, prefill_at: int | None = None) -> list[dict]:
    """A batch-1 `sync` trace: a new request, then n drafted steps (verify_s each, 5 one-row forwards of
    forward_s, 4 of 5 drafts accepted); at `prefill_at` a second request joins, whose verification also
    holds its prefill (0.9 s)."""
    steps = [{"step": 0, "rows": [{"id": "r", "st": "new", "new": 7, "served": 5}], "verify_s": 0.9,
              "fwd": [["now", 7, 1, forward_s]] + [["now", 1, 1, forward_s]] * 4, "answer_s": 5 * forward_s}]
    for i in range(1, n + 1):
        rows = [{"id": "r", "st": "drafted", "a": 4, "k": 5, "new": 5, "served": 5}]
        if prefill_at is not None and i >= prefill_at:
            rows.append({"id": "q", "st": "new" if i == prefill_at else "drafted", "a": 4, "k": 5, "new": 5,
                         "served": 5})
        steps.append({"step": i, "rows": rows, "verify_s": 0.9 if i == prefill_at else verify_s,
                      "fwd": [["now", 1, 1, forward_s]] * 5, "answer_s": 5 * forward_s})
    return steps


def test_a_verification_that_holds_a_prefill_is_no_sample(tmp_path):
    """A step with a new row: its verify_s also holds that prompt's prefill (0.86-0.93 s against 0.10-0.13 s
    in the 2026-12-06 demo-pair traces), which no verify curve or replay step models. It is neither a sample
    of the trace's own verification nor of the calibrated spread (one per trace raised the pooled factor by
    9 % and a trace's own mean verification by 13 %)."""
    from saguaro_vllm.projection.calibrate import jitter_from_traces

    steps = _timed_steps(12, 0.1, 0.01, prefill_at=6)
    own = from_trace({"mode": "sync"}, steps)
    assert own.verify_s(1, 6) == pytest.approx(0.1) and own.verify_s(2, 6) == pytest.approx(0.1)
    assert max(own.jitter["target_verify"]) == pytest.approx(1.0)
    cost = CostModel({1: {6.0: 0.2}}, own.draft, {}, {})
    jitter = jitter_from_traces([_write_trace(tmp_path / "t.jsonl", steps)], cost)
    assert jitter["target_verify"] == pytest.approx([0.5] * len(jitter["target_verify"]))


def test_the_calibrated_spread_weighs_each_run_the_same(tmp_path):
    """Runs of different lengths and loads: the spread's mean is the mean of the runs' means (a long run at a
    burst of load no longer sets the level: in the demo-pair traces of 2026-12-06 the async T=1 run, 638 of
    1808 forwards at a mean factor of 1.57, raised the pooled forward factor to 1.32 where three runs measured
    1.17-1.20), and its spread is each run's own spread around its mean."""
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.calibrate import jitter_from_traces

    short = _write_trace(tmp_path / "a.jsonl", _timed_steps(4, 0.1, 0.01))
    long_steps = _timed_steps(40, 0.2, 0.02)
    for i, s in enumerate(long_steps):  # within the long run: forwards alternate 0.015 / 0.025 s
        s["fwd"] = [[f[0], f[1], f[2], 0.015 if (i + j) % 2 else 0.025] for j, f in enumerate(s["fwd"])]
    long_ = _write_trace(tmp_path / "b.jsonl", long_steps)
    cost = CostModel({1: {6.0: 0.1}}, StepCostModel(0.01, 0.0), {}, {})
    jitter = jitter_from_traces([short, long_], cost)
    mean = {k: sum(v) / len(v) for k, v in jitter.items()}
    assert mean["draft_forward"] == pytest.approx(1.5, rel=1e-3)  # runs at 1.0 and 2.0; pooled raw: 1.9
    assert mean["target_verify"] == pytest.approx(1.5, rel=1e-3)
    assert min(jitter["draft_forward"]) == pytest.approx(1.5 * 0.75, rel=1e-2)
    assert max(jitter["draft_forward"]) == pytest.approx(1.5 * 1.25, rel=1e-2)


def test_sync_projection_counts_the_periods_measured_counts(tmp_path):
    """`sync` under the trace's own exact costs gives the trace's tokens/s: each period is the drafting after
    the step before plus a verification, so the drafting after the first counted step (here the prompt's,
    which a `sync` trace records as the new row's `new` tokens: it has no `feed`) is in and none after the
    last. Before 2026-12-06 the prompt's drafting was left out and fed 1 token."""
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.engines import measured, project_spec

    steps = _timed_steps(10, 0.1, 0.01)
    steps[0]["fwd"][0][3] = 0.06  # the prompt's forward: 7 tokens
    steps[0]["answer_s"] = 0.1
    t = 0.0
    for s in steps:
        s["t"] = t
        t += s["answer_s"] + 0.1  # the answer, then the next verification
    cost = CostModel({1: {6.0: 0.1}}, StepCostModel(0.01 - 0.05 / 6, 0.05 / 6), {}, {"target_verify": "x"})
    assert cost.forward_s(7, 1) == pytest.approx(0.06) and cost.forward_s(1, 1) == pytest.approx(0.01)
    m = measured({"mode": "sync"}, steps)
    assert project_spec("saguaro-sync", steps, 5, cost)["tokens_per_s"] == pytest.approx(m["tokens_per_s"], rel=1e-6)


def test_per_request_rates_count_each_requests_own_span(tmp_path):
    """Per-sequence tokens/s as the engine counts them (each request's tokens after its first over the time
    from its first token to its last), in the trace and in the projection: with requests ending at different
    steps this is not the batch's tokens/s over the batch size, which put vLLM AR (whose requests all run to
    the end) ahead of `sync` at batch 16 in the projection while it was behind in the runs (2026-12-06)."""
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.engines import measured, per_request_rate, project_spec

    steps = _timed_steps(10, 0.1, 0.01, prefill_at=3)  # r from step 0, q joins at step 3
    for s in steps[8:]:  # r ends at step 7, q runs on alone to step 10
        s["rows"] = [r for r in s["rows"] if r["id"] != "r"]
    cost = CostModel({1: {6.0: 0.1}, 2: {6.0: 0.1}}, StepCostModel(0.005, 0.005), {}, {"target_verify": "x"})
    t, prev = 0.0, None
    for s in steps:  # the trace's clock: the drafting after the step before, then a verification
        if prev is not None:
            feed = sum(r.get("new", 1) if r["st"] == "new" else 1 for r in prev["rows"])
            t += cost.forward_s(feed, len(prev["rows"])) + 4 * cost.forward_s(len(prev["rows"]), len(prev["rows"])) + 0.1
        s["t"], prev = t, s
    m = measured({"mode": "sync"}, steps)
    r_rate = 7 * 5 / (steps[7]["t"] - steps[0]["t"])
    q_rate = 7 * 5 / (steps[10]["t"] - steps[3]["t"])
    assert m["per_request_tokens_per_s"] == pytest.approx((r_rate + q_rate) / 2, abs=1e-3)
    assert m["per_request_tokens_per_s"] > 1.2 * m["tokens_per_s"] / 2  # not the batch's rate over its size
    proj = project_spec("saguaro-sync", steps, 5, cost)
    assert proj["per_request_tokens_per_s"] == pytest.approx(m["per_request_tokens_per_s"], abs=1e-3)
    # a request whose first step came before the counted ones is left out
    times = [s["t"] for s in steps]
    tokens = [[0 if r["st"] == "new" else r["new"] for r in s["rows"]] for s in steps]
    assert per_request_rate(steps, times, tokens, count_from=1) == pytest.approx(q_rate, abs=1e-3)


def test_the_ssd_replay_under_live_timings_gives_the_live_per_request_rate(ssd_trace):
    from saguaro_vllm.projection.engines import live_replay, measured

    path, _ = ssd_trace
    header, steps = read_trace(path)
    m = measured(header, steps)
    assert m["per_request_tokens_per_s"] is not None
    assert live_replay(header, steps)["per_request_tokens_per_s"] == pytest.approx(m["per_request_tokens_per_s"],
                                                                                   rel=1e-3)


def test_the_draft_forward_is_timed_at_its_least_disturbed():
    """Another job's load only slows a forward: the calibration keeps the least of interleaved passes per
    row count, so a burst during one row count does not bend the fitted shape (one pass on 2026-12-06 gave
    8.8 ms at 8 rows against 15.3 ms at 1 row: a fit of 0.02 ms per row)."""
    from saguaro_vllm.projection.calibrate import least_disturbed

    calls = []

    def timer(rows):  # 5 ms + 1 ms per row; the 2nd and 4th calls caught in a burst of load
        calls.append(rows)
        return (0.005 + 0.001 * rows) * (3.0 if len(calls) in (2, 4) else 1.0)

    points = least_disturbed(timer, [1, 2, 4], passes=3)
    assert calls == [1, 2, 4] * 3
    assert [p["s"] for p in points] == pytest.approx([0.006, 0.007, 0.009])


def _at_temperature(steps: list[dict], temp: float) -> list[dict]:
    for s in steps:
        for r in s["rows"]:
            r["temp"] = temp
    return steps


def test_the_verification_is_calibrated_per_temperature_and_batch(tmp_path):
    """At batch 16 on this CPU Saguaro's all-greedy verification took ~250 ms and the sampled one ~460 ms
    (2026-12-06): one factor pooled over temperatures cannot hold both. The calibration measures the traced
    verification over the verify curve per temperature and batch (each run weighing the same), a run replays
    under its own temperature's factors (nearest measured temperature of the same kind, held at the batch
    ends), and the factors survive the JSON."""
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.calibrate import temperature_factors

    curve = {1: {6.0: 0.1}}
    traces = [_write_trace(tmp_path / "g.jsonl", _at_temperature(_timed_steps(8, 0.05, 0.01), 0.0)),
              _write_trace(tmp_path / "s1.jsonl", _at_temperature(_timed_steps(8, 0.2, 0.01), 1.0)),
              _write_trace(tmp_path / "s2.jsonl", _at_temperature(_timed_steps(30, 0.3, 0.01), 1.0))]
    factors = temperature_factors(traces, curve)
    assert factors[0.0] == {1: pytest.approx(0.5)}
    assert factors[1.0] == {1: pytest.approx(2.5)}  # the runs' 2.0 and 3.0, each weighing the same

    cost = CostModel({1: {6.0: 0.1}, 16: {6.0: 0.4}}, StepCostModel(0.01, 0.0), {}, {"target_verify": "x"},
                     temperature_factors={0.0: {1: 0.5, 4: 0.8}, 1.0: {1: 1.0, 16: 2.0}})
    assert cost.at_temperature(0.0).verify_s(1, 6) == pytest.approx(0.05)
    assert cost.at_temperature(0.0).verify_s(16, 6) == pytest.approx(0.4 * 0.8)  # held at batch 4's
    assert cost.at_temperature(0.7).verify_s(16, 6) == pytest.approx(0.8)  # the nearest sampled: T=1
    assert cost.at_temperature(0.7).at_temperature(0.7).verify_s(16, 6) == pytest.approx(0.8)  # applied once
    assert CostModel(cost.verify, cost.draft, {}, {}).at_temperature(1.0).verify_s(16, 6) == pytest.approx(0.4)
    with pytest.raises(ValueError):  # every number needs its source
        CostModel.from_json(cost.to_json())
    cost.sources["draft_forward"] = cost.sources["target_verify.by_temperature"] = "measured"
    again = CostModel.from_json(cost.to_json())
    assert again.temperature_factors == cost.temperature_factors


def test_ssds_verification_beside_its_predraft_is_its_own_factor(tmp_path):
    """On a machine whose drafter shares hardware with the target (2026-12-06 evening, 2 cores: SSD's
    verification 132-152 ms at batch 1 while its pre-draft ran beside it, `sync`'s 113-123 ms, whose drafter
    waits meanwhile), one factor per temperature and batch for both modes projected `sync` low and SSD
    high. The temperature factors come from the `sync` runs; SSD's runs give `drafting_factors` per batch
    (each run weighing the same), which the model keeps through its JSON, the replay's clock applies to
    every SSD verification, and the spread is taken over."""
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.calibrate import (drafting_factors, jitter_from_traces, plain_traces,
                                                   temperature_factors)

    curve = {1: {6.0: 0.1}}
    sync = _write_trace(tmp_path / "sync.jsonl", _at_temperature(_timed_steps(10, 0.1, 0.01), 1.0))
    ssd = [_write_trace(tmp_path / f"ssd{i}.jsonl", _at_temperature(_timed_steps(n, v, 0.01), 1.0), "async")
           for i, (n, v) in enumerate(((20, 0.13), (8, 0.15)))]  # two runs at 1.3 and 1.5
    traces = [sync, *ssd]
    assert plain_traces(traces) == [sync] and plain_traces(ssd) == ssd
    factors = temperature_factors(plain_traces(traces), curve)
    assert factors == {1.0: {1: pytest.approx(1.0)}}  # not pulled up by SSD's verifications
    cost = CostModel(curve, StepCostModel(0.01, 0.0), {}, {"target_verify": "x", "draft_forward": "y"},
                     temperature_factors=factors)
    assert drafting_factors(traces, cost) == {1: pytest.approx(1.4)}  # the runs' 1.3 and 1.5, each the same
    assert drafting_factors([sync], cost) == {}  # a `sync` drafter waits during the verification
    # the spread's level (the mean of the runs' means over the model) is 1 with the factor in SSD's model:
    # the runs' 1.0, 1.3 / 1.4 and 1.5 / 1.4; without it (1.0 + 1.3 + 1.5) / 3
    assert statistics.mean(jitter_from_traces(traces, cost)["target_verify"]) == pytest.approx(2.8 / 3 + 1 / 3)
    cost.drafting_factors = {1: 1.4, 16: 1.0}
    assert cost.drafting_factor(4) == pytest.approx(1.4 - 0.4 * 3 / 15) and cost.drafting_factor(64) == 1.0
    assert statistics.mean(jitter_from_traces(traces, cost)["target_verify"]) == pytest.approx(1.0)
    with pytest.raises(ValueError):  # every number needs its source
        CostModel.from_json(cost.to_json())
    cost.sources["target_verify.while_drafting"] = "measured"
    cost.sources["target_verify.by_temperature"] = "measured"
    again = CostModel.from_json(cost.to_json())
    assert again.drafting_factors == {1: pytest.approx(1.4), 16: pytest.approx(1.0)}
    for model, verify_s in ((again.at_temperature(1.0), 0.14), (CostModel(curve, cost.draft, {}, {}), 0.1)):
        clock = ModelClock(model)
        clock.next_request(1, [5])
        assert clock.round(1, None)[0] == pytest.approx(verify_s)


def test_ssds_draft_forwards_have_their_own_spread(tmp_path):
    """Where the drafter shares hardware with the target, SSD's forwards (beside the verification) run slower
    than `sync`'s (2026-12-06 evening: 1.2-1.5x the timed model against 1.1-1.25x): the spread is kept per
    mode, `sync` and `draft_model` take `draft_forward` (the `sync` runs'), the SSD replay's clock draws from
    `draft_forward.ssd`; with runs of one mode only, both are theirs; the key survives the JSON."""
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.calibrate import jitter_from_traces

    sync = _write_trace(tmp_path / "sync.jsonl", _timed_steps(10, 0.1, 0.01))
    ssd = [_write_trace(tmp_path / f"ssd{i}.jsonl", _timed_steps(n, 0.1, f), "async")
           for i, (n, f) in enumerate(((20, 0.013), (8, 0.015)))]
    cost = CostModel({1: {6.0: 0.1}}, StepCostModel(0.01, 0.0), {}, {"target_verify": "x", "draft_forward": "y"})
    jitter = jitter_from_traces([sync, *ssd], cost)
    assert statistics.mean(jitter["draft_forward"]) == pytest.approx(1.0)
    assert statistics.mean(jitter["draft_forward.ssd"]) == pytest.approx(1.4)  # each run weighing the same
    only_ssd = jitter_from_traces(ssd, cost)
    assert statistics.mean(only_ssd["draft_forward"]) == pytest.approx(1.4) == statistics.mean(
        only_ssd["draft_forward.ssd"])
    assert set(jitter_from_traces([sync], cost)) == {"target_verify", "draft_forward"}

    cost.jitter = jitter
    for k in jitter:
        cost.sources[f"jitter.{k}"] = "measured"
    again = CostModel.from_json(cost.to_json())
    assert statistics.mean(again.jitter["draft_forward.ssd"]) == pytest.approx(1.4, abs=1e-3)
    glue = [ModelClock(again, seed=i).glue_forward(1, [_Rnd()])[2] for i in range(40)]
    assert min(glue) >= 0.0129 and max(glue) <= 0.0151  # SSD's runs' forwards, not `sync`'s (0.01)
    again.jitter.pop("draft_forward.ssd")
    assert ModelClock(again, seed=0).glue_forward(1, [_Rnd()])[2] == pytest.approx(0.01, abs=1e-4)


class _Rnd:
    """A round as the clock's glue forward reads it: a neural round of 5 drafts."""
    k, fast = 5, False


def _predraft_steps(rows: list[int], host_s: float, row_s: float, branch_s: float = 0.01) -> list[dict]:
    """An SSD trace at batch 1 whose round i plans 5 branch steps of `rows[i]` rows and is cut short after 3
    by the next request: that request's verify_s + late_s = glue + 3 branch steps + the pre-draft's time
    beyond its forwards (host_s + row_s per branch row). Step 0's verification holds the prompt's prefill."""
    steps = []
    for i, r in enumerate(rows):
        busy = 0.01 + 3 * branch_s + host_s + row_s * rows[i - 1] if i else 0.9
        steps.append({"step": i, "rows": [{"id": "q", "st": "new" if i == 0 else "hit", "a": 2, "k": 5, "new": 3,
                                           "served": 5}],
                      "verify_s": busy - 0.002 if i else busy, "late_s": 0.002 if i else 0.0,
                      "fwd": [["glue", 1, 1, 0.01]] + [["branch", r, r, branch_s]] * 3, "answer_s": 0.001,
                      "pre": {"plan": [r, 5], "pays": True, "k": 5, "batch": 1, "steps_done": 3}})
    return steps


def test_the_predrafts_time_beyond_its_forwards_is_measured_and_spent(tmp_path):
    """The pre-draft's planning, candidates and forks (and a trace's recording of candidates) take time
    beyond its forwards: in the demo-pair traces of 2026-12-06/07 about 5.7 ms + 0.2 ms per branch row (9 ms
    at batch 1, ~50 ms at batch 16). It is measured from the rounds the next request cut short (busy from
    the answer to that request), fitted per round and branch row (own costs and `calibrate` alike), and the
    replay's clock spends it before the branch steps, which then fit fewer steps into a verification."""
    from saguaro_vllm.projection.calibrate import overheads_from_traces
    from saguaro_vllm.projection.cost_model import predraft_host_samples

    steps = _predraft_steps([8, 40] * 6, 0.006, 0.0002)
    samples = predraft_host_samples(steps)
    assert len(samples) == 11  # the last round has no request after it
    assert {r for r, _ in samples} == {8, 40}
    assert all(sec == pytest.approx(0.006 + 0.0002 * r) for r, sec in samples)
    finished = [dict(s, pre={**s["pre"], "steps_done": 5}) for s in steps]  # idle time unknown: no sample
    assert predraft_host_samples(finished) == []
    own = from_trace({"mode": "async"}, steps)
    assert own.overheads["predraft_step_s"] == pytest.approx(0.006)
    assert own.overheads["predraft_row_s"] == pytest.approx(0.0002)
    overheads, _ = overheads_from_traces([_write_trace(tmp_path / "a.jsonl", steps, "async")], None)
    assert overheads["predraft_step_s"] == pytest.approx(0.006) and overheads["predraft_row_s"] == pytest.approx(0.0002)
    assert CostModel.from_json(own.to_json()).overheads["predraft_row_s"] == pytest.approx(0.0002)

    from saguaro_vllm.drafter.predictor import StepCostModel

    def steps_done(overheads: dict) -> int:
        cost = CostModel({1: {6.0: 0.105}}, StepCostModel(0.01, 0.0), overheads, {"target_verify": "x"})
        clock = ModelClock(cost)
        clock.next_request(1, [5])
        clock.glue_forward(1, [_Rnd()])
        return clock.round(1, {"roots": ["r"], "steps": 20, "rows": 40})[2]["steps_done"]

    # 105 ms of verification, a 10 ms glue, 10 ms branch steps (the last one started runs on: lateness): 10
    # without the pre-draft's own time, 9 after 6 ms + 40 x 0.2 ms of it
    assert steps_done({}) == 10
    assert steps_done({"predraft_step_s": 0.006, "predraft_row_s": 0.0002}) == 9


def test_a_sync_projection_replays_under_its_temperatures_verification(tmp_path):
    """A sampled `sync` trace is projected with the sampled verification, a greedy one with the greedy; the
    sync drafter records each row's temperature for it. vLLM's engines keep the curve (their own path)."""
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.engines import project_ar, project_spec

    cost = CostModel({1: {1.0: 0.05, 6.0: 0.1}}, StepCostModel(0.001, 0.0), {}, {},
                     temperature_factors={0.0: {1: 1.0}, 1.0: {1: 3.0}})
    greedy = project_spec("saguaro-sync", _at_temperature(_timed_steps(8, 0.1, 0.01), 0.0), 5, cost)
    sampled = project_spec("saguaro-sync", _at_temperature(_timed_steps(8, 0.1, 0.01), 1.0), 5, cost)
    assert greedy["tokens_per_s"] == pytest.approx(5 / (0.1 + 0.005), rel=1e-3)
    assert sampled["tokens_per_s"] == pytest.approx(5 / (0.3 + 0.005), rel=1e-3)
    other = project_spec("vllm-draft_model", _at_temperature(_timed_steps(8, 0.1, 0.01), 1.0), 5, cost)
    assert other["tokens_per_s"] == pytest.approx(greedy["tokens_per_s"], rel=1e-3)
    assert project_ar(1, cost)["tokens_per_s"] == pytest.approx(20.0)


def test_a_sync_trace_records_each_rows_temperature(draft_model, tmp_path):
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=256, block_size=16))
    drafter = SyncDrafter(runner, vocab_size=draft_model.config.vocab_size)
    path = tmp_path / "sync.jsonl.gz"
    record_run(draft_model, drafter, path, rounds=3, sampling=SamplingSpec(temperature=0.7, seed=3))
    _, steps = read_trace(path)
    assert [r["temp"] for s in steps for r in s["rows"]] == [0.7] * 9


def test_a_branch_step_costs_its_requests_rows_and_what_each_further_branch_adds(tmp_path):
    """On a CPU a branch step reads each request's prefix once: 128 rows over 16 requests cost 16 requests'
    own rows plus 112 forked rows' extra (66 ms measured on 2026-12-06, where the forks of one request alone
    were timed at 43 ms and the requests' own rows at 1.8 ms per row). The replay's pre-draft steps use it with
    the number of roots; a trace's own model fits it on what its branch steps took beyond their requests."""
    from saguaro_vllm.drafter.predictor import StepCostModel

    own = StepCostModel(0.0043, 0.0018)
    cost = CostModel({1: {6.0: 0.1}}, own, {}, {}, branch=StepCostModel(0.0002, 0.0003))
    assert cost.branch_step_s(128, 16) == pytest.approx(own.step_s(16) + 0.0002 + 112 * 0.0003)
    assert cost.branch_step_s(8, 1) == pytest.approx(own.step_s(1) + 0.0002 + 7 * 0.0003)
    assert cost.branch_step_s(4, 9) == pytest.approx(own.step_s(4) + 0.0002)  # never more parents than rows
    assert CostModel({1: {6.0: 0.1}}, own, {}, {}).branch_step_s(128, 16) == pytest.approx(own.step_s(128))
    cost.sources.update(target_verify="x", draft_forward="x", branch_forward="x")
    assert CostModel.from_json(cost.to_json()).branch == cost.branch

    clock = ModelClock(cost, finish_predraft=True)
    clock.next_request(16, [5] * 16)
    _, _, pre = clock.round(1, {"roots": [f"r{i}" for i in range(16)], "steps": 2, "rows": 128})
    assert [f[2] for f in pre["forwards"]] == pytest.approx([cost.branch_step_s(128, 16)] * 2)

    steps = _timed_steps(6, 0.1, 0.0043 + 0.0018)  # one request's own one-row forwards: 6.1 ms
    for i, s in enumerate(steps[1:], 1):  # and a pre-draft of 1 + 2i rows after each answer
        s["pre"] = {"batch": 1}
        s["fwd"].append(["branch", 1 + 2 * i, 1 + 2 * i, 0.0061 + 0.0002 + 2 * i * 0.0003])
    fitted = from_trace({"mode": "async"}, steps)
    assert fitted.branch.fixed_s == pytest.approx(0.0002, abs=1e-6)
    assert fitted.branch.per_row_s == pytest.approx(0.0003, rel=1e-3)


def test_the_calibration_times_requests_rows_and_forked_rows_apart(tiny_pair):
    """`measure_draft` times requests of their own (`distinct_step_s`) and branches forked from one
    (`step_s`) on the drafter's runner and returns each fit; the branch model is what forks add beyond one
    request's own row (`CostModel.branch_step_s`)."""
    from saguaro_vllm.projection import calibrate as cal

    own, points, extra, forked = cal.measure_draft(str(tiny_pair[1]), [1, 2, 4], prefix=40, reps=1, passes=1,
                                                   branch_rows=[1, 4, 8], dtype="float32")
    assert [p["rows"] for p in points] == [1, 2, 4] and [p["rows"] for p in forked] == [1, 4, 8]
    assert all(p["s"] > 0 for p in points + forked)
    forks = cal.StepCostModel.fit_forwards([(p["rows"], p["rows"], p["s"]) for p in forked])
    assert extra.per_row_s == forks.per_row_s and extra.fixed_s == max(0.0, forks.step_s(1) - own.step_s(1))
