"""Soak: concurrent clients against `vllm serve` with Saguaro (`mode: async`) for minutes, with drafter faults
on a schedule. Not a unit test: a script that measures and reports.

`--clients` clients (asyncio, the `openai` client; default 4) loop over requests with mixed temperatures
(`--temperatures`, default 0, 0, 0, 0.7: three in four greedy; sampled ones with top-p / top-k half the
time), lengths (8-256 tokens) and stop conditions (max_tokens with ignore_eos, EOS, stop strings, stop token
ids; completions and chat). Optional shares of the traffic (`--stream-share`, `--cancel-share`, `--n-share`,
`--long-share`): requests that are not streamed, streams the client closes after a few chunks (the server
must abort them), sampled requests with n = 2 or 3 choices, and prompts that leave 2-64 tokens of
`max_model_len`. Faults: a drafter SIGKILL at each `--kill-at`, a SIGSTOP (a hang, never continued: the
plugin's step deadline must notice it, kill the process and start another) at each `--stop-at`, or both
alternating every `--fault-every` seconds.

Reported: requests completed, errors (must be 0), tokens/s, p50/p99 latency, time to first token and time per
output token, per fault how long the drafter took to be back (drafts flowing again) and when the faulty
process was gone, the speculation-cache hit rate (over the run, before the first fault, between faults and
after the last recovery, and over time), the resident memory of every process of the server's tree (API
server, engine core, worker, each drafter: the first one and every replacement, each measured over its own
life) sampled every ~5 s (growth after a warm-up must stay under 5 %; a fitted trend per hour beside it),
Saguaro's dashboard metrics (every `vllm:saguaro_*` sample of `/metrics`, every `--dashboard-every` s). Also
the CPU time that processes outside the tree used meanwhile (others sharing the cores; sampled every ~5 s, so
processes that exit during the run count too) and the 1-minute load average during the run.

`--compare-greedy`: every greedy request's prompt token ids and output token ids are recorded
(`return_token_ids`), and after the soak the prompts are replayed with the same stop settings through a plain
vLLM engine without speculation and without plugins (`LLM(...)` in a fresh process, `VLLM_PLUGINS=""`): every
output must be equal token for token (a closed stream: a prefix of the plain output). The plain engine's
top-2 logprob gap at each token tells whether a mismatch sat on a near-tie.

The defaults are chosen so that SSD is exercised: on a 2-core CPU the pre-drafted branches pay (and run)
only at small batches and mostly greedy rows (docs/benchmarks.md: hit rate ~0.9 at T=0 for batch 1-16, ~0
for sampled batches >= 2, where the drafter skips its branch steps); the 2026-12-04 soak (64 clients, half
sampled, the raw pair, whose draft costs as much as its 7 ms target step) had a hit rate of 0.001, i.e. it
soaked `sync`-like serving. That load is still `--clients 64 --temperatures 0,0,0.7,1 --models raw`.

`--full` is the soak of issue 44: the embedded pair (below), 4 clients, temperatures 0,0,0,0,0,0.7,1, a quarter
of the requests not streamed, a tenth closed mid-stream, a tenth with n > 1, a tenth near max_model_len,
a SIGKILL and a SIGSTOP alternating every 360 s (five faults in 30 minutes), the greedy replay, a warm-up of
min(120 s, duration / 6), `saguaro.max_restarts: 50` and `saguaro.fallback: off`.

The restart budget: the default, 5, refills only after 10 healthy minutes, so the five faults spend it
exactly; on a machine shared with other runs, replacements the plugin makes on its own (a drafter that got no
CPU time during a deadline of 1-1.4 s is judged hung) spend it earlier, and speculation stops
(benchmarks/results/2026-12-07-soak-default-budget.json). With 50 the soak keeps speculating there and lists
every such replacement (`unexpected_replacements`: the plugin's log line and the process's last /proc samples).
`--full --fallback auto --max-restarts 5` is the soak with the plugin's defaults, for a machine to itself.

`fallback: off`: every round pre-drafts, so SSD's machinery (branches, speculation cache, branch KV blocks)
runs on every step for the whole soak. With the default (`auto`) on the
2-core machine shared with other test runs (load average ~8), a 3-minute run with 6 clients and 60 % greedy
requests pre-drafted 16 % of its rounds (the rest drafted as `sync` does: pre-drafting measured no faster
there) and hit 0.07; with `off` 0.11, the drafter skipping the branch steps of 65 % of the rounds (their
expected saving below the lateness they cause); 4 clients and 71 % greedy hit 0.28. Other options given
beside it override its choices.

Bounded: clients stop starting requests at `--duration`, in-flight requests get `--drain-s` to finish, then
the server is stopped. Traffic goes to 127.0.0.1 only. Result: `benchmarks/results/<date>-soak.json` and a
plot beside it (`<date>-soak.png`: memory per process, hit rate and tokens/s over time, the faults), rendered
on docs/benchmarks.md and docs/troubleshooting.md by benchmarks/report.py.

    .venv/bin/python benchmarks/soak.py --duration 30            # quick check
    .venv/bin/python benchmarks/soak.py --kill-at 120 --warmup-s 60   # 5 minutes, one kill
    .venv/bin/python benchmarks/soak.py --full --duration 1800   # issue 44's soak: 30 minutes
    .venv/bin/python benchmarks/soak.py --full --duration 1800 --fallback auto --max-restarts 5   # the defaults
    .venv/bin/python benchmarks/soak.py --full --duration 180 --fault-every 60 --name soak-debug   # 3 minutes
    .venv/bin/python benchmarks/soak.py --temperatures 0 --name soak-greedy-reference   # greedy only
    .venv/bin/python benchmarks/soak.py --model T --draft D      # another pair
    .venv/bin/python benchmarks/soak.py --replot benchmarks/results/<date>-soak.json   # its plot again

Model: `--model/--draft`, else `--models embedded`: a tiny pair from `tests/distribution.build_embedded_pair`
(the draft, hidden 32 and 2 layers, embedded in a wider target that computes the same function, so
acceptance is ~1 while the draft costs `--ratio` of the target, default 0.05; vocabulary `--vocab`, default
32000) with a word-level tokenizer (`w<id>` words), built once under the Saguaro cache; else the demo pair if
it is built (`make demo`): its cost-matched twins (`--models cost`, the default, as in benchmarks/run.py; the
raw pair if they are not built) or the raw trained pair (`--models raw`); else a tiny random pair built like
the tests' (tests/tiny_models.py) in a temporary directory.
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
import subprocess
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
GENERATED = "vllm:generation_tokens_total"
#: vLLM's own series kept beside Saguaro's in the dashboard samples (the rest of vLLM's page is left out).
DASHBOARD_VLLM = ("vllm:num_requests_running", "vllm:num_requests_waiting", GENERATED, DRAFTS, DRAFT_TOKENS,
                  ACCEPTED, "vllm:request_success_total")
MEMORY_GROWTH_LIMIT = 0.05
MEMORY_EVERY_POLLS = 5  # one memory sample per 5 polls (~5 s)
TEMPERATURES = (0.0, 0.0, 0.0, 0.7)
LENGTHS = (8, 32, 64, 128, 256)
TINY_PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "import os\nimport sys\nprint(", "for i in range(10):",
                "class Point:\n    def __init__(self, x, y):", "print(os.getcwd(), sys.argv)", "The lazy dog",
                "    return a + b\n"]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}
#: What `--full` chooses (issue 44's soak); options given beside it win.
FULL = {"models": "embedded", "clients": 4, "temperatures": [0.0] * 5 + [0.7, 1.0], "stream_share": 0.75,
        "cancel_share": 0.1, "n_share": 0.1, "long_share": 0.1, "compare_greedy": True, "fault_every": 360.0,
        "fallback": "off", "max_restarts": 50}
#: Tokens left to max_model_len by a prompt near it (`--long-share`), drawn per request.
LONG_ROOM = (2, 8, 16, 64)
#: Word ids of such prompts for the word-level tokenizer: below this (`w2`-`w999`).
LONG_WORDS = 1000
#: Embedded pair's draft (tests/distribution.build_embedded_pair): hidden and layers, as benchmarks/regimes.py.
EMBEDDED_DRAFT_HIDDEN, EMBEDDED_LAYERS = 32, 2


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


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a share is between 0 and 1, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true",
                   help="issue 44's soak: embedded pair, mixed traffic, SIGKILL/SIGSTOP every 360 s, greedy replay")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default 300)")
    p.add_argument("--clients", type=int, default=4,
                   help="concurrent clients (default 4: SSD's branches run at small batches on a CPU)")
    p.add_argument("--temperatures", type=_temperatures, default=list(TEMPERATURES),
                   help="temperatures each request draws from, comma-separated (default 0,0,0,0.7)")
    p.add_argument("--models", choices=["cost", "raw", "embedded"], default="cost",
                   help="demo pair: its cost-matched twins (default) or the raw trained models; or the embedded "
                        "tiny pair (--ratio, --vocab)")
    p.add_argument("--ratio", type=float, default=0.05,
                   help="embedded pair: the draft's compute per token over the target's (default 0.05)")
    p.add_argument("--vocab", type=int, default=32000, help="embedded pair: vocabulary size (default 32000)")
    p.add_argument("--kill-at", type=_seconds_list, default=None,
                   help="seconds into the traffic of each drafter SIGKILL, comma-separated (default: duration / 2 "
                        "unless --stop-at or --fault-every is given); several kills tell memory a restart leaves "
                        "behind from a one-time fill")
    p.add_argument("--stop-at", type=_seconds_list, default=None,
                   help="seconds into the traffic of each drafter SIGSTOP (a hang, never continued)")
    p.add_argument("--fault-every", type=float, default=None,
                   help="a SIGKILL and a SIGSTOP alternating every this many seconds, the first at half of it")
    p.add_argument("--no-kill", action="store_true", help="no drafter fault (a reference run)")
    p.add_argument("--plain", action="store_true",
                   help="no speculative config at all (a reference for the memory of vLLM's own processes under "
                        "the same traffic); implies --no-kill and no greedy replay")
    p.add_argument("--stream-share", type=_share, default=1.0, help="share of the requests streamed (default 1)")
    p.add_argument("--cancel-share", type=_share, default=0.0,
                   help="share of the streamed requests the client closes after 1-8 chunks (default 0)")
    p.add_argument("--n-share", type=_share, default=0.0,
                   help="share of the sampled requests with n = 2 or 3 choices (default 0)")
    p.add_argument("--long-share", type=_share, default=0.0,
                   help="share of the requests whose prompt leaves 2-64 tokens of max_model_len (default 0)")
    p.add_argument("--compare-greedy", action="store_true",
                   help="record greedy outputs and replay their prompts through plain vLLM after the soak")
    p.add_argument("--dashboard-every", type=float, default=10.0,
                   help="seconds between samples of every vllm:saguaro_* series of /metrics (default 10)")
    p.add_argument("--max-restarts", type=int, default=None, help="saguaro.max_restarts (default: the plugin's)")
    p.add_argument("--fallback", choices=["auto", "off"], default=None,
                   help="saguaro.fallback (default: the plugin's, auto; --full: off, so that every round pre-drafts "
                        "on a machine whose contention would make auto draft most rounds as sync does)")
    p.add_argument("--no-plot", action="store_true", help="no PNG beside the result")
    p.add_argument("--model", help="target model directory (with --draft)")
    p.add_argument("--draft", help="draft model directory (with --model)")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--warmup-s", type=float, default=None,
                   help="traffic before the 'start' memory sample (default min(30, duration / 10); with --full "
                        "min(120, duration / 6))")
    p.add_argument("--drafter-settle-s", type=float, default=15.0,
                   help="a replacement drafter's memory is measured from its first sample this long after it was "
                        "ready (it builds every oneDNN shape before it reports ready; default 15)")
    p.add_argument("--drain-s", type=float, default=120.0, help="time in-flight requests get after --duration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="soak")
    p.add_argument("--out", help="result JSON (default benchmarks/results/<date>-<name>.json)")
    p.add_argument("--keep-log", help="keep the server log in this file")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--full", action="store_true")
    if pre.parse_known_args(argv)[0].full:
        p.set_defaults(**FULL)
    a = p.parse_args(argv)
    if a.plain:
        a.no_kill, a.compare_greedy = True, False
    if (a.model is None) != (a.draft is None):
        p.error("--model and --draft go together")
    if a.duration <= 0 or a.clients <= 0:
        p.error("--duration and --clients must be positive")
    if a.fault_every is not None and a.fault_every <= 0:
        p.error("--fault-every must be positive")
    stops = [] if a.no_kill else sorted(a.stop_at or [])
    if a.no_kill:
        kills = []
    elif a.kill_at is not None:
        kills = sorted(a.kill_at)
    elif a.stop_at is None and a.fault_every is None:
        kills = [a.duration / 2]
    else:
        kills = []
    faults = [(t, "SIGKILL") for t in kills] + [(t, "SIGSTOP") for t in stops]
    if a.fault_every is not None and not a.no_kill:
        t, i = a.fault_every / 2, 0
        while t < a.duration:
            faults.append((t, "SIGKILL" if i % 2 == 0 else "SIGSTOP"))
            t, i = t + a.fault_every, i + 1
    a.faults = sorted(faults)
    a.kill_at = [t for t, sig in a.faults if sig == "SIGKILL"]
    a.stop_at = [t for t, sig in a.faults if sig == "SIGSTOP"]
    for t, sig in a.faults:
        if not 0 < t < a.duration:
            p.error(f"--kill-at / --stop-at must be inside the traffic (0, {a.duration:g}), got {t:g} ({sig})")
    if a.warmup_s is None:
        a.warmup_s = min(120.0, a.duration / 6) if a.full else min(30.0, a.duration / 10)
    if not a.temperatures or any(t < 0 for t in a.temperatures):
        p.error("--temperatures: one or more temperatures >= 0")
    return a


# ------------------------------------------------------------------------------------------------ models

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def write_word_tokenizer(path: Path, vocab: int, max_len: int) -> None:
    """A word-level tokenizer for a model without one: id i is the word `w<i>` (0 `<s>`, 1 `<unk>`, the last id
    `</s>`, the pair's EOS), words split on whitespace and joined with spaces, so a prompt of n words is n
    tokens and any output decodes (stop strings, chats)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {"<s>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab - 1)}, "</s>": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with a space
    tok.add_special_tokens(["<s>", "<unk>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": max_len, "chat_template": CHAT_TEMPLATE}))


def embedded_pair(vocab: int, ratio: float, positions: int) -> tuple[Path, Path, int]:
    """(target, draft, width): benchmarks/regimes.py's embedded pair for (ratio, vocab), with `positions`
    positions and a word-level tokenizer in both directories; built once under the Saguaro cache."""
    from regimes import width_for

    width = width_for(ratio, vocab)
    base = Path(os.environ.get("SAGUARO_CACHE", Path.home() / ".cache" / "saguaro-vllm"))
    root = base / "soak" / f"embedded-v{vocab}-w{width}-p{positions}"
    draft = root / "draft"
    target = draft if width == EMBEDDED_DRAFT_HIDDEN else root / f"target-w{width}"
    if not all((d / f).exists() for d in (target, draft) for f in ("model.safetensors", "tokenizer.json")):
        sys.path.insert(0, str(ROOT / "tests"))
        from distribution import build_embedded_pair

        target, draft = build_embedded_pair(root, vocab_size=vocab, width=width, draft_hidden=EMBEDDED_DRAFT_HIDDEN,
                                            num_layers=EMBEDDED_LAYERS, max_positions=positions)
        for d in {target, draft}:
            write_word_tokenizer(d, vocab, positions)
    return target, draft, width


def word_prompts(vocab: int, count: int = 32, seed: int = 1234) -> list[str]:
    """Prompts of 6-40 random words of the word-level tokenizer (as many tokens)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(2, vocab - 1)}" for _ in range(rng.randrange(6, 41))) for _ in range(count)]


def pick_pair(a: argparse.Namespace, tmp: Path) -> tuple[str, str, str, list[str]]:
    """(target, draft, which, prompts): --model/--draft, else the embedded pair with `--models embedded`, else
    the built demo pair (its cost-matched twins with `--models cost` where built), else a tiny random pair."""
    if a.model:
        return a.model, a.draft, "given", TINY_PROMPTS
    if a.models == "embedded":
        positions = max(1024, a.max_model_len)
        target, draft, width = embedded_pair(a.vocab, a.ratio, positions)
        a.embedded = {"vocab": a.vocab, "ratio": a.ratio, "width": width, "draft_hidden": EMBEDDED_DRAFT_HIDDEN,
                      "layers": EMBEDDED_LAYERS, "positions": positions}
        which = (f"embedded (draft hidden {EMBEDDED_DRAFT_HIDDEN} in a target of hidden {width}, vocabulary "
                 f"{a.vocab}, compute ratio <= {a.ratio:g}; tests/distribution.build_embedded_pair)")
        return str(target), str(draft), which, word_prompts(a.vocab)
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


class LongPrompts:
    """Prompts that leave a few tokens of max_model_len: text of exactly that many words for the word-level
    tokenizer (chats allowed), else token ids cut from the pair's own prompts (completions only)."""

    def __init__(self, target: str, prompts: list[str], max_model_len: int, word_vocab: int | None):
        self.max_model_len, self.word_vocab = max_model_len, word_vocab
        self.ids: list[int] = []
        if word_vocab is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(target)
            while len(self.ids) < max_model_len:
                for text in prompts:
                    self.ids += tok.encode(text, add_special_tokens=False)

    def draw(self, rng: random.Random) -> tuple[str | list[int], int]:
        """(prompt, its length in tokens)."""
        length = self.max_model_len - rng.choice(LONG_ROOM)
        if self.word_vocab is not None:
            # words of at most 4 characters: vLLM refuses a text longer than 6 characters per token of
            # max_model_len before it tokenizes it
            top = min(LONG_WORDS, self.word_vocab - 1)
            return " ".join(f"w{rng.randrange(2, top)}" for _ in range(length)), length
        start = rng.randrange(0, len(self.ids) - length + 1)
        return self.ids[start:start + length], length


# ------------------------------------------------------------------------------------------- requests

STOP_STRINGS = ([["\n"], [" the", "):"], ["e"]])
#: Stop strings for the word-level tokenizer's text (`w<id>` words joined by spaces): frequent to rare.
WORD_STOP_STRINGS = ([["w7"], ["w42", "w99"], ["3 w"]])


def request_plan(rng: random.Random, prompts: list[str], temperatures=TEMPERATURES, mix: dict | None = None,
                 long_prompts: LongPrompts | None = None) -> dict:
    """One request: endpoint, prompt and sampling, drawn from the soak's mix. `mix` (shares of streamed,
    cancelled, n > 1 and near-max_model_len requests, whether greedy outputs are recorded, the word-level stop
    strings): nothing beyond the base mix is drawn where it is absent, so the base plans stay the same."""
    mix = mix or {}
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
        body["stop"] = rng.choice(WORD_STOP_STRINGS if mix.get("word_stops") else STOP_STRINGS)
    elif stop == "stop-token":
        extra["stop_token_ids"] = [rng.randrange(2, 300)]
    plan = {"chat": rng.random() < 0.25, "prompt": rng.choice(prompts), "body": body, "extra": extra,
            "stop": stop, "stream": True, "n": 1, "cancel_after": None, "long": False, "prompt_len": None}
    if mix.get("stream_share", 1.0) < 1.0:
        plan["stream"] = rng.random() < mix["stream_share"]
    if long_prompts is not None and mix.get("long_share") and rng.random() < mix["long_share"]:
        plan["prompt"], plan["prompt_len"] = long_prompts.draw(rng)
        plan["long"] = True
        plan["chat"] = plan["chat"] and isinstance(plan["prompt"], str)
    if plan["stream"] and not plan["long"] and mix.get("cancel_share") and rng.random() < mix["cancel_share"]:
        # closed after a few chunks of a long stream (not one near max_model_len), so mid-way: no stop
        # condition can end it first
        plan["cancel_after"] = rng.randrange(1, 9)
        plan["stop"] = "cancel"
        body.pop("stop", None)
        body["max_tokens"] = LENGTHS[-1]
        extra.pop("stop_token_ids", None)
        extra["ignore_eos"] = True
    if temperature > 0 and mix.get("n_share") and rng.random() < mix["n_share"]:
        plan["n"] = rng.choice([2, 3])  # vLLM allows n > 1 for sampled requests only
    plan["record"] = bool(mix.get("record")) and temperature == 0
    return plan


def _extra(obj, name: str):
    """A field vLLM adds to the OpenAI schema (the client keeps unknown fields as extras)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


async def one_request(client, model: str, plan: dict) -> dict:
    """One request (streamed or not, n choices, maybe closed mid-stream); returns its timings and token count
    (raises on any error or an inconsistent answer). With `record`, the prompt and output token ids."""
    t0 = time.monotonic()
    first = None
    n, streamed, cancel_after = plan.get("n", 1), plan.get("stream", True), plan.get("cancel_after")
    extra = dict(plan["extra"], **({"return_token_ids": True} if plan.get("record") else {}))
    common = dict(model=model, extra_body=extra, **plan["body"], **({"n": n} if n > 1 else {}))
    if streamed:
        common.update(stream=True, stream_options={"include_usage": True})
    if plan["chat"]:
        call = client.chat.completions.create(messages=[{"role": "user", "content": plan["prompt"]}], **common)
    else:
        call = client.completions.create(prompt=plan["prompt"], **common)
    finishes: list[str | None] = [None] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    prompt_ids = None
    tokens = None
    cancelled = False
    last, max_gap, chunks = None, 0.0, 0
    if not streamed:
        resp = await call
        first = None  # no first token a client sees before the whole answer
        for c in resp.choices:
            finishes[c.index] = c.finish_reason
            ids[c.index] = list(_extra(c, "token_ids") or [])
            prompt_ids = prompt_ids or _extra(c, "prompt_token_ids")
        prompt_ids = prompt_ids or _extra(resp, "prompt_token_ids")
        tokens = resp.usage.completion_tokens if resp.usage is not None else None
    else:
        stream = await call
        async for chunk in stream:
            prompt_ids = prompt_ids or _extra(chunk, "prompt_token_ids")
            got = False
            for c in chunk.choices:
                text = c.delta.content if plan["chat"] else c.text
                delta = _extra(c, "token_ids")
                if delta:
                    ids[c.index] += list(delta)
                prompt_ids = prompt_ids or _extra(c, "prompt_token_ids")
                got = got or bool(text) or bool(delta)
                finishes[c.index] = c.finish_reason or finishes[c.index]
            if got:
                now = time.monotonic()
                first = now if first is None else first
                max_gap = max(max_gap, now - last) if last is not None else 0.0
                last = now
                chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if cancel_after is not None and chunks >= cancel_after:
                await stream.close()  # the client goes away mid-stream: the server must abort the request
                cancelled = True
                break
    end = time.monotonic()
    if not cancelled:
        if any(f is None for f in finishes) or tokens is None:
            raise RuntimeError(f"answer without finish_reason/usage (finish={finishes}, tokens={tokens})")
        if plan.get("record") and sum(map(len, ids)) != tokens:
            raise RuntimeError(f"token ids ({[len(x) for x in ids]}) do not add up to usage ({tokens})")
    elif not any(f is None for f in finishes):
        raise RuntimeError("a stream meant to be closed mid-way finished first")  # the plan is wrong, not vLLM
    out = {"start": t0, "first": first, "end": end, "max_gap": max_gap,
           "tokens": tokens if tokens is not None else sum(map(len, ids)) or chunks,
           "finish": "cancelled" if cancelled else (finishes[0] if n == 1 else ",".join(sorted(set(finishes)))),
           "stop": plan["stop"], "chat": plan["chat"], "temperature": plan["body"]["temperature"],
           "stream": streamed, "n": n, "cancelled": cancelled, "long": plan.get("long", False),
           "prompt_len": plan.get("prompt_len")}
    if plan.get("record"):
        if not prompt_ids:
            raise RuntimeError("no prompt_token_ids in the answer (return_token_ids)")
        out["greedy"] = {"prompt_token_ids": list(prompt_ids), "output_token_ids": ids[0],
                         "max_tokens": plan["body"]["max_tokens"], "stop": plan["body"].get("stop"),
                         "stop_token_ids": plan["extra"].get("stop_token_ids"),
                         "ignore_eos": bool(plan["extra"].get("ignore_eos")), "finish": out["finish"]}
    return out


async def client_loop(idx: int, client, model: str, prompts: list[str], stop_at: float, seed: int,
                      done: list[dict], errors: list[str], temperatures=TEMPERATURES, mix: dict | None = None,
                      long_prompts: LongPrompts | None = None, t0: float | None = None) -> None:
    rng = random.Random(seed * 1000 + idx)
    while time.monotonic() < stop_at:
        plan = request_plan(rng, prompts, temperatures, mix, long_prompts)
        try:
            done.append(await one_request(client, model, plan))
        except Exception as err:  # every error counts; the soak goes on
            at = f"{time.monotonic() - t0:.1f} s" if t0 is not None else f"{time.monotonic() - stop_at:+.1f} s"
            errors.append(f"client {idx} at {at}: {type(err).__name__}: {err}"
                          f" (plan {plan['stop']}, chat={plan['chat']}, stream={plan['stream']}, n={plan['n']}, "
                          f"long={plan['long']})")
            await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------------ observing

def scrape(server) -> tuple[dict[str, float], str | None, dict[str, float]]:
    """/metrics summed per sample name over labels, the drafter client's state (the label of
    `vllm:saguaro_drafter_state` that is 1; None where the gauge is absent), and every sample as it is."""
    from saguaro_vllm.tools.server_process import drafter_state, metric_totals

    samples = server.metric_samples()
    return metric_totals(samples), drafter_state(samples), samples


def dashboard_sample(samples: dict[str, float]) -> dict[str, float]:
    """What Saguaro's dashboard shows (docs/grafana): every `vllm:saguaro_*` series (histograms by their sum and
    count, not their buckets) and a few of vLLM's own."""
    out = {}
    for key, value in samples.items():
        name = key.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")):
            continue
        if name.startswith("vllm:saguaro_") or name in DASHBOARD_VLLM:
            out[key] = value
    return out


def memory_mb(server) -> dict[str, float]:
    """Resident memory per role of the server's process tree, summed within a role."""
    return memory_sample(server)[0]


def memory_sample(server) -> tuple[dict[str, float], dict[str, dict]]:
    """Resident MB per role (summed within a role) and, per process, its role, resident MB and CPU seconds."""
    roles: dict[str, float] = {}
    procs: dict[str, dict] = {}
    for role, proc in server.processes():
        try:
            with proc.oneshot():
                mb, cpu = proc.memory_info().rss / 2**20, proc.cpu_times()
        except Exception:  # exited meanwhile
            continue
        roles[role] = roles.get(role, 0.0) + mb
        procs[str(proc.pid)] = {"role": role, "mb": round(mb, 1), "cpu_s": round(cpu.user + cpu.system, 1)}
    return {k: round(v, 1) for k, v in sorted(roles.items())}, procs


class DrafterWatch:
    """Every `every_s`, each drafter process's run state and CPU seconds (from /proc/<pid>/stat, what the plugin's
    hang probe reads) and the machine's runnable tasks (/proc/loadavg), the last `keep` samples per process. When
    a drafter is replaced without a scheduled fault, its last seconds tell a starved process (state R, little
    CPU) from a blocked (S, D) or a stopped or traced (T, t) one."""

    def __init__(self, start: float, every_s: float = 0.1, keep: int = 80):
        import collections
        import threading

        self.start, self.every_s = start, every_s
        self.pids: set[int] = set()
        self.history: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=keep))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="drafter-watch")
        self._thread.start()

    def watch(self, pids: list[int]) -> None:
        self.pids |= set(pids)  # a process is read until it is gone

    def _run(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(self.every_s):
            try:
                running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            except (OSError, ValueError, IndexError):
                running = None
            for pid in list(self.pids):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    self.pids.discard(pid)
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                self.history[pid].append((round(time.monotonic() - self.start, 2), fields[0],
                                          round((int(fields[11]) + int(fields[12])) / ticks, 2), running))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def unexpected_replacements(polls: list[dict], faults: list[dict], watch: DrafterWatch | None,
                            warnings: list[str]) -> list[dict]:
    """Drafters that went away without a scheduled fault (the plugin restarted them on its own: a crash, or a
    step it judged hung), with the plugin's own log line for each and their last /proc samples
    (`DrafterWatch`): [t, state, CPU seconds, runnable tasks on the machine]."""
    victims = {k["pid"] for k in faults}
    seen: dict[int, float] = {}
    for p in polls:
        for pid in p["drafters"]:
            seen[pid] = p["t"]
    last_t = polls[-1]["t"] if polls else 0.0
    out = []
    for pid, t in seen.items():
        if pid in victims or t >= last_t:  # a scheduled fault's victim, or alive at the end
            continue
        line = next((w for w in warnings if f"(pid {pid})" in w), None)
        hist = list(watch.history.get(pid, [])) if watch is not None else []
        out.append({"pid": pid, "last_seen_s": t, "log": line, "last_samples": [list(x) for x in hist[-40:]]})
    return out


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
    """Traffic figures. Latency over the requests that finished (not the closed streams), time to first token
    over streamed ones, time per output token over streamed single-choice ones."""
    finished = [r for r in done if not r.get("cancelled")]
    tokens = sum(r["tokens"] for r in done)
    lat = [r["end"] - r["start"] for r in finished]
    ttft = [r["first"] - r["start"] for r in done if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in finished
            if r["first"] is not None and r["tokens"] > 1 and r.get("n", 1) == 1]
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
            "sampled_requests": sum(r["temperature"] > 0 for r in done),
            "greedy_requests": sum(r["temperature"] == 0 for r in done),
            "by_temperature": {f"{t:g}": sum(r["temperature"] == t for r in done)
                               for t in sorted({r["temperature"] for r in done})},
            "streamed_requests": sum(r.get("stream", True) for r in done),
            "non_streamed_requests": sum(not r.get("stream", True) for r in done),
            "cancelled_requests": sum(bool(r.get("cancelled")) for r in done),
            "n_gt_1_requests": sum(r.get("n", 1) > 1 for r in done),
            "choices": sum(r.get("n", 1) for r in done),
            "long_prompt_requests": sum(bool(r.get("long")) for r in done),
            "long_prompt_finish_reasons": {f: sum(r["finish"] == f for r in done if r.get("long"))
                                           for f in sorted({r["finish"] for r in done if r.get("long")})}}


# ------------------------------------------------------------------------------------------------ run

async def soak(a: argparse.Namespace, server, model_name: str, prompts: list[str], mix: dict | None = None,
               long_prompts: LongPrompts | None = None) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)
    done: list[dict] = []
    errors: list[str] = []
    polls: list[dict] = []
    events: dict = {"dashboard": []}
    seen: dict[int, tuple[str, float]] = {}  # CPU seconds of every process, updated at each memory sample
    start = time.monotonic()
    stop_at = start + a.duration
    tasks = [asyncio.create_task(client_loop(i, client, model_name, prompts, stop_at, a.seed, done, errors,
                                             tuple(a.temperatures), mix, long_prompts, start))
             for i in range(a.clients)]
    bar = tqdm(total=int(a.duration), unit="s", desc="soak", dynamic_ncols=True)
    watch = DrafterWatch(start)
    pending_faults = list(a.faults)
    next_dashboard = 0.0
    while time.monotonic() < stop_at:
        await asyncio.sleep(1.0)
        now = time.monotonic() - start
        m, state, samples = await asyncio.to_thread(scrape, server)
        drafters = [p.pid for role, p in server.processes() if role == "drafter"]
        watch.watch(drafters)
        polls.append({"t": round(now, 2), "requests": len(done), "tokens": sum(r["tokens"] for r in done),
                      "errors": len(errors), "drafts": m.get(SAGUARO_DRAFT_TOKENS, 0.0), "state": state,
                      "restarts": m.get(RESTARTS), "failures": m.get(FAILURES, 0.0), "drafters": drafters,
                      "lookups": m.get(LOOKUPS, 0.0), "hits": m.get(HITS, 0.0), "generated": m.get(GENERATED)})
        if now >= next_dashboard:
            events["dashboard"].append({"t": round(now, 2), "samples": dashboard_sample(samples)})
            next_dashboard += a.dashboard_every
        if len(polls) % MEMORY_EVERY_POLLS == 0 or ("memory_start" not in events and now >= a.warmup_s):
            mb, procs = await asyncio.to_thread(memory_sample, server)
            sample = {"t": round(now, 2), "mb": mb, "procs": procs, "drafter_pid": drafters[0] if drafters else None}
            events.setdefault("memory_samples", []).append(sample)
            # processes of others that start and exit during the run count up to their last sample
            seen.update(await asyncio.to_thread(others_cpu_s))
            events.setdefault("loadavg", []).append((round(now, 2), round(os.getloadavg()[0], 2)))
            if "memory_start" not in events and now >= a.warmup_s:
                events["memory_start"] = sample
        if pending_faults and now >= pending_faults[0][0]:
            _, sig = pending_faults.pop(0)
            victim = drafters[0] if drafters else None
            if victim is not None:
                os.kill(victim, SIGNALS[sig])
            events.setdefault("kills", []).append({"t": round(time.monotonic() - start, 2), "pid": victim,
                                                   "signal": sig})
        bar.update(min(int(now), int(a.duration)) - bar.n)
        bar.set_postfix(done=len(done), err=len(errors), tok_s=f"{polls[-1]['tokens'] / now:.0f}")
    drafters = [p.pid for role, p in server.processes() if role == "drafter"]
    mb, procs = memory_sample(server)
    events["memory_end"] = {"t": round(time.monotonic() - start, 2), "mb": mb, "procs": procs,
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
    await asyncio.sleep(2.0)  # the last finished or aborted requests leave the drafter's gauges
    final, _, samples = await asyncio.to_thread(scrape, server)
    events["dashboard"].append({"t": round(time.monotonic() - start, 2), "samples": dashboard_sample(samples),
                                "after_drain": True})
    watch.stop()
    return {"done": done, "errors": errors, "polls": polls, "events": events, "start": start, "traffic_s": traffic_s,
            "drain_s": drain_s, "metrics": final, "cpu_seen": seen, "watch": watch}


def recovery(polls: list[dict], kill: dict | None, done: list[dict], start: float,
             until: float | None = None, dashboard: list[dict] | None = None) -> dict | None:
    """What the fault (a SIGKILL or a SIGSTOP) cost: the longest wait between two chunks of the requests in
    flight at it, when the faulty process was gone (a stopped one must be killed by the plugin), when the client
    was `ready` again with a new drafter, and when drafts flowed again (the first poll interval that began after
    the fault in which the proposer received draft tokens: the faulty drafter cannot have made them). Restarts,
    failures and failures by reason (from the dashboard samples) are counted up to `until` (the next fault)."""
    if not kill:
        return None
    at = start + kill["t"]
    polls = [p for p in polls if until is None or p["t"] < until]
    hit = [r for r in done if r["start"] <= at <= r["end"]]
    out = {"signal": kill.get("signal", "SIGKILL"), "killed_pid": kill["pid"], "at_s": kill["t"],
           "gone_after_s": None, "ready_after_s": None, "recovered_after_s": None, "new_pid": None, "states": [],
           "requests_in_flight": len(hit), "in_flight_max_chunk_gap_s": max((r["max_gap"] for r in hit), default=None)}
    for p in polls:
        if p["t"] >= kill["t"] and (not out["states"] or out["states"][-1][1] != p["state"]):
            out["states"].append((round(p["t"] - kill["t"], 2), p["state"]))  # the client's states after the kill
        if p["t"] > kill["t"] and out["gone_after_s"] is None and kill["pid"] not in p["drafters"]:
            out["gone_after_s"] = round(p["t"] - kill["t"], 2)
        if p["t"] > kill["t"] and out["ready_after_s"] is None and p["state"] == "ready" and p["drafters"] \
                and kill["pid"] not in p["drafters"]:
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
    if dashboard:
        prior = [d for d in dashboard if d["t"] < kill["t"]]
        later = [d for d in dashboard if d["t"] >= kill["t"] and (until is None or d["t"] < until)]
        if prior and later:
            key = "vllm:saguaro_drafter_failures_total{reason="
            a, b = prior[-1]["samples"], later[-1]["samples"]
            out["failures_by_reason"] = {k[len(key):-1].strip('"'): b[k] - a.get(k, 0.0) for k in sorted(b)
                                         if k.startswith(key) and b[k] - a.get(k, 0.0) > 0}
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


def trend_per_h(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per hour (None under 3 points or 60 s): a steady leak
    shows as a slope that a start/end growth over a short span could hide in noise."""
    if len(points) < 3 or points[-1][0] - points[0][0] < 60:
        return None
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return round(3600 * sum((t - mt) * (v - mv) for t, v in points) / var, 2) if var else None


def process_memory(samples: list[dict], from_t: float | None, faults: list[dict] | None = None,
                   drafters: list[dict] | None = None) -> dict[str, dict]:
    """Per process of the server's tree (from the per-process part of the samples): its role, when it was seen,
    resident MB at its first and last sample from `from_t` on (its own first sample if it started later; a
    drafter over the span `drafter_memory` measured), to its last sample before its fault if it had one, the
    least and most, the fitted trend, and the share of a core it used while sampled."""
    seen: dict[str, list[tuple[float, dict]]] = {}
    for x in samples:
        for pid, proc in (x.get("procs") or {}).items():
            seen.setdefault(pid, []).append((x["t"], proc))
    spans = {str(d["pid"]): (d["from_t_s"], d["to_t_s"]) for d in drafters or [] if d.get("from_t_s") is not None}
    out = {}
    for pid, own in seen.items():
        fault = next((k["at_s"] for k in faults or [] if str(k.get("killed_pid", k.get("pid"))) == pid), None)
        lo, hi = spans.get(pid, (from_t, None))
        span = [(t, p) for t, p in own if (lo is None or t >= lo) and (hi is None or t <= hi)
                and (fault is None or t < fault)] or own[-1:]
        (t0, p0), (t1, p1) = span[0], span[-1]
        # a drafter `drafter_memory` did not measure (it ran too short after loading) is not vouched for
        measured = own[0][1]["role"] != "drafter" or drafters is None or pid in spans
        out[pid] = {"role": own[0][1]["role"], "alive_t_s": [own[0][0], own[-1][0]], "from_t_s": t0, "to_t_s": t1,
                    "start_mb": p0["mb"], "end_mb": p1["mb"], "min_mb": min(p["mb"] for _, p in span),
                    "max_mb": max(p["mb"] for _, p in span),
                    "growth": round((p1["mb"] - p0["mb"]) / p0["mb"], 4) if p0["mb"] and measured else None,
                    "trend_mb_per_h": trend_per_h([(t, p["mb"]) for t, p in span]) if measured else None,
                    "cores": round((own[-1][1]["cpu_s"] - own[0][1]["cpu_s"]) / (own[-1][0] - own[0][0]), 3)
                    if own[-1][0] > own[0][0] else None}
    return out


def ready_times(polls: list[dict]) -> dict[int, float]:
    """When each drafter process was first seen with the client `ready` (it loaded and reported Ready): a
    replacement the plugin started on its own, without a scheduled fault, has its own time here."""
    out: dict[int, float] = {}
    for p in polls:
        if p.get("state") == "ready" and p["drafters"] and p["drafters"][0] not in out:
            out[p["drafters"][0]] = p["t"]
    return out


def drafter_memory(samples: list[dict], kills: list[dict], warmup_s: float, settle_s: float,
                   ready_at: dict[int, float] | None = None) -> list[dict]:
    """Each drafter process's own resident memory, first sample to last of the span measured: the first
    drafter from the warm-up to its last sample before the kill, every replacement from its first sample at
    least `settle_s` after it was ready (it builds its oneDNN shapes and writes its KV cache before it reports
    ready; `ready_at`, else the fault before it plus that fault's ready time) to its last one. Comparing two
    processes would measure the restart, not a leak."""
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
            never = bool(prior) and "ready_after_s" in prior[-1] and prior[-1]["ready_after_s"] is None
            ready = (prior[-1]["at_s"] + (prior[-1].get("ready_after_s") or 0.0)) if prior else own[0]["t"]
            t0, since = ready + settle_s, f"{settle_s:.0f} s after it was ready at {ready:.0f} s"
            if ready_at is not None:
                never = pid not in ready_at
                ready = ready_at.get(pid, ready)
                t0, since = ready + settle_s, f"{settle_s:.0f} s after it was ready at {ready:.0f} s"
            if never:  # still loading when the traffic ended: nothing to measure
                t0, since = float("inf"), "never ready during the traffic"
        # a faulty process's samples end at its fault (a stopped one lives on until the plugin kills it, and
        # its last sample may catch it releasing its memory)
        fault = next((k["at_s"] for k in kills if k.get("killed_pid", k.get("pid")) == pid), None)
        span = [x for x in own if x["t"] >= t0 and (fault is None or x["t"] < fault)]
        entry = {"pid": pid, "which": "first" if i == 0 else f"replacement {i}", "alive_t_s": [own[0]["t"],
                 own[-1]["t"]], "since": since, "from_t_s": None, "to_t_s": None, "start_mb": None,
                 "end_mb": None, "growth": None, "samples": len(span)}
        if len(span) >= 2:
            a, b = span[0], span[-1]
            entry.update(from_t_s=a["t"], to_t_s=b["t"], start_mb=a["mb"]["drafter"], end_mb=b["mb"]["drafter"],
                         growth=round((b["mb"]["drafter"] - a["mb"]["drafter"]) / a["mb"]["drafter"], 4),
                         max_mb=max(x["mb"]["drafter"] for x in span),
                         trend_mb_per_h=trend_per_h([(x["t"], x["mb"]["drafter"]) for x in span]))
        out.append(entry)
    return out


def memory_growth(events: dict, warmup_s: float, kills: list[dict] | None = None, settle_s: float = 15.0,
                  ready_at: dict[int, float] | None = None) -> dict:
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
    drafters = drafter_memory(samples, kills or [], warmup_s, settle_s, ready_at)
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
    trend = {}
    for role, (t0, _) in begin.items():
        if role in growth:
            trend[role] = trend_per_h([(x["t"], x["mb"][role]) for x in samples if x["t"] >= t0 and role in x["mb"]
                                       and (role != "drafter" or x.get("drafter_pid") == end.get("drafter_pid"))])
    total_s, total_e = sum(start.get("mb", {}).values()), sum(end["mb"].values())
    measured = [d["growth"] for d in drafters if d["growth"] is not None]
    return {"start_mb": start.get("mb", {}), "end_mb": end["mb"], "start_t_s": start.get("t"),
            "end_t_s": end["t"], "from": {role: t for role, (t, _) in begin.items()}, "notes": notes,
            "growth": growth, "second_half_growth": second_half, "trend_mb_per_h": trend, "drafters": drafters,
            "processes": process_memory(samples, start.get("t"), kills, drafters),
            "all_drafters_measured": bool(drafters) and len(measured) == len(drafters),
            "total_growth": round((total_e - total_s) / total_s, 4) if total_s else None,
            "ok": bool(growth) and all(g < MEMORY_GROWTH_LIMIT for g in [*growth.values(), *measured])
                  and len(measured) == len(drafters),
            "samples": [{"t": x["t"], "drafter_pid": x.get("drafter_pid"), **x["mb"]} for x in samples],
            "process_samples": [{"t": x["t"], **{pid: p["mb"] for pid, p in x["procs"].items()}}
                                for x in samples if x.get("procs")]}


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
        between = []  # from each fault's recovery to the next fault (or the end)
        for i, k in enumerate(kills):
            back = k.get("recovered_after_s") or k.get("ready_after_s")
            w = None if back is None else window(k["at_s"] + back, kills[i + 1]["at_s"] if i + 1 < len(kills) else end)
            between.append(None if w is None else {**w, "after": f"{k.get('signal', 'SIGKILL')} at {k['at_s']:.0f} s"})
        out["between_faults"] = between
    return out


def time_series(polls: list[dict], every_s: float = 30.0) -> list[dict]:
    """Per window of `every_s`: the hit rate, the server's generated tokens per second (vLLM's counter: tokens
    as they are made, not when their request ends) and requests completed."""
    out = []
    edge = 0.0
    prev = None
    for p in polls:
        if prev is None:
            prev = p
            edge = p["t"]
            continue
        if p["t"] - edge >= every_s or p is polls[-1]:
            dt = p["t"] - prev["t"]
            lookups = (p.get("lookups") or 0.0) - (prev.get("lookups") or 0.0)
            hits = (p.get("hits") or 0.0) - (prev.get("hits") or 0.0)
            gen = None if p.get("generated") is None or prev.get("generated") is None \
                else (p["generated"] - prev["generated"]) / dt if dt else None
            out.append({"from_t_s": prev["t"], "to_t_s": p["t"], "lookups": lookups,
                        "hit_rate": round(hits / lookups, 4) if lookups else None,
                        "tokens_per_s": None if gen is None else round(gen, 1),
                        "requests": p["requests"] - prev["requests"], "state": p.get("state")})
            prev, edge = p, p["t"]
    return out


def dashboard_summary(dashboard: list[dict]) -> dict:
    """From the dashboard samples: each counter's total at the end (after the drain), each gauge's least and
    most over the run and its value after the drain, and the share of rounds that pre-drafted."""
    if not dashboard:
        return {}
    last = dashboard[-1]["samples"]
    counters = {k: v for k, v in last.items() if k.split("{", 1)[0].endswith(("_total", "_sum", "_count"))}
    gauges = {}
    for k in last:
        if k in counters:
            continue
        values = [d["samples"][k] for d in dashboard if k in d["samples"]]
        gauges[k] = {"min": min(values), "max": max(values), "after_drain": last[k]}
    rounds = {k.split('mode="', 1)[1].split('"', 1)[0]: v for k, v in last.items()
              if k.startswith("vllm:saguaro_rounds_total{")}
    total = sum(rounds.values())
    skipped = last.get("vllm:saguaro_predraft_skipped_total")
    return {"samples": len(dashboard), "counters": counters, "gauges": gauges, "rounds": rounds,
            "predraft_share": round(rounds.get("predraft", 0.0) / total, 4) if total else None,
            "branch_steps_skipped_share": round(skipped / rounds["predraft"], 4)
            if skipped is not None and rounds.get("predraft") else None,
            "drafter_requests_after_drain": last.get("vllm:saguaro_drafter_requests")}


def speculation(m: dict[str, float]) -> dict:
    drafts, draft_tokens, accepted = m.get(DRAFTS, 0.0), m.get(DRAFT_TOKENS, 0.0), m.get(ACCEPTED, 0.0)
    lookups = m.get(LOOKUPS, 0.0)
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "cache_hit_rate": m.get(HITS, 0.0) / lookups if lookups else None,
            "drafter_failures": m.get(FAILURES, 0.0), "drafter_restarts": m.get(RESTARTS)}


# ------------------------------------------------------------------------------------------ greedy replay

def _replay_key(g: dict, max_model_len: int) -> str:
    """The plain request a greedy record stands for (identical requests are replayed once)."""
    return json.dumps([g["prompt_token_ids"], min(g["max_tokens"], max_model_len - len(g["prompt_token_ids"])),
                       g["stop"], g["stop_token_ids"], g["ignore_eos"]])


def replay_worker(req_path: str, out_path: str) -> None:
    """Inside a fresh process without plugins: every distinct greedy request through a plain vLLM engine (no
    speculation); per request its output token ids and, per output token, the gap between the top two logprobs
    (how far from a tie the plain engine's choice was)."""
    r = json.loads(Path(req_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(model=r["target"], dtype="float32", enforce_eager=True, max_model_len=r["max_model_len"], seed=0,
              distributed_executor_backend="uni")
    prompts, params = [], []
    for key in r["requests"]:
        ids, max_tokens, stop, stop_ids, ignore_eos = json.loads(key)
        prompts.append({"prompt_token_ids": ids})
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids,
                                     ignore_eos=ignore_eos, logprobs=2))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {}
    for key, out in zip(r["requests"], outs):
        c = out.outputs[0]
        gaps = []
        for pos in c.logprobs or []:
            top = sorted((lp.logprob for lp in pos.values()), reverse=True)
            gaps.append(round(top[0] - top[1], 6) if len(top) > 1 else None)
        result[key] = {"token_ids": list(c.token_ids), "gaps": gaps, "finish": c.finish_reason}
    Path(out_path).write_text(json.dumps({"outputs": result, "seconds": seconds}))


def compare_greedy(done: list[dict], plain: dict[str, dict], max_model_len: int, faults: list[dict],
                   start: float) -> dict:
    """Each greedy request of the soak against the plain engine's output for the same request: equal token for
    token (a stream the client closed: a prefix of it). Mismatches name the first differing position, the two
    tokens and the plain engine's top-2 logprob gap there; the least gap over every compared token tells how
    near a tie the comparison ran."""
    records = [r for r in done if "greedy" in r]
    mismatches, compared, prefixes, tokens, least = [], 0, 0, 0, None
    for r in records:
        g = r["greedy"]
        ref = plain.get(_replay_key(g, max_model_len))
        if ref is None:
            continue
        got, want = g["output_token_ids"], ref["token_ids"]
        compared += 1
        prefixes += r.get("cancelled", False)
        n = len(got)
        gaps = [x for x in ref["gaps"][:n] if x is not None]
        least = min([*gaps, *([] if least is None else [least])], default=least)
        tokens += n
        same = got == want[:n] if r.get("cancelled") else got == want
        if not same:
            at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            t = r["start"] - start
            mismatches.append({"t_s": round(t, 1), "cancelled": bool(r.get("cancelled")), "chat": r["chat"],
                               "stream": r.get("stream", True), "long": bool(r.get("long")),
                               "prompt_len": len(g["prompt_token_ids"]), "soak_len": len(got),
                               "plain_len": len(want), "first_diff_at": at,
                               "soak_token": got[at] if at < len(got) else None,
                               "plain_token": want[at] if at < len(want) else None,
                               "plain_top2_gap": ref["gaps"][at] if at < len(ref["gaps"]) else None,
                               "soak_finish": g["finish"], "plain_finish": ref["finish"],
                               "near_fault": any(abs(k["t"] - t) < 30 for k in faults)})
    return {"greedy_requests": len(records), "compared": compared, "compared_as_prefix": prefixes,
            "tokens_compared": tokens, "distinct_requests_replayed": len(plain), "mismatches": len(mismatches),
            "mismatch_samples": mismatches[:20], "least_top2_gap": least}


def replay_greedy(target: str, done: list[dict], max_model_len: int, tmp: Path, timeout_s: float = 3600) -> dict:
    """Replay every distinct greedy request of the soak through plain vLLM (a fresh process, no plugins, no
    speculation); returns {request key: plain output} and the replay's seconds."""
    keys = sorted({_replay_key(r["greedy"], max_model_len) for r in done if "greedy" in r})
    req, out, log = tmp / "replay.json", tmp / "replay-out.json", tmp / "replay.log"
    req.write_text(json.dumps({"target": target, "max_model_len": max_model_len, "requests": keys}))
    env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--replay", str(req), str(out)], env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the plain replay failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------- plot

def plot(result: dict, path: Path) -> None:
    """Memory per process over time (each drafter its own line), hit rate and tokens/s over time, the faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["memory"]
    fig, (ax_mem, ax_rel, ax_hit) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    procs = m.get("processes") or {}
    series = m.get("process_samples") or []
    drafters = [pid for pid, p in procs.items() if p["role"] == "drafter"]
    for pid, p in sorted(procs.items(), key=lambda kv: (kv[1]["role"], kv[1]["alive_t_s"][0])):
        pts = [(x["t"], x[pid]) for x in series if pid in x]
        if len(pts) < 2:
            continue
        label = f"{p['role']} {pid}" if p["role"] != "drafter" else f"drafter {drafters.index(pid) + 1} ({pid})"
        ts, mbs = zip(*pts)
        line, = ax_mem.plot(ts, mbs, label=label, lw=1.2)
        measured = [(t, v) for t, v in pts if p["from_t_s"] <= t <= p["to_t_s"]]  # the span its growth is from
        if len(measured) >= 2 and p.get("growth") is not None:
            base = measured[0][1]
            ax_rel.plot([t for t, _ in measured], [100 * (v - base) / base for _, v in measured], lw=1.2,
                        color=line.get_color(), label=label)
    ax_mem.set(ylabel="resident MB", yscale="log", title=f"{result['_file'] if '_file' in result else result['name']}"
               f": memory per process (sampled every ~5 s)")
    ax_mem.legend(fontsize=7, ncol=3)
    ax_rel.set(ylabel="% of its first measured sample",
               title="RSS change of each process over its measured span (drafters: from settled to their fault)")
    ax_rel.axhline(100 * MEMORY_GROWTH_LIMIT, color="grey", ls=":", lw=1)
    ax_rel.axhline(-100 * MEMORY_GROWTH_LIMIT, color="grey", ls=":", lw=1)
    ax_rel.axvline(m.get("start_t_s") or 0, color="grey", ls="--", lw=1)
    ts = result.get("time_series") or []
    mid = [(w["from_t_s"] + w["to_t_s"]) / 2 for w in ts]
    ax_hit.plot(mid, [w["hit_rate"] for w in ts], color="tab:green", marker=".", label="hit rate")
    ax_hit.set(ylabel="speculation-cache hit rate", ylim=(0, 1.05), xlabel="seconds into the traffic")
    ax_tok = ax_hit.twinx()
    ax_tok.plot(mid, [w["tokens_per_s"] for w in ts], color="tab:blue", alpha=0.6, label="generated tokens/s")
    ax_tok.set(ylabel="generated tokens/s")
    for k in result.get("kills") or []:
        color = "tab:red" if k.get("signal", "SIGKILL") == "SIGKILL" else "tab:orange"
        for ax in (ax_mem, ax_rel, ax_hit):
            ax.axvline(k["at_s"], color=color, lw=1.2)
            if k.get("recovered_after_s") is not None:
                ax.axvspan(k["at_s"], k["at_s"] + k["recovered_after_s"], color=color, alpha=0.15)
        ax_hit.annotate(k.get("signal", "SIGKILL"), (k["at_s"], 1.0), fontsize=7, color=color, rotation=90,
                        va="top", ha="right")
    for r in result.get("unexpected_replacements") or []:  # the plugin's own restarts, not scheduled
        for ax in (ax_mem, ax_rel, ax_hit):
            ax.axvline(r["last_seen_s"], color="grey", ls=":", lw=1)
        ax_hit.annotate("replaced by the plugin", (r["last_seen_s"], 0.02), fontsize=6, color="grey",
                        rotation=90, va="bottom", ha="right")
    lines = ax_hit.get_legend_handles_labels()[0] + ax_tok.get_legend_handles_labels()[0]
    ax_hit.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def dump(obj, indent: int = 0) -> str:
    """JSON with one line per element of long lists (time series), indented elsewhere: a readable file that
    stays small."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and len(obj) > 12:
        return "[\n" + ",\n".join(f"{inner}{json.dumps(v)}" for v in obj) + f"\n{pad}]"
    if isinstance(obj, list) and obj and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(f"{inner}{dump(v, indent + 1)}" for v in obj) + f"\n{pad}]"
    return json.dumps(obj)


def main(argv: list[str] | None = None) -> int:
    from run import machine_info

    from saguaro_vllm.tools.server_process import VLLMServer

    a = parse_args(argv)
    a.embedded = None
    date = datetime.date.today().isoformat()
    out_path = Path(a.out) if a.out else RESULTS / f"{date}-{a.name}.json"
    mix = {"stream_share": a.stream_share, "cancel_share": a.cancel_share, "n_share": a.n_share,
           "long_share": a.long_share, "record": a.compare_greedy}
    with tempfile.TemporaryDirectory(prefix="saguaro-soak-") as tmp:
        tmp = Path(tmp)
        target, draft, which, prompts = pick_pair(a, tmp)
        mix["word_stops"] = a.embedded is not None
        long_prompts = LongPrompts(target, prompts, a.max_model_len, a.vocab if a.embedded else None) \
            if a.long_share else None
        saguaro = {"mode": "async", **({"max_restarts": a.max_restarts} if a.max_restarts is not None else {}),
                   **({"fallback": a.fallback} if a.fallback is not None else {})}
        spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": a.k, "saguaro": saguaro}
        (tmp / "saguaro.json").write_text(json.dumps(spec))
        prom = tmp / "prometheus"
        prom.mkdir()
        log = Path(a.keep_log) if a.keep_log else tmp / "server.log"
        max_n = 3 if a.n_share else 1
        args = ([] if a.plain else ["--speculative-config", str(tmp / "saguaro.json")]) + [
            "--served-model-name", "soak", "--dtype", "float32", "--max-model-len", str(a.max_model_len),
            "--enforce-eager", "--max-num-seqs", str(max(a.clients * max_n, 1))]
        env = {"PROMETHEUS_MULTIPROC_DIR": str(prom),
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        print(f"[soak] {which} pair: {target} / {draft}; {a.clients} clients for {a.duration:g} s, "
              f"drafter faults at {[(t, sig) for t, sig in a.faults]} s", flush=True)
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
            run = asyncio.run(soak(a, server, "soak", prompts, mix, long_prompts))
            own |= {pid for poll in run["polls"] for pid in poll["drafters"]}
            own |= {int(pid) for x in run["events"].get("memory_samples", []) for pid in x.get("procs") or {}}
            cpu_end = {**run["cpu_seen"], **others_cpu_s()}
            load_after = os.getloadavg()
        finally:
            server.stop()
        log_text = log.read_text(errors="replace")
        log_tail = [ln for ln in log_text.splitlines() if "Saguaro" in ln][-30:]
        # every line of the plugin's above INFO, and its restarts and recoveries
        warnings = [ln for ln in log_text.splitlines() if "Saguaro" in ln and (
            " WARNING " in ln or " ERROR " in ln or "drafter back" in ln or "budget refilled" in ln)]
        # vLLM logs its output handler's EngineDeadError while the server stops: only those before count
        tracebacks = log_text.split("shutdown triggered", 1)[0].count("Traceback (most recent call last)")
        greedy = None
        if a.compare_greedy:
            print(f"[soak] replaying {sum('greedy' in r for r in run['done'])} greedy requests through plain vLLM",
                  flush=True)
            t_replay = time.monotonic()
            plain = replay_greedy(target, run["done"], a.max_model_len, tmp)
            greedy = compare_greedy(run["done"], plain["outputs"], a.max_model_len, run["events"].get("kills", []),
                                    run["start"])
            greedy.update(plain_engine="vllm.LLM in a fresh process, VLLM_PLUGINS='' (no Saguaro), no speculative "
                                       "config, float32, the soak's max_model_len; temperature 0 with the request's "
                                       "max_tokens (capped at max_model_len), stop strings, stop token ids, ignore_eos",
                          replay_s=round(time.monotonic() - t_replay, 1), generate_s=round(plain["seconds"], 1))
    kill_events = run["events"].get("kills", [])
    dashboard = run["events"].get("dashboard", [])
    kills = [recovery(run["polls"], k, run["done"], run["start"],
                      until=kill_events[i + 1]["t"] if i + 1 < len(kill_events) else None, dashboard=dashboard)
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
        "settings": {"duration_s": a.duration, "clients": a.clients, "k": a.k, "mode": "plain" if a.plain else "async",
                     "kill_at_s": a.kill_at, "stop_at_s": a.stop_at, "faults": [list(f) for f in a.faults],
                     "max_model_len": a.max_model_len, "temperatures": a.temperatures,
                     "greedy_share": round(sum(t == 0 for t in a.temperatures) / len(a.temperatures), 3),
                     "stream_share": a.stream_share, "cancel_share": a.cancel_share, "n_share": a.n_share,
                     "long_share": a.long_share, "long_room_tokens": LONG_ROOM if a.long_share else None,
                     "compare_greedy": a.compare_greedy, "max_num_seqs": max(a.clients * max_n, 1),
                     "saguaro": saguaro, "embedded_pair": a.embedded, "dashboard_every_s": a.dashboard_every,
                     "lengths": LENGTHS, "seed": a.seed, "warmup_s": a.warmup_s,
                     "drafter_settle_s": a.drafter_settle_s},
        "startup_s": round(startup_s, 1), "traffic_s": round(run["traffic_s"], 1), "drain_s": round(run["drain_s"], 1),
        "summary": summarize(run["done"], run["traffic_s"]),
        "errors": len(run["errors"]), "error_samples": run["errors"][:20],
        "kills": kills,
        "unexpected_replacements": unexpected_replacements(run["polls"], kill_events, run["watch"], warnings),
        "speculation_disabled_at_s": next((p["t"] for p in run["polls"] if p["state"] == "disabled"), None),
        "greedy_check": greedy,
        "speculation": speculation(run["metrics"]) | {
            "hit_rate_windows": hit_rates(run["polls"], kills, a.warmup_s),
            "predraft_share": dashboard_summary(dashboard).get("predraft_share"),
            "branch_steps_skipped_share": dashboard_summary(dashboard).get("branch_steps_skipped_share")},
        "memory": {**memory_growth(run["events"], a.warmup_s, kills, a.drafter_settle_s, ready_times(run["polls"])),
                   "kill_jumps": kill_jumps(run["events"], kills)},
        "load": {"loadavg_before": load_before, "loadavg_after": load_after,
                 "loadavg_1min_during": {"mean": round(statistics.fmean(x[1] for x in run["events"]["loadavg"]), 2),
                                         "max": max(x[1] for x in run["events"]["loadavg"])}
                 if run["events"].get("loadavg") else None,
                 "other_processes_cpu_s": dict(sorted(others.items(), key=lambda kv: -kv[1])[:15]),
                 "other_cpu_s_total": round(sum(others.values()), 1)},
        "server_log_tracebacks_before_stop": tracebacks,
        "time_series": time_series(run["polls"]),
        "dashboard": {"every_s": a.dashboard_every, "summary": dashboard_summary(dashboard), "samples": dashboard},
        "timeline": [{k: p.get(k) for k in ("t", "requests", "tokens", "errors", "drafts", "restarts", "state",
                                            "lookups", "hits", "generated")}
                     for p in run["polls"]],
        "log_excerpt": log_tail,
        "saguaro_warnings": warnings[:200],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if not a.no_plot:
        result["plot"] = out_path.with_suffix(".png").name
        plot(result | {"_file": out_path.name}, out_path.with_suffix(".png"))
    out_path.write_text(dump(result) + "\n")
    s = result["summary"]
    print(f"[soak] {s['requests']} requests, {result['errors']} errors, {s['tokens_per_s']:.1f} tok/s, "
          f"latency p50/p99 {s['latency_s']['p50']:.2f}/{s['latency_s']['p99']:.2f} s, "
          f"TPOT p50/p99 {1e3 * (s['tpot_s']['p50'] or 0):.1f}/{1e3 * (s['tpot_s']['p99'] or 0):.1f} ms; "
          f"faults: {result['kills']}; hit rate {result['speculation']['cache_hit_rate']} "
          f"({result['speculation']['hit_rate_windows']}); memory growth {result['memory']['growth']}, drafters "
          f"{[(d['which'], d['growth']) for d in result['memory']['drafters']]} (ok={result['memory']['ok']}); "
          + (f"greedy: {greedy['compared']} compared, {greedy['mismatches']} mismatches; " if greedy else "")
          + f"others used {result['load']['other_cpu_s_total']} CPU s -> {out_path}")
    ok = result["errors"] == 0 and result["memory"]["ok"] and (greedy is None or greedy["mismatches"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--replay":
        replay_worker(sys.argv[2], sys.argv[3])
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":  # the PNG again from a result file, e.g. after a plot change
        path = Path(sys.argv[2])
        done = json.loads(path.read_text())
        plot(done | {"_file": path.name}, path.with_name(done.get("plot") or path.with_suffix(".png").name))
        sys.exit(0)
    sys.exit(main())
