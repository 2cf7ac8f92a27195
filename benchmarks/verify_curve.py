"""Verification time against drafts per row: what deeper speculation costs the target (issue 14 item 2).

The target (cost-matched demo pair, pinned to core 0, T=0) verifies exactly d drafts per row, all
accepted, from a free, perfect drafter (`oracle_proposer.py`: the target's own greedy tokens, recorded
first; no drafter process, so nothing else runs while it verifies). Each engine step then yields d + 1
tokens per row, so one verification takes (d + 1) / (tokens per second per sequence): the target's forward
over batch x (1 + d) tokens plus vLLM's sampling and scheduling. d = 0 is vLLM AR's decode step. Writes
`benchmarks/results/<date>-verify-curve.json` and `docs/img/verify-curve.png`; `benchmarks/report.py`
puts the table on docs/benchmarks.md. This is the cost that `depth: "auto"` learns online.

    .venv/bin/python benchmarks/verify_curve.py                    # batch 1 and 4, d = 0..8
    .venv/bin/python benchmarks/verify_curve.py --batch-sizes 1 --depths 0,1,5,8
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import record_greedy  # noqa: E402
from run import RESULTS, machine_info, run_date, run_one  # noqa: E402

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--depths", default="0,1,2,3,4,5,6,7,8", help="drafts per row; 0 is vLLM AR's decode step")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=1, help="groups of `batch` requests per run")
    p.add_argument("--timeout", type=float, default=900.0)
    return p.parse_args(argv)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for batch in sorted({p["batch"] for p in points}):
        row = sorted((p for p in points if p["batch"] == batch and p["verify_ms"]), key=lambda p: p["depth"])
        ax.plot([1 + p["depth"] for p in row], [p["verify_ms"] for p in row], marker="o", label=f"batch {batch}")
    ax.set_xlabel("tokens verified per row (1 + drafts)")
    ax.set_ylabel("verification ms (target forward + vLLM)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from saguaro_vllm.demo.build import ensure_demo_pair

    pair = ensure_demo_pair(cost_matched=True)
    target, draft = str(pair.target_cost), str(pair.draft_cost)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    depths = [int(d) for d in a.depths.split(",")]
    prompts = pair.heldout_prompts(a.num_prompts * max(batches))
    os.environ["SAGUARO_ORACLE_TOKENS"] = record_greedy(target, prompts, a.max_tokens + max(depths) + 2)
    points = []
    for batch, depth in tqdm([(b, d) for b in batches for d in depths], desc="verify curve"):
        group = prompts[: a.num_prompts * batch]
        spec = None if depth == 0 else {"method": "custom_class", "model": "oracle_proposer.OracleProposer",
                                        "num_speculative_tokens": depth}
        res = run_one(target, spec, group, batch, 0.0, a.max_tokens, [0], a.timeout)
        # Tokens per step: d + 1 when every draft is accepted (a batched greedy run can differ from the
        # recorded one in a rare near-tie, so the measured acceptance length is used).
        ms = 1e3 * (res.get("mean_acceptance_length") or 1.0) / res["decode_tok_s_per_seq"]
        points.append({"batch": batch, "depth": depth, "verify_ms": ms,
                       "mean_acceptance_length": res.get("mean_acceptance_length"),
                       "decode_tok_s_per_seq": res["decode_tok_s_per_seq"]})
        tqdm.write(f"batch {batch} depth {depth}: verification {ms:.1f} ms "
                   f"({res['decode_tok_s_per_seq']:.2f} tokens/s per sequence, accept len {res.get('mean_acceptance_length') or 1:.2f})")
    date = datetime.datetime.now().isoformat(timespec="seconds")
    out = {"kind": "verify-curve", "date": date, "machine": machine_info(), "target": target, "draft": draft,
           "max_tokens": a.max_tokens, "num_prompts": a.num_prompts, "command": " ".join(sys.argv),
           "placement": "every engine pinned whole to core 0; the oracle drafter has no process",
           "points": points}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{run_date()}-verify-curve.json"
    path.write_text(json.dumps(out, indent=1))
    plot(points, IMG / "verify-curve.png")
    print(f"saved {path} and {IMG / 'verify-curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
