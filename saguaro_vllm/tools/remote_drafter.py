"""`saguaro-vllm drafter --listen tcp://HOST:PORT --model DRAFT`: a drafter on its own host.

Resolves the drafter host's options as the front end resolves a local drafter's (the same checks and
defaults: device, dtype, linear kernels, CUDA graphs, KV cache, cores), refuses bad input before loading
anything (naming the option and the fix), then serves (drafter/remote_server.py). Workers reach it with
`saguaro.drafter_endpoint`; both ends hold the same secret (shared/secret.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from saguaro_vllm.frontend.config import DRAFTER_HOST_ONLY, SaguaroOptions, _format_error

#: Of the drafter-host options, those that make no sense for a drafter that no worker starts.
NOT_HERE = ("share_cores", "proposal_transport", "startup_timeout_s", "max_restarts")
HOST_OPTIONS = tuple(k for k in DRAFTER_HOST_ONLY if k not in NOT_HERE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, help="tcp://HOST:PORT to serve on (e.g. tcp://0.0.0.0:5601)")
    p.add_argument("--model", required=True, help="the draft: a local Hugging Face directory or a hub id")
    p.add_argument("--secret-file", help="file holding the secret shared with the workers (mode 600); default: "
                   "the environment variable SAGUARO_DRAFTER_SECRET")
    p.add_argument("--saguaro", default="{}", help="JSON object of this host's drafter options: "
                   + ", ".join(HOST_OPTIONS) + " (docs/configuration.md; e.g. '{\"device\": \"cuda:0\", "
                   "\"kv_cache_gb\": 8}')")


class DrafterArgsError(ValueError):
    """Bad command-line input; the message names the option and the fix."""


def resolve_host(model: str, saguaro_json: str) -> dict:
    """The drafter's resolved config (as a worker's `resolve_for_engine` gives a local drafter), before the
    worker's Hello adds what it drafts for."""
    from saguaro_vllm.drafter.kv_cache import AUTO_KV_GIB
    from saguaro_vllm.drafter.model.linear_kernels import resolve_linear
    from saguaro_vllm.drafter.static_forward import resolve_cuda_graphs
    from saguaro_vllm.frontend.config import SaguaroConfigError
    from saguaro_vllm.frontend.resolve import check_draft_attention, cpu_has_bf16_matmul, resolve_draft_path

    try:
        data = json.loads(saguaro_json)
    except json.JSONDecodeError as err:
        raise DrafterArgsError(f"--saguaro: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise DrafterArgsError("--saguaro: must be a JSON object, e.g. '{\"device\": \"cpu\"}'")
    others = sorted(set(data) - set(HOST_OPTIONS))
    if others:
        raise DrafterArgsError(f"--saguaro: {', '.join(others)} not options of a remote drafter's host (those are "
                               f"{', '.join(HOST_OPTIONS)}); the workers' speculative config holds the drafting "
                               "options (mode, fan-out ...)")
    try:
        opts = SaguaroOptions.model_validate(data)
        draft_dir = resolve_draft_path(model)
        device = opts.device if opts.device != "auto" else _auto_device()
        check_draft_attention(draft_dir, device)
    except SaguaroConfigError as err:
        raise DrafterArgsError(str(err).replace("speculative_config.model", "--model")) from None
    except Exception as err:
        if hasattr(err, "errors"):
            raise DrafterArgsError("; ".join(_format_error(e).replace("speculative_config.", "--saguaro ")
                                             for e in err.errors())) from None
        raise
    dtype = opts.dtype
    if dtype == "auto":
        dtype = ("bfloat16" if cpu_has_bf16_matmul() else "float32") if device == "cpu" else \
            str(json.loads((draft_dir / "config.json").read_text()).get("torch_dtype") or "bfloat16")
    try:
        linear = resolve_linear(opts.linear, device, dtype)
        cuda_graphs = resolve_cuda_graphs(opts.cuda_graphs, device)
    except ValueError as err:
        raise DrafterArgsError(f"--saguaro: {err}") from None
    cores = sorted(os.sched_getaffinity(0))
    bad = [c for c in opts.draft_cores or [] if c not in cores]
    if bad:
        raise DrafterArgsError(f"--saguaro draft_cores: cores {bad} are not available to this process ({cores})")
    saguaro = opts.model_dump()
    saguaro.update(linear=linear, cuda_graphs=cuda_graphs,
                   kv_cache_gb=AUTO_KV_GIB if opts.kv_cache_gb == "auto" and device == "cpu" else opts.kv_cache_gb)
    return {"draft_path": str(draft_dir), "device": device, "dtype": dtype,
            "draft_cores": (opts.draft_cores or cores) if device == "cpu" else [], "saguaro": saguaro}


def _auto_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    from saguaro_vllm.shared.secret import SecretError, curve_supported, read_secret
    from saguaro_vllm.shared.transport import tcp_endpoint

    try:
        tcp_endpoint(args.listen, "--listen")
        secret = read_secret(args.secret_file, "--secret-file")
        if not curve_supported():
            raise DrafterArgsError("the installed libzmq has no CURVE support (zmq.has('curve') is False): the "
                                   "link cannot be authenticated; install pyzmq's wheel, which bundles it")
        cfg = resolve_host(args.model, args.saguaro)
    except (ValueError, SecretError) as err:
        print(f"saguaro-vllm drafter: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="(saguaro-drafter pid=%(process)d) %(levelname)s %(message)s")
    from saguaro_vllm.drafter.remote_server import run as serve

    return serve(args.listen, cfg, secret)
