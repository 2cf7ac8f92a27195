"""`make demo` / `saguaro-vllm demo`: serve the locally trained demo pair with Saguaro and talk to it.

Builds the demo pair if it is not cached, points `~/.cache/saguaro-vllm/demo` at it (the path
`configs/saguaro-cpu-demo.json` names), starts `vllm serve <target> --speculative-config
configs/saguaro-cpu-demo.json` on 127.0.0.1, sends one completion and one chat request with the `openai`
client, prints the answers and the speculation statistics from the server's `/metrics`, and stops it.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

DEMO_LINK = Path("~/.cache/saguaro-vllm/demo").expanduser()
REPO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "saguaro-cpu-demo.json"


def link_demo_pair(root: Path) -> Path:
    DEMO_LINK.parent.mkdir(parents=True, exist_ok=True)
    tmp = DEMO_LINK.with_name(f".demo-link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(root.resolve(), target_is_directory=True)
    os.replace(tmp, DEMO_LINK)
    return DEMO_LINK


def metric_values(text: str) -> dict[str, float]:
    """Sum each sample name of a Prometheus text page over its labels."""
    from saguaro_vllm.server_process import metric_samples, metric_totals

    return metric_totals(metric_samples(text))


def speculation_summary(metrics: dict[str, float], k: int) -> list[str]:
    drafts = metrics.get("vllm:spec_decode_num_drafts_total", 0.0)
    draft_tokens = metrics.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    lines = [f"drafts: {drafts:.0f}, draft tokens: {draft_tokens:.0f}, accepted: {accepted:.0f}"]
    if drafts:
        lines.append(f"acceptance rate: {accepted / max(draft_tokens, 1):.3f}, "
                     f"mean acceptance length: {1 + accepted / drafts:.2f} tokens per verification (K={k})")
    n = metrics.get("vllm:saguaro_drafter_step_seconds_count", 0.0)
    if n:
        total = metrics.get("vllm:saguaro_drafter_step_seconds_sum", 0.0)
        comp = metrics.get("vllm:saguaro_drafter_compute_seconds_sum", 0.0)
        lines.append(f"drafter steps: {n:.0f}, mean drafter step: {1e3 * total / n:.1f} ms "
                     f"(drafter compute {1e3 * comp / n:.1f} ms)")
    lookups = metrics.get("vllm:saguaro_cache_lookups_total", 0.0)
    if lookups:
        hits = metrics.get("vllm:saguaro_cache_hits_total", 0.0)
        lines.append(f"speculation cache: hit rate {hits / lookups:.3f} ({hits:.0f} of {lookups:.0f} lookups), "
                     f"backups: {metrics.get('vllm:saguaro_backups_total', 0.0):.0f}")
        rounds = metrics.get("vllm:saguaro_predraft_seconds_count", 0.0)
        if rounds:
            pre = metrics.get("vllm:saguaro_predraft_seconds_sum", 0.0) / rounds
            ver = metrics.get("vllm:saguaro_verify_seconds_sum", 0.0) / rounds
            lines.append(f"pre-drafting {1e3 * pre:.1f} ms per round vs verification {1e3 * ver:.1f} ms")
    return lines


def run_demo(config: Path = REPO_CONFIG, max_tokens: int = 96) -> int:
    import json

    import openai

    from saguaro_vllm.demo.build import ensure_demo_pair
    from saguaro_vllm.server_process import VLLMServer

    pair = ensure_demo_pair(cost_matched=False)
    link = link_demo_pair(pair.root)
    stats = pair.stats
    print(f"[demo] demo pair: {pair.root} (linked at {link})")
    k = json.loads(config.read_text())["num_speculative_tokens"]
    prompt = pair.heldout_prompts(1)[0]
    with tempfile.TemporaryDirectory(prefix="saguaro-demo-") as tmp:
        prom_dir = Path(tmp) / "prometheus"
        prom_dir.mkdir()
        log = Path(tmp) / "server.log"
        args = ["--speculative-config", str(config), "--served-model-name", "demo", "--dtype", "float32",
                "--max-model-len", "2048", "--enforce-eager"]
        print(f"[demo] starting: vllm serve {link / 'target'} {' '.join(args)}")
        t0 = time.monotonic()
        try:
            server = VLLMServer(str(link / "target"), args, log_path=str(log),
                                env={"PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
                                     "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
            server.start()
        except Exception:
            print(log.read_text()[-4000:] if log.exists() else "")
            raise
        try:
            print(f"[demo] server ready at {server.url} after {time.monotonic() - t0:.0f} s")
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
            t0 = time.monotonic()
            comp = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0)
            dt = time.monotonic() - t0
            print("\n=== completion (greedy) ===\n--- prompt ---\n" + prompt[-300:])
            print("--- answer ---\n" + comp.choices[0].text)
            print(f"({comp.usage.completion_tokens} tokens in {dt:.2f} s)")
            t0 = time.monotonic()
            chat = client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "def fibonacci(n):"}],
                max_tokens=max_tokens, temperature=0.7, seed=1)
            dt = time.monotonic() - t0
            print("\n=== chat (temperature 0.7) ===\n" + chat.choices[0].message.content)
            print(f"({chat.usage.completion_tokens} tokens in {dt:.2f} s)")
            print("\n=== speculation ===")
            for line in speculation_summary(metric_values(server.metrics_text()), k):
                print("  " + line)
            if "agreement" in json.dumps(stats):
                print(f"  (demo pair build stats: {pair.root / 'stats.json'})")
        finally:
            server.stop()
            print("[demo] server stopped")
    return 0
