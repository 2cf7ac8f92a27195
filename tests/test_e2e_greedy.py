"""Greedy exactness through `vllm.LLM`: Saguaro's output equals the same engine without speculation, token
for token, in `mode: sync` and in `mode: async` (SSD), at batch 1, 4 and 16 with prompts of different
lengths, chunked prefill and continuous batching (requests arriving as others finish), with a drafter
slower than the target and with a drafter KV cache far too small for the batch, and speculation really
happened: drafts accepted and, in SSD, hits, misses, cut-short pre-drafts and top-ups, rows without room."""
from __future__ import annotations

import pytest

from engine_runs import Job, run_engine

pytestmark = pytest.mark.engine

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "for i in range(10):\n    print(",
    "import os\nimport sys\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n    def norm(self):",
    "x",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
    "print(os.getcwd(), sys.argv)",
    "return a + b\n" * 6,
    "class",
    # Longer than max_num_batched_tokens: prefilled in chunks, so the proposer sees rows with no sampled
    # tokens (it must return [] for them) while other requests decode.
    "def f(x):\n    return [i * x for i in range(x) if i % 3]\n" * 5,
]
# Small token budget: forces chunked prefill of the long prompt beside decoding requests.
ENGINE = {"max_num_batched_tokens": 96, "max_num_seqs": 16}
GREEDY = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
# 20 requests of different lengths for 16 sequence slots: the last ones arrive as the first ones finish.
MIXED = [{"temperature": 0.0, "max_tokens": 16 + 9 * (i % 5), "ignore_eos": True} for i in range(20)]


def _jobs():
    return [
        Job("batch", PROMPTS, GREEDY),
        Job("batch1", PROMPTS[:4], GREEDY, sequential=True),
        Job("batch4", PROMPTS[4:8], GREEDY),
        Job("batch16", (PROMPTS * 2)[:20], MIXED),
    ]


def _spec(tiny_pair, mode: str, **options):
    return {"method": "saguaro", "model": tiny_pair[1], "num_speculative_tokens": 4,
            "saguaro": {"mode": mode, "log_interval_s": 1, **options}}


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return run_engine(tiny_pair[0], _jobs(), engine_kwargs=ENGINE)


@pytest.fixture(scope="module")
def saguaro(tiny_pair):
    return run_engine(tiny_pair[0], _jobs(), speculative_config=_spec(tiny_pair, "sync"), engine_kwargs=ENGINE)


@pytest.fixture(scope="module")
def ssd(tiny_pair):
    # A budget of two branches per request: some outcomes are pre-drafted (hits), most are not (misses).
    # jit backups: with `auto` a loaded machine makes n-gram backups win, whose rounds rarely hit with this
    # pair (n-gram rounds are pre-drafted at depth 0, their outcomes spread over all depths), so a job could
    # see no hit at all. `auto` runs in the server tests (async defaults), n-gram backups in the distribution
    # tests.
    return run_engine(tiny_pair[0], _jobs(), speculative_config=_spec(tiny_pair, "async", fanout_budget=2,
                                                                      backup="jit"), engine_kwargs=ENGINE)


def _by_label(result, name: str) -> dict[str, float]:
    """How much a labelled Saguaro counter grew in the job, per label value."""
    out: dict[str, float] = {}
    for key, value in result.saguaro_delta.items():
        metric, _, labels = key.partition("{")
        if metric == name + "_total":
            label = labels.split('"')[1]
            out[label] = out.get(label, 0.0) + value
    return out


def _assert_speculated(result):
    spec = result.spec
    assert spec.drafts > 0 and spec.draft_tokens > 0, "no speculation happened"
    assert spec.accepted > 0, "no draft token was accepted"


@pytest.mark.parametrize("job", ["batch", "batch1", "batch4", "batch16"])
def test_greedy_output_identical(reference, saguaro, job):
    assert saguaro[job].token_ids == reference[job].token_ids
    assert [len(t) for t in saguaro[job].token_ids] == [len(t) for t in reference[job].token_ids]
    _assert_speculated(saguaro[job])
    # all-greedy batches verified through the argmax of the target rows read in place (greedy_rejection.py)
    assert saguaro[job].shortcuts.get("greedy_rejection", 0) > 0, saguaro[job].shortcuts
    assert reference[job].spec.drafts == 0


@pytest.mark.parametrize("job", ["batch", "batch1", "batch4", "batch16"])
def test_ssd_greedy_output_identical_with_hits_and_misses(reference, ssd, job):
    assert ssd[job].token_ids == reference[job].token_ids
    _assert_speculated(ssd[job])
    assert ssd[job].shortcuts.get("greedy_rejection", 0) > 0, ssd[job].shortcuts
    hits, lookups = ssd[job].counter("vllm:saguaro_cache_hits"), ssd[job].counter("vllm:saguaro_cache_lookups")
    assert hits > 0, f"no speculation-cache hit: {ssd[job].saguaro_delta}"
    assert lookups - hits > 0, f"no speculation-cache miss: {ssd[job].saguaro_delta}"
    assert _by_label(ssd[job], "vllm:saguaro_backups").get("jit", 0) > 0, "no miss got a just-in-time draft"
    _assert_outcomes_match_vllm(ssd[job], num_requests=len(next(j for j in _jobs() if j.name == job).prompts))


def _assert_outcomes_match_vllm(result, num_requests: int, k: int = 4):
    """The drafter derives each verification's accepted count a from the committed tokens alone (that is
    what its cache lookups are labelled with); vLLM counts accepted tokens in its rejection sampler. Every
    lookup's a tokens were accepted by vLLM, so sum(a) <= vLLM's count; vLLM also verifies each request's
    last drafts (no lookup follows, the request ends) and drafts whose lookup found no single outcome
    (depth 'none'), at most K tokens each. A wrong depth label or a misread outcome breaks these bounds."""
    lookups = _by_label(result, "vllm:saguaro_cache_lookups")
    hits = _by_label(result, "vllm:saguaro_cache_hits")
    assert all(n <= lookups.get(depth, 0) for depth, n in hits.items()), (hits, lookups)
    derived = sum(int(depth) * n for depth, n in lookups.items() if depth != "none")
    unlooked = num_requests + lookups.get("none", 0)
    assert derived <= result.spec.accepted <= derived + k * unlooked, (derived, result.spec, lookups)


def test_drafter_state_freed_after_requests_finish(saguaro):
    # Requests are freed when vLLM reports them finished (at its next step): after the sequential job,
    # at most its last request is still held, although 14 requests ran.
    held = saguaro["batch1"].saguaro
    assert held["vllm:saguaro_drafter_requests"] <= 1
    assert saguaro["batch"].saguaro["vllm:saguaro_draft_tokens_total"] > 0


def test_ssd_with_a_drafter_slower_than_the_target(tiny_pair, reference):
    """Every drafter forward delayed by 3 ms, so that a pre-draft (glue and 4 branch steps, >= 15 ms) takes
    longer than the target's verification (~10 ms here): pre-drafts are cut short, hits on branches cut
    short are topped up on the spot, and the output is still the target's greedy output. (Measured on 2
    busy cores: 47 cut-short pre-drafts, 14 top-ups. A longer delay cuts every pre-draft before its first
    branch step, leaving nothing to hit; a fixed budget of 2 branches keeps the planner from skipping
    branch steps; jit backups make hits likely, see `ssd`.)"""
    jobs = [Job("batch4", PROMPTS[4:8], GREEDY)]
    spec = _spec(tiny_pair, "async", fanout_budget=2, backup="jit")
    slow = run_engine(tiny_pair[0], jobs, speculative_config=spec, engine_kwargs=ENGINE,
                      env={"SAGUARO_DRAFTER_DELAY_S": "0.003"})
    result = slow["batch4"]
    assert result.token_ids == reference["batch4"].token_ids
    _assert_speculated(result)
    assert result.counter("vllm:saguaro_predraft_cut_short") > 0, result.saguaro_delta
    assert result.counter("vllm:saguaro_topups") > 0, result.saguaro_delta
    assert result.counter("vllm:saguaro_topups") <= result.counter("vllm:saguaro_cache_hits")


def test_ssd_with_a_drafter_kv_cache_too_small(tiny_pair, reference):
    """A drafter KV cache of 8 blocks (128 tokens, float32) for 11 requests of 53-253 tokens: rows without
    room go unspeculated (counted), the 205-token prompt never fits, the others draft as room frees up, and
    every request completes with the target's greedy output. jit backups: n-gram drafts need no drafter KV,
    so `auto` (n-gram under load) would sidestep the full cache. Measured: 346 rows without room in ~140
    drafter steps, 212 branches dropped, 531 draft tokens, 34 accepted."""
    spec = _spec(tiny_pair, "async", fanout_budget=2, dtype="float32", kv_cache_gb=0.00025, backup="jit")
    small = run_engine(tiny_pair[0], [Job("batch", PROMPTS, GREEDY)], speculative_config=spec, engine_kwargs=ENGINE)
    result = small["batch"]
    assert result.token_ids == reference["batch"].token_ids
    _assert_speculated(result)
    # The 205-token prompt is at most one row per drafter step: more means a full cache refused others.
    steps = result.saguaro["vllm:saguaro_drafter_step_seconds_count"]
    assert result.counter("vllm:saguaro_rows_no_room") > steps, (steps, result.saguaro_delta)
    assert result.counter("vllm:saguaro_cache_lookups") > 0


def _trace_steps(trace_dir) -> list[dict]:
    from pathlib import Path

    from saguaro_vllm.drafter.trace import read_trace

    files = sorted(Path(trace_dir).glob("trace-*.jsonl.gz"))
    assert len(files) == 1, files
    return read_trace(files[0])[1]


def test_ssd_drafts_as_sync_where_drafting_costs_a_verification(tiny_pair, reference, tmp_path):
    """Every drafter forward delayed by 20 ms, twice the target's verification here: the glue alone
    outlasts the verification, so no branch can ever be ready. After its first rounds measure that, the
    drafter stops pre-drafting (no glue, no branch forward between an answer and the next request) and
    drafts every row K tokens just in time, as `sync` does; probes pre-draft now and then; the output is
    the target's greedy output."""
    spec = _spec(tiny_pair, "async", trace_dir=str(tmp_path))
    result = run_engine(tiny_pair[0], [Job("batch", PROMPTS, GREEDY)], speculative_config=spec,
                        engine_kwargs=ENGINE, env={"SAGUARO_DRAFTER_DELAY_S": "0.02"})["batch"]
    assert result.token_ids == reference["batch"].token_ids
    _assert_speculated(result)
    modes = _by_label(result, "vllm:saguaro_rounds")
    assert modes.get("sync", 0) > 2 * modes.get("predraft", 0), modes
    steps = _trace_steps(tmp_path)
    sync_like = [n for n in range(1, len(steps)) if steps[n].get("predrafted") is False]
    assert len(sync_like) >= 10, [s.get("predrafted") for s in steps]
    for n in sync_like:
        # the round before ran no pre-draft forward, and every looked-up row was drafted now, all it wanted
        assert not any(f[0] in ("glue", "branch") for f in steps[n - 1]["fwd"]), steps[n - 1]["fwd"]
        rows = [r for r in steps[n]["rows"] if r["st"] not in ("new", "none", "noroom")]
        assert all(r["st"] == "jit" and r["served"] == r["want"] for r in rows), steps[n]["rows"]


@pytest.fixture(scope="module")
def cheap_pair(tmp_path_factory):
    """A draft of hidden 32 and a target of hidden 1024 computing the same function (distribution.py):
    every draft is accepted at T=0, so each round's outcome is certain, and a draft forward costs a
    fraction of a verification."""
    from distribution import build_embedded_pair

    return build_embedded_pair(tmp_path_factory.mktemp("cheap-pair"), vocab_size=4096, width=1024)


def test_ssd_predrafts_and_hits_where_the_draft_is_cheap(cheap_pair, tmp_path):
    """A draft forward of ~5 ms (delayed to that: a draft as costly as a few percent of this wide target's
    verification would save `sync` too little to measure on a busy machine) beside a verification of
    ~40 ms: the pre-draft fits inside the verification and saves `sync`'s K draft forwards, so it runs in
    (nearly) every round, and since the outcome is certain (all drafts accepted, bonus = the argmax) the
    cache hits whenever the branch steps ran: every looked-up row after such a round hits (a miss there
    would be a branch missing for the certain outcome); the output is the target's greedy output. The
    share of rounds that pre-draft is bounded loosely: on a loaded 2-core machine a probe of `sync`
    drafting or a noisy verification can switch a few rounds."""
    target, draft = cheap_pair
    prompts = [[5 + 7 * i, 11, 300 + i, 42, 9] for i in range(4)]
    jobs = [Job("batch4", prompts, {**GREEDY, "max_tokens": 96})]
    engine = {**ENGINE, "skip_tokenizer_init": True, "max_model_len": 256}
    plain = run_engine(str(target), jobs, engine_kwargs=engine)["batch4"]
    spec = {"method": "saguaro", "model": str(draft), "num_speculative_tokens": 4,
            "saguaro": {"mode": "async", "dtype": "float32", "log_interval_s": 1, "trace_dir": str(tmp_path)}}
    result = run_engine(str(target), jobs, speculative_config=spec, engine_kwargs=engine,
                        env={"SAGUARO_DRAFTER_DELAY_S": "0.005"})["batch4"]
    assert result.token_ids == plain.token_ids
    assert result.spec.accepted == result.spec.draft_tokens > 0  # the certain outcome: every draft accepted
    modes = _by_label(result, "vllm:saguaro_rounds")
    assert modes.get("predraft", 0) >= 0.6 * sum(modes.values()), modes
    steps = _trace_steps(tmp_path)
    after_branches = [r["st"] for n in range(len(steps) - 1) if steps[n].get("pre", {}).get("steps_done", 0) > 0
                      for r in steps[n + 1]["rows"] if r["st"] not in ("new", "none", "noroom")]
    assert len(after_branches) >= 20 and set(after_branches) == {"hit"}, after_branches
