"""Soak: concurrent streaming clients against `vllm serve` with Saguaro (`mode: async`) for minutes, one
drafter SIGKILL in the middle. Not a unit test: a script that measures and reports.

`--clients` clients (asyncio, the `openai` client; default 4) loop over requests with mixed temperatures
(`--temperatures`, default 0, 0, 0, 0.7: three in four greedy; sampled ones with top-p / top-k half the
time), lengths (8-256 tokens) and stop conditions (max_tokens with ignore_eos, EOS, stop strings, stop token
ids; completions and chat). At `--kill-at` the drafter process is SIGKILLed. Reported: requests completed,
errors (must be 0), tokens/s, p50/p99 latency, time to first token and time per output token, how long the
drafter took to be back (drafts flowing again), the speculation-cache hit rate (over the run, before the
first kill and after the last recovery), and the resident memory of every process of the server's tree (API
server, engine core, worker, each drafter: the first one and every replacement, each measured over its own
life) after a warm-up and at the end (growth must stay under 5 %). Also the CPU time that processes outside
the tree used meanwhile (others sharing the cores; sampled every ~5 s, so processes that exit during the run
count too) and the 1-minute load average during the run.

The defaults are chosen so that SSD is exercised: on a 2-core CPU the pre-drafted branches pay (and run)
only at small batches and mostly greedy rows (docs/benchmarks.md: hit rate ~0.9 at T=0 for batch 1-16, ~0
for sampled batches >= 2, where the drafter skips its branch steps); the 2026-12-04 soak (64 clients, half
sampled, the raw pair, whose draft costs as much as its 7 ms target step) had a hit rate of 0.001, i.e. it
soaked `sync`-like serving. That load is still `--clients 64 --temperatures 0,0,0.7,1 --models raw`.

Bounded: clients stop starting requests at `--duration`, in-flight requests get `--drain-s` to finish, then
the server is stopped. Traffic goes to 127.0.0.1 only. Result: `benchmarks/results/<date>-soak.json`
(rendered on docs/benchmarks.md by benchmarks/report.py).

    .venv/bin/python benchmarks/soak.py --duration 30            # quick check
    .venv/bin/python benchmarks/soak.py --kill-at 120 --warmup-s 60   # 5 minutes, the figures on the pages
    .venv/bin/python benchmarks/soak.py --temperatures 0 --name soak-greedy-reference   # greedy only
    .venv/bin/python benchmarks/soak.py --model T --draft D      # another pair

Model: `--model/--draft`, else the demo pair if it is built (`make demo`): its cost-matched twins (`--models
cost`, the default, as in benchmarks/run.py; the raw pair if they are not built) or the raw trained pair
(`--models raw`); else a tiny random pair built like the tests' (tests/tiny_models.py) in a temporary directory.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

DRAFTS = "vllm:spec_decode_num_drafts_total"
#: Counted in the worker (Prometheus multiprocess files, read at scrape time): no lag behind the engine, unlike
#: vLLM's spec-decode counters, which the API server records when it gets around to the engine's outputs.
SAGUARO_DRAFT_TOKENS = "vllm:saguaro_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
RESTARTS = "vllm:saguaro_drafter_restarts_total"
FAILURES = "vllm:saguaro_drafter_failures_total"
LOOKUPS = "vllm:saguaro_cache_lookups_total"
HITS = "vllm:saguaro_cache_hits_total"
MEMORY_GROWTH_LIMIT = 0.05
MEMORY_EVERY_POLLS = 5  # one memory sample per 5 polls (~5 s)
TEMPERATURES = (0.0, 0.0, 0.0, 0.7)
LENGTHS = (8, 32, 64, 128, 256)
TINY_PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "import os\nimport sys\nprint(", "for i in range(10):",
                "class Point:\n    def __init__(self, x, y):", "print(os.getcwd(), sys.argv)", "The lazy dog",
                "    return a + b\n"]


def _seconds_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds such as 150 or 100,200; got {text!r}") from None


def _temperatures(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected temperatures such as 0,0,0,0.7; got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default 300)")
    p.add_argument("--clients", type=int, default=4,
                   help="concurrent streaming clients (default 4: SSD's branches run at small batches on a CPU)")
    p.add_argument("--temperatures", type=_temperatures, default=list(TEMPERATURES),
                   help="temperatures each request draws from, comma-separated (default 0,0,0,0.7)")
    p.add_argument("--models", choices=["cost", "raw"], default="cost",
                   help="demo pair: its cost-matched twins (default) or the raw trained models")
    p.add_argument("--kill-at", type=_seconds_list, default=None,
                   help="seconds into the traffic of each drafter SIGKILL, comma-separated (default: duration / 2); "
                        "several kills tell memory a restart leaves behind from a one-time fill")
    p.add_argument("--no-kill", action="store_true", help="no drafter kill (a reference run)")
    p.add_argument("--model", help="target model directory (with --draft)")
    p.add_argument("--draft", help="draft model directory (with --model)")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--warmup-s", type=float, default=None,
                   help="traffic before the 'start' memory sample (default min(30, duration / 10))")
    p.add_argument("--drafter-settle-s", type=float, default=15.0,
                   help="a replacement drafter's memory is measured from its first sample this long after it was "
                        "ready (it builds every oneDNN shape before it reports ready; default 15)")
    p.add_argument("--drain-s", type=float, default=120.0, help="time in-flight requests get after --duration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="soak")
    p.add_argument("--out", help="result JSON (default benchmarks/results/<date>-<name>.json)")
    p.add_argument("--keep-log", help="keep the server log in this file")
    a = p.parse_args(argv)
    if (a.model is None) != (a.draft is None):
        p.error("--model and --draft go together")
    if a.duration <= 0 or a.clients <= 0:
        p.error("--duration and --clients must be positive")
    a.kill_at = [] if a.no_kill else ([a.duration / 2] if a.kill_at is None else sorted(a.kill_at))
    for t in a.kill_at:
        if not 0 < t < a.duration:
            p.error(f"--kill-at must be inside the traffic (0, {a.duration:g}), got {t:g}")
    a.warmup_s = min(30.0, a.duration / 10) if a.warmup_s is None else a.warmup_s
    if not a.temperatures or any(t < 0 for t in a.temperatures):
        p.error("--temperatures: one or more temperatures >= 0")
    return a


# ------------------------------------------------------------------------------------------------ models

def pick_pair(a: argparse.Namespace, tmp: Path) -> tuple[str, str, str, list[str]]:
    """(target, draft, which, prompts): --model/--draft, else the built demo pair (its cost-matched twins with
    `--models cost` where built), else a tiny random pair."""
    if a.model:
        return a.model, a.draft, "given", TINY_PROMPTS
    from saguaro_vllm.demo.build import BuildSettings, DemoPair, default_cache_root
    from saguaro_vllm.demo.storage import read_marker

    key = BuildSettings().key()
    root = default_cache_root() / f"demo-pair-{key}"
    marker, _ = read_marker(root)
    if marker is not None and marker.get("key") == key:
        pair = DemoPair(root, json.loads((root / "stats.json").read_text()))
        if a.models == "cost" and pair.target_cost is not None:
            return (str(pair.target_cost), str(pair.draft_cost), "demo (cost-matched twins)",
                    pair.heldout_prompts(32))
        which = "demo (raw)" if a.models == "raw" else "demo (raw: the cost-matched twins are not built)"
        return str(pair.target), str(pair.draft), which, pair.heldout_prompts(32)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tiny_pair

    target, draft = build_tiny_pair(tmp / "tiny-pair")
    return target, draft, "tiny (random weights, tests/tiny_models.py)", TINY_PROMPTS


# ------------------------------------------------------------------------------------------- requests

def request_plan(rng: random.Random, prompts: list[str], temperatures=TEMPERATURES) -> dict:
    """One request: endpoint, prompt and sampling, drawn from the soak's mix."""
    temperature = rng.choice(temperatures)
    body: dict = {"max_tokens": rng.choice(LENGTHS), "temperature": temperature, "seed": rng.randrange(2**31)}
    extra: dict = {}
    if temperature > 0 and rng.random() < 0.5:
        body["top_p"] = 0.9
        extra["top_k"] = 40
    stop = rng.choice(["length", "eos", "stop-string", "stop-token"])
    if stop == "length":
        extra["ignore_eos"] = True
    elif stop == "stop-string":
        body["stop"] = rng.choice([["\n"], [" the", "):"], ["e"]])
    elif stop == "stop-token":
        extra["stop_token_ids"] = [rng.randrange(2, 300)]
    return {"chat": rng.random() < 0.25, "prompt": rng.choice(prompts), "body": body, "extra": extra,
            "stop": stop}


async def one_request(client, model: str, plan: dict) -> dict:
    """Stream one request; returns its timings and token count (raises on any error)."""
    t0 = time.monotonic()
    first = None
    tokens = None
    finish = None
    common = dict(model=model, stream=True, stream_options={"include_usage": True}, extra_body=plan["extra"],
                  **plan["body"])
    if plan["chat"]:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": plan["prompt"]}],
                                                      **common)
    else:
        stream = await client.completions.create(prompt=plan["prompt"], **common)
    last, max_gap = None, 0.0
    async for chunk in stream:
        if chunk.choices:
            c = chunk.choices[0]
            text = c.delta.content if plan["chat"] else c.text
            if text:
                now = time.monotonic()
                first = now if first is None else first
                max_gap = max(max_gap, now - last) if last is not None else 0.0
                last = now
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.monotonic()
    if finish is None or tokens is None:
        raise RuntimeError(f"stream ended without finish_reason/usage (finish={finish}, tokens={tokens})")
    return {"start": t0, "first": first, "end": end, "max_gap": max_gap, "tokens": tokens, "finish": finish,
            "stop": plan["stop"], "chat": plan["chat"], "temperature": plan["body"]["temperature"]}


async def client_loop(idx: int, client, model: str, prompts: list[str], stop_at: float, seed: int,
                      done: list[dict], errors: list[str], temperatures=TEMPERATURES) -> None:
    rng = random.Random(seed * 1000 + idx)
    while time.monotonic() < stop_at:
        plan = request_plan(rng, prompts, temperatures)
        try:
            done.append(await one_request(client, model, plan))
        except Exception as err:  # every error counts; the soak goes on
            errors.append(f"client {idx} at {time.monotonic() - stop_at:+.1f} s: {type(err).__name__}: {err}"
                          f" (plan {plan['stop']}, chat={plan['chat']})")
            await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------------ observing

def scrape(server) -> tuple[dict[str, float], str | None]:
    """/metrics summed per sample name over labels, and the drafter client's state (the label of
    `vllm:saguaro_drafter_state` that is 1; None where the gauge is absent)."""
    from saguaro_vllm.tools.server_process import drafter_state, metric_totals

    samples = server.metric_samples()
    return metric_totals(samples), drafter_state(samples)


def memory_mb(server) -> dict[str, float]:
    """Resident memory per role of the server's process tree, summed within a role."""
    out: dict[str, float] = {}
    for role, proc in server.processes():
        try:
            out[role] = out.get(role, 0.0) + proc.memory_info().rss / 2**20
        except Exception:  # exited meanwhile
            pass
    return {k: round(v, 1) for k, v in sorted(out.items())}


def others_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by every process on the machine (to count what others used during the run)."""
    import psutil

    out = {}
    for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        try:
            t = p.info["cpu_times"]
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:120]
            out[p.pid] = (cmd, t.user + t.system)
        except Exception:
            pass
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def figures(values: list[float]) -> dict:
    return {"p50": pct(values, 50), "p99": pct(values, 99), "mean": statistics.fmean(values) if values else None}


def summarize(done: list[dict], traffic_s: float) -> dict:
    tokens = sum(r["tokens"] for r in done)
    lat = [r["end"] - r["start"] for r in done]
    ttft = [r["first"] - r["start"] for r in done if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in done if r["first"] is not None and r["tokens"] > 1]
    kinds: dict[str, int] = {}
    for r in done:
        kinds[r["stop"]] = kinds.get(r["stop"], 0) + 1
    finishes: dict[str, int] = {}
    for r in done:
        finishes[r["finish"]] = finishes.get(r["finish"], 0) + 1
    return {"requests": len(done), "tokens": tokens, "tokens_per_s": tokens / traffic_s if traffic_s else None,
            "latency_s": figures(lat), "ttft_s": figures(ttft), "tpot_s": figures(tpot),
            "max_chunk_gap_s": figures([r["max_gap"] for r in done]) | {"max": max((r["max_gap"] for r in done),
                                                                            default=None)},
            "by_stop_condition": kinds, "finish_reasons": finishes,
            "chat_requests": sum(r["chat"] for r in done),
            "sampled_requests": sum(r["temperature"] > 0 for r in done)}


# ------------------------------------------------------------------------------------------------ run

async def soak(a: argparse.Namespace, server, model_name: str, prompts: list[str]) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)
    done: list[dict] = []
    errors: list[str] = []
    polls: list[dict] = []
    events: dict = {}
    seen: dict[int, tuple[str, float]] = {}  # CPU seconds of every process, updated at each memory sample
    start = time.monotonic()
    stop_at = start + a.duration
    tasks = [asyncio.create_task(client_loop(i, client, model_name, prompts, stop_at, a.seed, done, errors,
                                             tuple(a.temperatures)))
             for i in range(a.clients)]
    bar = tqdm(total=int(a.duration), unit="s", desc="soak", dynamic_ncols=True)
    pending_kills = list(a.kill_at)
    while time.monotonic() < stop_at:
        await asyncio.sleep(1.0)
        now = time.monotonic() - start
        m, state = await asyncio.to_thread(scrape, server)
        drafters = [p.pid for role, p in server.processes() if role == "drafter"]
        polls.append({"t": round(now, 2), "requests": len(done), "tokens": sum(r["tokens"] for r in done),
                      "errors": len(errors), "drafts": m.get(SAGUARO_DRAFT_TOKENS, 0.0), "state": state,
                      "restarts": m.get(RESTARTS), "failures": m.get(FAILURES, 0.0), "drafters": drafters,
                      "lookups": m.get(LOOKUPS, 0.0), "hits": m.get(HITS, 0.0)})
        if len(polls) % MEMORY_EVERY_POLLS == 0 or ("memory_start" not in events and now >= a.warmup_s):
            sample = {"t": round(now, 2), "mb": memory_mb(server), "drafter_pid": drafters[0] if drafters else None}
            events.setdefault("memory_samples", []).append(sample)
            # processes of others that start and exit during the run count up to their last sample
            seen.update(await asyncio.to_thread(others_cpu_s))
            events.setdefault("loadavg", []).append((round(now, 2), round(os.getloadavg()[0], 2)))
            if "memory_start" not in events and now >= a.warmup_s:
                events["memory_start"] = sample
        if pending_kills and now >= pending_kills[0]:
            pending_kills.pop(0)
            victim = drafters[0] if drafters else None
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
            events.setdefault("kills", []).append({"t": round(time.monotonic() - start, 2), "pid": victim})
        bar.update(min(int(now), int(a.duration)) - bar.n)
        bar.set_postfix(done=len(done), err=len(errors), tok_s=f"{polls[-1]['tokens'] / now:.0f}")
    drafters = [p.pid for role, p in server.processes() if role == "drafter"]
    events["memory_end"] = {"t": round(time.monotonic() - start, 2), "mb": memory_mb(server),
                            "drafter_pid": drafters[0] if drafters else None}
    events.setdefault("memory_samples", []).append(events["memory_end"])
    traffic_s = time.monotonic() - start
    bar.close()
    _, pending = await asyncio.wait(tasks, timeout=a.drain_s)
    for t in pending:
        t.cancel()
    if pending:
        errors.append(f"{len(pending)} clients still had a request in flight {a.drain_s:.0f} s after the end")
    drain_s = time.monotonic() - start - traffic_s
    final, _ = await asyncio.to_thread(scrape, server)
    return {"done": done, "errors": errors, "polls": polls, "events": events, "start": start, "traffic_s": traffic_s,
            "drain_s": drain_s, "metrics": final, "cpu_seen": seen}


def recovery(polls: list[dict], kill: dict | None, done: list[dict], start: float,
             until: float | None = None) -> dict | None:
    """What the kill cost: the longest wait between two chunks of the requests in flight at the kill, when
    the client was `ready` again with a new drafter, and when drafts flowed again (the first poll interval that
    began after the kill in which the proposer received draft tokens: the killed drafter cannot have made them).
    Restarts and failures are counted up to `until` (the next kill)."""
    if not kill:
        return None
    at = start + kill["t"]
    polls = [p for p in polls if until is None or p["t"] < until]
    hit = [r for r in done if r["start"] <= at <= r["end"]]
    out = {"killed_pid": kill["pid"], "at_s": kill["t"], "ready_after_s": None, "recovered_after_s": None,
           "new_pid": None, "states": [], "requests_in_flight": len(hit),
           "in_flight_max_chunk_gap_s": max((r["max_gap"] for r in hit), default=None)}
    for p in polls:
        if p["t"] >= kill["t"] and (not out["states"] or out["states"][-1][1] != p["state"]):
            out["states"].append((round(p["t"] - kill["t"], 2), p["state"]))  # the client's states after the kill
        if p["t"] > kill["t"] and out["ready_after_s"] is None and p["state"] == "ready" and p["drafters"] \
                and p["drafters"][0] != kill["pid"]:
            out["ready_after_s"] = round(p["t"] - kill["t"], 2)
    for prev, cur in zip(polls, polls[1:]):
        if prev["t"] >= kill["t"] and cur["drafts"] > prev["drafts"]:
            out["recovered_after_s"] = round(cur["t"] - kill["t"], 2)
            out["new_pid"] = cur["drafters"][0] if cur["drafters"] else None
            break
    before = [p for p in polls if p["t"] < kill["t"]]
    first, last = (before[-1]["restarts"] if before else 0.0), polls[-1]["restarts"]
    out["restarts"] = None if first is None or last is None else last - first  # None: not on /metrics
    out["failed_steps"] = polls[-1]["failures"] - (before[-1]["failures"] if before else 0.0)
    return out


def kill_jumps(events: dict, kills: list[dict]) -> list[dict]:
    """Per kill and process (the drafter aside: it is a new process), resident MB from the last sample before
    the kill to the first one at least 10 s after its replacement was ready: a jump that repeats at every kill
    is memory each restart leaves behind; one that does not is a one-time fill (e.g. new matmul shapes while
    steps ran without drafts)."""
    samples = events.get("memory_samples", [])
    out = []
    for kill in kills:
        before = [x for x in samples if x["t"] < kill["at_s"]]
        settled = kill["at_s"] + (kill.get("ready_after_s") or 0.0) + 10.0
        after = next((x for x in samples if x["t"] >= settled), None)
        if not before or after is None:
            continue
        out.append({"at_s": kill["at_s"], "from_t_s": before[-1]["t"], "to_t_s": after["t"],
                    "mb": {role: round(after["mb"][role] - mb, 1) for role, mb in before[-1]["mb"].items()
                           if role != "drafter" and role in after["mb"]}})
    return out


def drafter_memory(samples: list[dict], kills: list[dict], warmup_s: float, settle_s: float) -> list[dict]:
    """Each drafter process's own resident memory, first sample to last of the span measured: the first
    drafter from the warm-up to its last sample before the kill, every replacement from its first sample at
    least `settle_s` after it was ready (it builds its oneDNN shapes and writes its KV cache before it reports
    ready) to its last one. Comparing two processes would measure the restart, not a leak."""
    pids: list[int] = []
    for x in samples:
        if x.get("drafter_pid") is not None and "drafter" in x["mb"] and x["drafter_pid"] not in pids:
            pids.append(x["drafter_pid"])
    out = []
    for i, pid in enumerate(pids):
        own = [x for x in samples if x.get("drafter_pid") == pid and "drafter" in x["mb"]]
        if i == 0:
            t0, since = warmup_s, f"the warm-up ({warmup_s:.0f} s)"
        else:
            prior = [k for k in kills if k["at_s"] <= own[0]["t"]]
            ready = (prior[-1]["at_s"] + (prior[-1].get("ready_after_s") or 0.0)) if prior else own[0]["t"]
            t0, since = ready + settle_s, f"{settle_s:.0f} s after it was ready at {ready:.0f} s"
        span = [x for x in own if x["t"] >= t0]
        entry = {"pid": pid, "which": "first" if i == 0 else f"replacement {i}", "alive_t_s": [own[0]["t"],
                 own[-1]["t"]], "since": since, "from_t_s": None, "to_t_s": None, "start_mb": None,
                 "end_mb": None, "growth": None, "samples": len(span)}
        if len(span) >= 2:
            a, b = span[0], span[-1]
            entry.update(from_t_s=a["t"], to_t_s=b["t"], start_mb=a["mb"]["drafter"], end_mb=b["mb"]["drafter"],
                         growth=round((b["mb"]["drafter"] - a["mb"]["drafter"]) / a["mb"]["drafter"], 4),
                         max_mb=max(x["mb"]["drafter"] for x in span))
        out.append(entry)
    return out


def memory_growth(events: dict, warmup_s: float, kills: list[dict] | None = None, settle_s: float = 15.0) -> dict:
    """Resident memory growth per role from the sample after the warm-up to the end (< 5 % each).

    Every drafter process (the first one and each replacement) is measured over its own life
    (`drafter_memory`, listed in `drafters`); the `drafter` entry of `growth` is the last one's. `ok` needs
    every process under the limit and every drafter measured (one that ran too short is not vouched for).
    `second_half_growth` (midpoint of the measured span to the end) tells a warm-up step from a steady leak.
    Every sample is kept in `samples` (one per ~5 s).
    """
    samples = events.get("memory_samples", [])
    start, end = events.get("memory_start", {}), events["memory_end"]
    begin = {role: (start.get("t"), mb) for role, mb in start.get("mb", {}).items()}
    drafters = drafter_memory(samples, kills or [], warmup_s, settle_s)
    notes = {}
    if "drafter" in begin:
        last = drafters[-1] if drafters else None
        if last is not None and last["from_t_s"] is not None:
            begin["drafter"] = (last["from_t_s"], last["start_mb"])
            if last["which"] != "first":
                notes["drafter"] = f"{last['which']} (pid {last['pid']}) from {last['from_t_s']:.0f} s, {last['since']}"
        else:
            del begin["drafter"]
            notes["drafter"] = "the last drafter ran too short to be measured"
    growth, second_half = {}, {}
    for role, (t0, mb0) in begin.items():
        if role not in end["mb"] or not mb0:
            continue
        growth[role] = round((end["mb"][role] - mb0) / mb0, 4)
        mid_t = (t0 + end["t"]) / 2
        mid = next((x["mb"][role] for x in samples if x["t"] >= mid_t and role in x["mb"]
                    and (role != "drafter" or x.get("drafter_pid") == end.get("drafter_pid"))), None)
        if mid:
            second_half[role] = round((end["mb"][role] - mid) / mid, 4)
    total_s, total_e = sum(start.get("mb", {}).values()), sum(end["mb"].values())
    measured = [d["growth"] for d in drafters if d["growth"] is not None]
    return {"start_mb": start.get("mb", {}), "end_mb": end["mb"], "start_t_s": start.get("t"),
            "end_t_s": end["t"], "from": {role: t for role, (t, _) in begin.items()}, "notes": notes,
            "growth": growth, "second_half_growth": second_half, "drafters": drafters,
            "all_drafters_measured": bool(drafters) and len(measured) == len(drafters),
            "total_growth": round((total_e - total_s) / total_s, 4) if total_s else None,
            "ok": bool(growth) and all(g < MEMORY_GROWTH_LIMIT for g in [*growth.values(), *measured])
                  and len(measured) == len(drafters),
            "samples": [{"t": x["t"], "drafter_pid": x.get("drafter_pid"), **x["mb"]} for x in samples]}


def hit_rates(polls: list[dict], kills: list[dict], warmup_s: float) -> dict:
    """Speculation-cache hit rate (hits / lookups, from /metrics) over windows of the run: after the warm-up
    to the first kill, and from the last replacement's drafts flowing again to the end (the new drafter's
    cache starts empty)."""
    def window(t0: float, t1: float) -> dict | None:
        inside = [p for p in polls if t0 <= p["t"] <= t1 and p.get("lookups") is not None]
        if len(inside) < 2:
            return None
        lookups = inside[-1]["lookups"] - inside[0]["lookups"]
        hits = inside[-1]["hits"] - inside[0]["hits"]
        return {"from_t_s": inside[0]["t"], "to_t_s": inside[-1]["t"], "lookups": lookups, "hits": hits,
                "hit_rate": round(hits / lookups, 4) if lookups else None}
    end = polls[-1]["t"] if polls else 0.0
    first_kill = kills[0]["at_s"] if kills else end
    out = {"before_kill": window(warmup_s, first_kill)}
    if kills:
        k = kills[-1]
        back = k.get("recovered_after_s") or k.get("ready_after_s")
        out["after_recovery"] = None if back is None else window(k["at_s"] + back, end)
    return out


def speculation(m: dict[str, float]) -> dict:
    drafts, draft_tokens, accepted = m.get(DRAFTS, 0.0), m.get(DRAFT_TOKENS, 0.0), m.get(ACCEPTED, 0.0)
    lookups = m.get(LOOKUPS, 0.0)
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "cache_hit_rate": m.get(HITS, 0.0) / lookups if lookups else None,
            "drafter_failures": m.get(FAILURES, 0.0), "drafter_restarts": m.get(RESTARTS)}


def main(argv: list[str] | None = None) -> int:
    from run import machine_info

    from saguaro_vllm.tools.server_process import VLLMServer

    a = parse_args(argv)
    date = datetime.date.today().isoformat()
    out_path = Path(a.out) if a.out else RESULTS / f"{date}-{a.name}.json"
    with tempfile.TemporaryDirectory(prefix="saguaro-soak-") as tmp:
        tmp = Path(tmp)
        target, draft, which, prompts = pick_pair(a, tmp)
        spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": a.k, "saguaro": {"mode": "async"}}
        (tmp / "saguaro.json").write_text(json.dumps(spec))
        prom = tmp / "prometheus"
        prom.mkdir()
        log = Path(a.keep_log) if a.keep_log else tmp / "server.log"
        args = ["--speculative-config", str(tmp / "saguaro.json"), "--served-model-name", "soak", "--dtype",
                "float32", "--max-model-len", str(a.max_model_len), "--enforce-eager", "--max-num-seqs",
                str(max(a.clients, 1))]
        env = {"PROMETHEUS_MULTIPROC_DIR": str(prom),
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        print(f"[soak] {which} pair: {target} / {draft}; {a.clients} clients for {a.duration:g} s, "
              f"drafter kills at {a.kill_at} s", flush=True)
        load_before = os.getloadavg()
        server = VLLMServer(target, args, env=env, log_path=str(log))
        t0 = time.monotonic()
        try:
            server.start()
        except Exception:
            print(log.read_text()[-4000:] if log.exists() else "", file=sys.stderr)
            raise
        startup_s = time.monotonic() - t0
        try:
            own = {p.pid for _, p in server.processes()} | {os.getpid()}
            cpu_start = others_cpu_s()
            run = asyncio.run(soak(a, server, "soak", prompts))
            own |= {pid for poll in run["polls"] for pid in poll["drafters"]}
            cpu_end = {**run["cpu_seen"], **others_cpu_s()}
            load_after = os.getloadavg()
        finally:
            server.stop()
        log_tail = [ln for ln in log.read_text(errors="replace").splitlines() if "Saguaro" in ln][-30:]
    kill_events = run["events"].get("kills", [])
    kills = [recovery(run["polls"], k, run["done"], run["start"],
                      until=kill_events[i + 1]["t"] if i + 1 < len(kill_events) else None)
             for i, k in enumerate(kill_events)]
    others = {}
    for pid, (cmd, cpu) in cpu_end.items():
        if pid in own:
            continue
        used = cpu - cpu_start.get(pid, (cmd, 0.0))[1]
        if used > 0.5:
            others[f"{pid} {cmd}"] = round(used, 1)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "name": a.name,
        "command": " ".join(["benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(), "models": which, "target": target, "draft": draft,
        "settings": {"duration_s": a.duration, "clients": a.clients, "k": a.k, "mode": "async",
                     "kill_at_s": a.kill_at, "max_model_len": a.max_model_len, "temperatures": a.temperatures,
                     "greedy_share": round(sum(t == 0 for t in a.temperatures) / len(a.temperatures), 3),
                     "lengths": LENGTHS, "seed": a.seed, "warmup_s": a.warmup_s,
                     "drafter_settle_s": a.drafter_settle_s},
        "startup_s": round(startup_s, 1), "traffic_s": round(run["traffic_s"], 1), "drain_s": round(run["drain_s"], 1),
        "summary": summarize(run["done"], run["traffic_s"]),
        "errors": len(run["errors"]), "error_samples": run["errors"][:20],
        "kills": kills,
        "speculation": speculation(run["metrics"]) | {"hit_rate_windows": hit_rates(run["polls"], kills, a.warmup_s)},
        "memory": {**memory_growth(run["events"], a.warmup_s, kills, a.drafter_settle_s),
                   "kill_jumps": kill_jumps(run["events"], kills)},
        "load": {"loadavg_before": load_before, "loadavg_after": load_after,
                 "loadavg_1min_during": {"mean": round(statistics.fmean(x[1] for x in run["events"]["loadavg"]), 2),
                                         "max": max(x[1] for x in run["events"]["loadavg"])}
                 if run["events"].get("loadavg") else None,
                 "other_processes_cpu_s": dict(sorted(others.items(), key=lambda kv: -kv[1])[:15]),
                 "other_cpu_s_total": round(sum(others.values()), 1)},
        "timeline": [{k: p[k] for k in ("t", "requests", "tokens", "errors", "drafts", "restarts", "state", "lookups",
                                        "hits")}
                     for p in run["polls"]],
        "log_excerpt": log_tail,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    s = result["summary"]
    print(f"[soak] {s['requests']} requests, {result['errors']} errors, {s['tokens_per_s']:.1f} tok/s, "
          f"latency p50/p99 {s['latency_s']['p50']:.2f}/{s['latency_s']['p99']:.2f} s, "
          f"TPOT p50/p99 {1e3 * (s['tpot_s']['p50'] or 0):.1f}/{1e3 * (s['tpot_s']['p99'] or 0):.1f} ms; "
          f"kills: {result['kills']}; hit rate {result['speculation']['cache_hit_rate']} "
          f"({result['speculation']['hit_rate_windows']}); memory growth {result['memory']['growth']}, drafters "
          f"{[(d['which'], d['growth']) for d in result['memory']['drafters']]} (ok={result['memory']['ok']}); "
          f"others used {result['load']['other_cpu_s_total']} CPU s -> {out_path}")
    return 0 if result["errors"] == 0 and result["memory"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
