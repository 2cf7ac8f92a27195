"""Data parallelism through `vllm serve --data-parallel-size 2` on vLLM's CPU build: two engines, each with its
own drafter on its own core (2 cores: each drafter shares its own engine's core, `share_cores`), the greedy
outputs of the plain server (`served`'s records, so this adds one server start), the T=1 distribution of the
plain server's sampled case pooled over both engines, and Saguaro's metrics of each engine under vLLM's
`engine` label.

`vllm.LLM` refuses `data_parallel_size` > 1 (entrypoints/llm.py), so the engines are served."""
from __future__ import annotations

import concurrent.futures
import json

import pytest

from distribution import EXACT_P, compare
from serve_cases import CASES, N_DIST, PROMPTS, SERVER_ARGS, Ctx, _complete
from saguaro_vllm.tools.server_process import VLLMServer, drafter_state

pytestmark = [pytest.mark.engine, pytest.mark.cpu_build_only]

#: Greedy cases of serve_cases.py that need nothing another case computed, sent at once so that vLLM's load
#: balancer gives both engines requests.
DP_CASES = ["max_tokens_large", "n_argmax", "top_k_1", "top_p_tiny", "chat", "presence_penalty",
            "frequency_penalty", "repetition_penalty"]


#: The plain server's `sampled_distribution` case (N_DIST samples of 5 tokens at T=1, top_p 0.95) split into
#: concurrent requests with their own seeds, so that both engines sample.
DIST_SPLIT = 4
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


def _sampled(ctx: Ctx, part: int) -> dict:
    return _complete(ctx, PROMPTS[3], n=N_DIST // DIST_SPLIT, max_tokens=5, temperature=1.0, top_p=0.95,
                     seed=5000 + 1000 * part, extra={"ignore_eos": True})


def _by_engine(samples: dict[str, float], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in samples.items():
        metric, _, labels = key.partition("{")
        if metric == name and 'engine="' in labels:
            engine = labels.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = out.get(engine, 0.0) + value
    return out


@pytest.fixture(scope="module")
def dp_run(served, tiny_pair, tmp_path_factory):
    import openai

    tmp = tmp_path_factory.mktemp("dp")
    cfg = tmp / "saguaro-dp.json"
    cfg.write_text(json.dumps({"method": "saguaro", "model": tiny_pair[1], "num_speculative_tokens": 4,
                               "saguaro": {"mode": "sync", "share_cores": True, "log_interval_s": 2}}))
    server = VLLMServer(tiny_pair[0], [*SERVER_ARGS, "--data-parallel-size", "2", "--speculative-config", str(cfg)],
                        log_path=str(tmp / "server-dp.log"), prometheus_multiproc=True)
    with server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        ctx = Ctx(client, server, [], [])
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = {name: pool.submit(CASES[name], ctx) for name in DP_CASES}
        outputs = {name: f.result() for name, f in futures.items()}
        before = server.metric_samples()
        with concurrent.futures.ThreadPoolExecutor(DIST_SPLIT) as pool:
            parts = list(pool.map(lambda i: _sampled(ctx, i), range(DIST_SPLIT)))
        samples = server.metric_samples()
        drafters = [p for role, p in server.processes() if role == "drafter"]
        affinities = sorted(tuple(sorted(p.cpu_affinity())) for p in drafters)
    sampled = [row for part in parts for row in part["tokens"]]
    return {"outputs": outputs, "samples": samples, "affinities": affinities, "before_sampled": before,
            "sampled": sampled,
            "plain": served["cases"]["plain"], "log": str(tmp / "server-dp.log")}


@pytest.mark.parametrize("case", DP_CASES)
def test_dp2_greedy_equals_plain(dp_run, case):
    assert dp_run["outputs"][case] == dp_run["plain"][case]["out"], case


def test_each_engine_drafts_with_its_own_drafter_on_its_own_core(dp_run):
    samples = dp_run["samples"]
    drafted = _by_engine(samples, "vllm:saguaro_draft_tokens_total")
    verified = _by_engine(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert set(drafted) == {"0", "1"} and min(drafted.values()) > 0, drafted
    assert min(verified.get(e, 0) for e in ("0", "1")) > 0, verified
    assert drafter_state(samples, "0") == drafter_state(samples, "1") == "ready"
    first, second = dp_run["affinities"]  # two drafters, on disjoint cores (2 cores: core 0 and core 1)
    assert first and second and not set(first) & set(second), dp_run["affinities"]
    steps = _by_engine(samples, "vllm:saguaro_drafter_step_seconds_count")
    waited = _by_engine(samples, "vllm:saguaro_drafter_step_seconds_sum")
    print("drafter wait per step, ms:", {e: round(1e3 * waited[e] / steps[e], 2) for e in sorted(steps)})


def test_dp2_t1_distribution_equals_plain(dp_run):
    """The T=1 samples of both engines pooled against the plain server's; each engine verified sampled drafts
    in those requests (drafted tokens, some accepted, some rejected) with its own drafter."""
    import numpy as np

    a = np.asarray(dp_run["plain"]["sampled_distribution"]["out"]["tokens"])
    b = np.asarray(dp_run["sampled"])
    assert a.shape == b.shape == (N_DIST, 5)
    pvalues = compare(a, b, positions=(1, 2, 3, 4), joints=((1, 2),))
    assert min(pvalues.values()) > EXACT_P, pvalues
    before, after = dp_run["before_sampled"], dp_run["samples"]
    grew = {name: {e: v - _by_engine(before, name).get(e, 0.0) for e, v in _by_engine(after, name).items()}
            for name in (DRAFTED, ACCEPTED, "vllm:saguaro_draft_tokens_total")}
    for engine in ("0", "1"):
        drafted, accepted = grew[DRAFTED].get(engine, 0.0), grew[ACCEPTED].get(engine, 0.0)
        assert grew["vllm:saguaro_draft_tokens_total"].get(engine, 0.0) > 0, (engine, grew)
        assert 0 < accepted < drafted, (engine, grew)  # accepts and rejections of sampled drafts
