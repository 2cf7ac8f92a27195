"""`make demo` / `saguaro-vllm demo`: the same prompts through plain vLLM and through Saguaro (SSD), side by side.

Builds the demo pair if it is not cached (cost-matched models included: their draft/target step-time ratio
is that of real serving pairs, see docs/demo-pair.md), points `~/.cache/saguaro-vllm/demo` at it (the path
`configs/saguaro-cpu-demo.json` names), then runs two `vllm serve` processes on 127.0.0.1 one after the
other: plain vLLM with the whole server on one core, and Saguaro `mode: async` (its target worker on that
core, the drafter on another). Each gets the same held-out prompts greedily and sampled (fixed seeds),
streamed one at a time (batch 1); the demo prints tokens/s of both, the speedup, and the speculation
figures of each temperature from Saguaro's `/metrics` (cache hit rate, acceptance), and checks that the
greedy outputs are identical.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEMO_LINK = Path("~/.cache/saguaro-vllm/demo").expanduser()
REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "saguaro-cpu-demo.json"
TEMPERATURES = (0.0, 0.7)
SERVE_ARGS = ["--served-model-name", "demo", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
              "--max-num-seqs", "4"]


def link_demo_pair(root: Path) -> Path:
    DEMO_LINK.parent.mkdir(parents=True, exist_ok=True)
    tmp = DEMO_LINK.with_name(f".demo-link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(root.resolve(), target_is_directory=True)
    os.replace(tmp, DEMO_LINK)
    return DEMO_LINK


def metric_values(text: str) -> dict[str, float]:
    """Sum each sample name of a Prometheus text page over its labels."""
    from saguaro_vllm.tools.server_process import metric_samples, metric_totals

    return metric_totals(metric_samples(text))


@dataclass
class Phase:
    """One engine at one temperature: what the prompts produced and how fast."""

    temperature: float
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    decode_s: float = 0.0  # first to last token, summed over requests
    wall_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # /metrics deltas over the phase

    @property
    def tok_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def speculation_figures(m: dict[str, float]) -> dict[str, float | None]:
    """Acceptance and speculation-cache figures from /metrics deltas (None where nothing was counted)."""
    drafts = m.get("vllm:spec_decode_num_drafts_total", 0.0)
    draft_tokens = m.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = m.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    lookups = m.get("vllm:saguaro_cache_lookups_total", 0.0)
    return {"drafts": drafts, "accepted": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "hit_rate": m.get("vllm:saguaro_cache_hits_total", 0.0) / lookups if lookups else None,
            "lookups": lookups}


def comparison_lines(plain: list[Phase], saguaro: list[Phase], k: int) -> list[str]:
    """The side-by-side table the demo prints (pure: testable without servers)."""
    lines = [f"{'':14s} {'plain vLLM':>12s} {'Saguaro async':>14s} {'speedup':>8s} {'hit rate':>9s} "
             f"{'accept len':>11s} {'accept rate':>12s}  greedy output"]
    for p, s in zip(plain, saguaro):
        f = speculation_figures(s.metrics)
        speedup = f"{s.tok_s / p.tok_s:.2f}x" if p.tok_s else "-"
        hit = f"{f['hit_rate']:.3f}" if f["hit_rate"] is not None else "-"
        acc_len = f"{f['mean_acceptance_length']:.2f}" if f["mean_acceptance_length"] else "-"
        acc = f"{f['acceptance_rate']:.3f}" if f["acceptance_rate"] is not None else "-"
        same = ("identical" if p.texts == s.texts else "DIFFERENT (a bug)") if p.temperature == 0 else \
            "(sampled: same distribution, not the same text)"
        lines.append(f"{'T=' + format(p.temperature, 'g'):14s} {p.tok_s:9.2f} t/s {s.tok_s:11.2f} t/s "
                     f"{speedup:>8s} {hit:>9s} {acc_len:>11s} {acc:>12s}  {same}")
    lines.append(f"(tokens/s per request, first to last token, batch 1; accept len = tokens per verification, "
                 f"K={k})")
    return lines


def demo_prompts(heldout: list[str]) -> list[str]:
    """The held-out snippets as the demo sends them: without their trailing newline.

    A snippet ends at a line end. The byte-level BPE joins a newline with the next line's indentation into one
    token, so in the training text a newline token on its own is followed by column-0 text or another newline
    (an indented line follows it in under 4 % of cases); a prompt cut after the newline, whose next line is
    indented, ends where the models rarely saw a token end, and they answer it with blank lines. Cut before
    the newline, their first token is the newline with the next line's indentation, as in training."""
    return [p.rstrip() for p in heldout]


def shown_example(prompts: list[str], answers: list[str], tail_chars: int = 200) -> str:
    """The prompt end and greedy answer the demo prints: the first answer with text on it, without its leading
    blank lines and trailing whitespace (pure: testable without servers)."""
    for prompt, answer in zip(prompts, answers):
        if answer.strip():
            shown = re.sub(r"\A(?:[ \t]*\n)+", "", answer).rstrip()
            return f"--- prompt (end) ---\n{prompt[-tail_chars:]}\n--- Saguaro's greedy answer ---\n{shown}"
    return f"--- Saguaro's greedy answers ---\n(all {len(answers)} are whitespace only)"


def _measure(client, server, prompts: list[str], temperature: float, max_tokens: int) -> Phase:
    phase = Phase(temperature)
    before = metric_values(server.metrics_text())
    t_phase = time.monotonic()
    for i, prompt in enumerate(prompts):
        first = last = None
        text, usage = [], None
        stream = client.completions.create(
            model="demo", prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.monotonic()
                first = first or now
                last = now
                text.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage
        n = usage.completion_tokens if usage else 0
        phase.texts.append("".join(text))
        if first is not None and last is not None and last > first and n > 1:
            phase.tokens += n - 1
            phase.decode_s += last - first
    phase.wall_s = time.monotonic() - t_phase
    after = metric_values(server.metrics_text())
    phase.metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return phase


def _serve(target: Path, args: list[str], prompts: list[str], max_tokens: int, label: str, tmp: Path,
           cpus: list[int] | None) -> list[Phase]:
    import openai

    from saguaro_vllm.tools.server_process import VLLMServer

    log = tmp / f"{label.replace(' ', '-')}.log"
    server = VLLMServer(str(target), args, log_path=str(log), prometheus_multiproc=True, cpus=cpus,
                        env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
    t0 = time.monotonic()
    print(f"[demo] {label}: vllm serve {target} {' '.join(args)}"
          + (f" (pinned to cores {cpus})" if cpus else ""), flush=True)
    try:
        server.start()
    except Exception:
        print(log.read_text()[-4000:] if log.exists() else "")
        raise
    try:
        print(f"[demo] {label}: ready after {time.monotonic() - t0:.0f} s", flush=True)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        client.completions.create(model="demo", prompt=prompts[0], max_tokens=4)  # warm-up
        phases = []
        for t in TEMPERATURES:
            phases.append(_measure(client, server, prompts, t, max_tokens))
            print(f"[demo] {label}: T={t:g}: {phases[-1].tok_s:.2f} tokens/s", flush=True)
        return phases
    finally:
        server.stop()


def run_demo(config: Path = REPO_CONFIG, max_tokens: int = 64, num_prompts: int = 2) -> int:
    from saguaro_vllm.demo.build import ensure_demo_pair
    from saguaro_vllm.shared.placement import current_cores

    pair = ensure_demo_pair(cost_matched=True)
    link = link_demo_pair(pair.root)
    print(f"[demo] demo pair: {pair.root} (linked at {link})")
    spec = json.loads(config.read_text())
    k = spec["num_speculative_tokens"]
    prompts = demo_prompts(pair.heldout_prompts(num_prompts))
    cpus = current_cores()
    target = link / "target-cost"
    with tempfile.TemporaryDirectory(prefix="saguaro-demo-") as tmp:
        plain = _serve(target, SERVE_ARGS, prompts, max_tokens, "plain vLLM", Path(tmp), cpus[:1])
        saguaro = _serve(target, ["--speculative-config", str(config), *SERVE_ARGS], prompts, max_tokens,
                         "Saguaro", Path(tmp), None)
    print(f"\n=== {num_prompts} held-out prompts x {max_tokens} tokens, cost-matched demo pair "
          f"(see docs/demo-pair.md) ===")
    for line in comparison_lines(plain, saguaro, k):
        print("  " + line)
    print("\n" + shown_example(prompts, saguaro[0].texts))
    print(f"\n(demo pair build stats: {pair.root / 'stats.json'})")
    greedy_ok = all(p.texts == s.texts for p, s in zip(plain, saguaro) if p.temperature == 0)
    return 0 if greedy_ok else 1
