"""The `vllm serve` runs that test_serve_features.py and test_faults.py check (not a test module).

Three servers of the tiny pair run one after another: plain vLLM, Saguaro `mode: sync` and Saguaro
`mode: async` (each boots while the previous one works: at most two alive). Each runs the same request
cases (`CASES`) and records, per case, what the client saw and how the server's `/metrics` counters grew
during it (Prometheus multiprocess mode, so the worker's `vllm:saguaro_*` metrics are there too). Then the
same server takes the drafter faults of `serve_faults.py` (the plain server records their reference
batch), and the Saguaro servers are stopped with a signal as a user would (`serve_stop.py`): server
start-ups dominate on 2 cores, so every check shares these three.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable

from pathlib import Path

import serve_faults
import serve_stop
from saguaro_vllm.tools.server_process import VLLMServer, metric_totals

K = 4
MAX_TOKENS_LARGE = 300
MAX_MODEL_LEN = 512
BLOCK_SIZE = 32
#: 96 blocks of 32 tokens: the fault batch (8 streams of ~330 tokens, 88 blocks) runs without preemption, so
#: its gaps are the fault's, not a preempted stream's wait; the preemption case asks for more than this at once.
NUM_BLOCKS = 96
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
               "--served-model-name", "tiny", "--block-size", str(BLOCK_SIZE),
               "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "64",
               # Compact JSON: the random target would otherwise fill any whitespace the grammar allows.
               "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
MODES = ("plain", "sync", "async")
PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "import os\nimport sys\nprint(", "class Point:"]
CHAT = [{"role": "user", "content": "for i in range(10):"}]
N_DIST = 400  # samples per server of the sampled distribution check
#: A free string field, so that drafts can fit the grammar (the drafter does not see it) and be accepted.
SCHEMA = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 120},
                                           "kind": {"enum": ["a", "b", "c"]}},
          "required": ["note", "kind"], "additionalProperties": False}

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATED = "vllm:generation_tokens_total"
FINISHED = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
DRAFTER_REQUESTS = "vllm:saguaro_drafter_requests"


# ------------------------------------------------------------------------------------------ helpers

class Ctx:
    """What a case gets: the client, the server (for /metrics) and the inputs shared by all servers."""

    def __init__(self, client, server: VLLMServer, eos_prompt: list[int], long_prompt: list[int]):
        self.client, self.server = client, server
        self.eos_prompt, self.long_prompt = eos_prompt, long_prompt
        self.greedy: dict[str, Any] = {}  # outputs derived cases build on (same on every server at T=0)


def _complete(ctx: Ctx, prompt, extra: dict | None = None, **params) -> dict:
    resp = ctx.client.completions.create(model="tiny", prompt=prompt, **params,
                                         extra_body={"return_token_ids": True, **(extra or {})})
    choices = sorted(resp.choices, key=lambda c: c.index)
    return {"tokens": [list(c.token_ids) for c in choices], "text": [c.text for c in choices],
            "finish": [c.finish_reason for c in choices]}


def _error(call: Callable[[], Any]) -> dict:
    """The status and message of a refused request (or what it returned, if it was not refused)."""
    import openai

    try:
        return {"ok": call()}
    except openai.APIStatusError as err:
        return {"status": err.status_code, "message": str(err.message)}


def _value(samples: dict[str, float], name: str) -> float:
    """A metric summed over its labels."""
    return metric_totals(samples).get(name, 0.0)


def _poll(server: VLLMServer, name: str, want: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        v = _value(server.metric_samples(), name)
        if v == want or time.monotonic() > deadline:
            return v
        time.sleep(0.25)


# -------------------------------------------------------------------------------------------- cases

def case_max_tokens_1(ctx):
    return _complete(ctx, PROMPTS, max_tokens=1, temperature=0)


def case_max_tokens_large(ctx):
    out = _complete(ctx, PROMPTS[0], max_tokens=MAX_TOKENS_LARGE, temperature=0, extra={"ignore_eos": True})
    ctx.greedy["long"] = out
    return out


def case_stop_string(ctx):
    # A stop string from the middle of this prompt's greedy output (the same on every server at T=0).
    text = ctx.greedy["long"]["text"][0]
    # (far enough in that drafts are accepted before it, in async too)
    start = next(i for i in range(100, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    out = _complete(ctx, PROMPTS[0], max_tokens=200, temperature=0, stop=[text[start:start + 3]])
    return {**out, "stop": text[start:start + 3]}


def case_stop_token_ids(ctx):
    tokens = ctx.greedy["long"]["tokens"][0]
    at = next(i for i in range(48, len(tokens)) if tokens[i] not in tokens[:i])
    out = _complete(ctx, PROMPTS[0], max_tokens=200, temperature=0, extra={"stop_token_ids": [tokens[at]]})
    return {**out, "stop_at": at}


def case_n_argmax(ctx):
    # vLLM refuses n > 1 at T=0; top_k=1 at T=1 is the sampled path with only the argmax to pick.
    return _complete(ctx, PROMPTS[1], n=3, max_tokens=48, temperature=1.0, extra={"top_k": 1, "ignore_eos": True})


def case_logprobs(ctx):
    resp = ctx.client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=32, temperature=0,
                                         logprobs=5, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                 "return_tokens_as_token_ids": True})
    c = resp.choices[0]
    return {"tokens": [list(c.token_ids)], "logprobs": c.logprobs.token_logprobs,
            "top": [dict(t) for t in c.logprobs.top_logprobs]}


def case_prompt_logprobs(ctx):
    resp = ctx.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True,
                                                     "prompt_logprobs": 3})
    c = resp.choices[0]
    prompt_lp = [None if d is None else {t: v["logprob"] for t, v in d.items()} for d in c.prompt_logprobs]
    return {"tokens": [list(c.token_ids)], "prompt_logprobs": prompt_lp}


def case_seed_repeat(ctx):
    params = dict(max_tokens=48, temperature=0.8, seed=7, extra={"ignore_eos": True})
    return {"first": _complete(ctx, PROMPTS[1], **params), "second": _complete(ctx, PROMPTS[1], **params)}


def case_sampled_distribution(ctx):
    # n > 1 with a seed: vLLM gives child i the seed `seed + i`, so these are N_DIST seeded requests.
    return _complete(ctx, PROMPTS[3], n=N_DIST, max_tokens=5, temperature=1.0, top_p=0.95, seed=1000,
                     extra={"ignore_eos": True})


def case_top_k_1(ctx):
    # Sampled path (T > 0) whose output is deterministic: top_k=1 keeps only the target's argmax.
    return _complete(ctx, PROMPTS[0], max_tokens=64, temperature=1.0, extra={"top_k": 1, "ignore_eos": True})


def case_top_p_tiny(ctx):
    return _complete(ctx, PROMPTS[0], max_tokens=64, temperature=1.0, top_p=1e-3, extra={"ignore_eos": True})


def case_min_p(ctx):
    return _error(lambda: _complete(ctx, PROMPTS[0], max_tokens=8, temperature=1.0, extra={"min_p": 0.1}))


def case_logit_bias(ctx):
    return _error(lambda: _complete(ctx, PROMPTS[0], max_tokens=8, temperature=0, logit_bias={"5": 10}))


# The drafter does not apply penalties (nor the grammar below), so its drafts match the target less often:
# 128 tokens, so that some are accepted.
def case_presence_penalty(ctx):
    return _complete(ctx, PROMPTS[2], max_tokens=128, temperature=0, presence_penalty=0.8,
                     extra={"ignore_eos": True})


def case_frequency_penalty(ctx):
    return _complete(ctx, PROMPTS[2], max_tokens=128, temperature=0, frequency_penalty=0.5,
                     extra={"ignore_eos": True})


def case_repetition_penalty(ctx):
    return _complete(ctx, PROMPTS[2], max_tokens=128, temperature=0,
                     extra={"repetition_penalty": 1.2, "ignore_eos": True})


def case_eos(ctx):
    return _complete(ctx, ctx.eos_prompt, max_tokens=96, temperature=0)


def case_ignore_eos(ctx):
    return _complete(ctx, ctx.eos_prompt, max_tokens=96, temperature=0, extra={"ignore_eos": True})


def case_min_tokens(ctx):
    # The greedy output ends with EOS early: min_tokens makes vLLM mask EOS until 40 tokens.
    return _complete(ctx, ctx.eos_prompt, max_tokens=64, temperature=0, extra={"min_tokens": 40})


def case_full_context(ctx):
    # The prompt plus max_tokens fill the model's maximum length exactly: drafts near the end must be cut.
    return _complete(ctx, ctx.long_prompt[: MAX_MODEL_LEN - 40], max_tokens=40, temperature=0,
                     extra={"ignore_eos": True})


def case_prompt_at_max_len(ctx):
    return _error(lambda: _complete(ctx, ctx.long_prompt[:MAX_MODEL_LEN], max_tokens=1, temperature=0))


def case_prompt_over_max_len(ctx):
    return _error(lambda: _complete(ctx, ctx.long_prompt[: MAX_MODEL_LEN + 1], max_tokens=1, temperature=0))


def case_chat(ctx):
    resp = ctx.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=48, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    c = resp.choices[0]
    return {"tokens": [list(c.token_ids)], "text": [c.message.content]}


def case_json_schema(ctx):
    def call():
        resp = ctx.client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=200, temperature=0, extra_body={"return_token_ids": True},
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
        c = resp.choices[0]
        return {"tokens": [list(c.token_ids)], "text": [c.message.content], "finish": [c.finish_reason]}
    return _error(call)


def case_preemption(ctx):
    # 24 requests of 40 + 150 tokens need 144 KV blocks of the 96: vLLM preempts and recomputes some (at
    # 1.5 times the blocks, as speculating servers, whose requests finish at different times, need).
    prompts = [ctx.long_prompt[i * 7: i * 7 + 40] for i in range(24)]
    return _complete(ctx, prompts, max_tokens=150, temperature=0, extra={"ignore_eos": True})


def case_stream_disconnect(ctx):
    """Read a few chunks of a long stream, hang up, and watch the request go: aborted by vLLM and freed by
    the drafter (its request gauge back to 0); then the server still answers exactly."""
    stream = ctx.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
    chunks = []
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if len(chunks) == 12:
            break
    during = ctx.server.metric_samples()
    stream.close()
    running = _poll(ctx.server, RUNNING, 0.0)
    gone = ctx.server.metric_samples()
    held = _poll(ctx.server, DRAFTER_REQUESTS, 0.0)
    after = _complete(ctx, PROMPTS[1], max_tokens=32, temperature=0, extra={"ignore_eos": True})
    return {"chunks": len(chunks), "held_during": _value(during, DRAFTER_REQUESTS), "running_after": running,
            "generated": _value(gone, GENERATED) - _value(during, GENERATED),
            "finished": _value(gone, FINISHED) - _value(during, FINISHED), "held_after": held,
            "follow_up": after, "held_after_follow_up": _poll(ctx.server, DRAFTER_REQUESTS, 0.0)}


CASES: dict[str, Callable[[Ctx], Any]] = {
    name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")
}
GREEDY_CASES = ["max_tokens_1", "max_tokens_large", "stop_string", "stop_token_ids", "n_argmax", "top_k_1",
                "top_p_tiny", "presence_penalty", "frequency_penalty", "repetition_penalty", "eos", "ignore_eos",
                "min_tokens", "full_context", "chat", "preemption"]
#: Cases too short to speculate: a single output token never reaches a verification step.
NOT_SPECULATED = {"max_tokens_1", "min_p", "logit_bias", "prompt_at_max_len", "prompt_over_max_len"}


# ------------------------------------------------------------------------------------------ servers

def find_inputs(target: str) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output ends with EOS after a while (found with HF transformers, so every server
    gets the same one), and a long random prompt for the context-length cases."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target).eval()
    eos = model.config.eos_token_id
    gen = torch.Generator().manual_seed(0)
    eos_prompt = None
    with torch.no_grad():
        for _ in range(40):
            ids = torch.randint(2, model.config.vocab_size, (32, 6), generator=gen)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                 eos_token_id=None, pad_token_id=eos)[:, ids.shape[1]:].tolist()
            found = [i for i, row in enumerate(out) if eos in row[12:] and eos not in row[:12]]
            if found:
                eos_prompt = ids[found[0]].tolist()
                break
    assert eos_prompt is not None, "no prompt of the tiny target ends with EOS within 48 tokens"
    long_prompt = torch.randint(2, model.config.vocab_size, (MAX_MODEL_LEN + 8,), generator=gen).tolist()
    return eos_prompt, long_prompt


def _server(pair, tmp: Path, mode: str) -> VLLMServer:
    args = list(SERVER_ARGS)
    env = {}
    if mode != "plain":
        cfg = tmp / f"saguaro-{mode}.json"
        cfg.write_text(json.dumps({"method": "saguaro", "model": pair[1], "num_speculative_tokens": K,
                                   "saguaro": {"mode": mode, "log_interval_s": 2}}))
        args += ["--speculative-config", str(cfg)]
        env[serve_faults.FAIL_ENV] = str(tmp / f"drafter-fail-{mode}")
    return VLLMServer(pair[0], args, env=env, log_path=str(tmp / f"server-{mode}.log"), prometheus_multiproc=True)


def run_cases(server: VLLMServer, inputs, tmp: Path, mode: str) -> dict[str, dict]:
    """Every case against one server; per case {"out": ..., "delta": {counter: growth}, "seconds": ...}."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    ctx = Ctx(client, server, *inputs)
    records: dict[str, dict] = {}
    for name, case in CASES.items():
        before = server.metric_samples()
        t0 = time.monotonic()
        try:
            out = case(ctx)
        except Exception as err:  # recorded, so that one broken case fails only its own test
            out = {"exception": f"{type(err).__name__}: {err}"}
        seconds = time.monotonic() - t0
        time.sleep(0.1)  # the front end records the last step's stats just after answering
        after = server.metric_samples()
        delta = {k: _value(after, k) - _value(before, k) for k in (DRAFTS, ACCEPTED, PREEMPTIONS)}
        records[name] = {"out": out, "delta": delta, "seconds": seconds}
    (tmp / f"records-{mode}.json").write_text(json.dumps(records))  # for diagnosing a failure
    return records


def run_servers(pair, tmp: Path) -> dict[str, dict]:
    """{"cases": {mode: records}, "faults": {fault: result}, "metric_names": {mode: names on /metrics},
    "stops": {mode: record}} of the plain, sync and async servers.

    Order per server: ready; its faults (or, plain, the faults' reference batch) while nothing else runs,
    since they time the fault's cost; then the next server boots while this one runs the request cases; then
    it stops (the Saguaro ones as a user stops them, serve_stop.py)."""
    servers = [_server(pair, tmp, mode) for mode in MODES]
    cases: dict[str, dict] = {}
    faults: dict[str, dict] = {}
    names: dict[str, list[str]] = {}  # per server, the metric names its /metrics page showed at the end
    stops: dict[str, dict] = {}
    reference: list[str] | None = None
    inputs = find_inputs(pair[0])
    try:
        servers[0].launch()
        for i, (mode, server) in enumerate(zip(MODES, servers)):
            server.wait_ready()
            if mode == "plain":
                reference = serve_faults.reference_batch(server)
            else:
                faults.update(serve_faults.run_faults(server, mode, reference, tmp / f"drafter-fail-{mode}"))
            if i + 1 < len(servers):
                servers[i + 1].launch()
            cases[mode] = run_cases(server, inputs, tmp, mode)
            names[mode] = sorted({k.split("{")[0] for k in server.metric_samples()})
            if mode in serve_stop.STOPS:
                stops[mode] = serve_stop.stop(server, mode)
            server.stop()
    finally:
        for server in servers:
            server.stop()
    return {"cases": cases, "faults": faults, "metric_names": names, "stops": stops}
