"""Front-end checks of a remote drafter (`saguaro.drafter_endpoint`): what `resolve.resolve_for_engine` is
for a local one, less everything about the draft and its device, which live on the drafter's host.

Refused here, before any engine process starts, naming the field and the fix: no secret (neither
`saguaro.drafter_secret_file` nor `SAGUARO_DRAFTER_SECRET`), a secret file others may read, a secret shorter
than 16 bytes, a libzmq without CURVE. The endpoint's form and the drafter-host options are checked by the
config model (config.py). The draft itself (architecture, vocabulary, attention shape) is checked by the
drafter when a worker connects: a mismatch disables speculation with the reason in the worker's log.
"""
from __future__ import annotations

import os
from typing import Any

from saguaro_vllm.frontend.config import SaguaroConfig, SaguaroConfigError
from saguaro_vllm.frontend.cpu_placement import BIND_SET_BY_US, _user_rank_cores, split_cores, user_bind
from saguaro_vllm.frontend.resolve import resolve_proposal_ring
from saguaro_vllm.shared.secret import SecretError, curve_supported, read_secret

SECRET_FIELD = "speculative_config.saguaro.drafter_secret_file"


def resolve_remote(cfg: SaguaroConfig, target_model_config: Any, tp_size: int, is_cpu_platform: bool,
                   pp_size: int = 1, max_num_seqs: int | None = None) -> dict[str, Any]:
    """The resolved settings of a worker whose drafter is remote (the secret itself stays out of them: each
    worker reads it from the file or the environment)."""
    try:
        read_secret(cfg.saguaro.drafter_secret_file, SECRET_FIELD)
    except SecretError as err:
        raise SaguaroConfigError(f"{err}.") from None
    if not curve_supported():
        raise SaguaroConfigError(
            "speculative_config.saguaro.drafter_endpoint: the installed libzmq has no CURVE support "
            "(zmq.has('curve') is False), so the link to a remote drafter cannot be authenticated; install "
            "pyzmq's wheel (it bundles a libzmq with CURVE), or remove drafter_endpoint for a local drafter.")
    vocab = int(target_model_config.get_vocab_size())
    ring = resolve_proposal_ring(cfg, vocab, max_num_seqs, "host")
    rank_cores: list[list[int]] = []
    if is_cpu_platform:  # the target's ranks share this host's cores among themselves only
        world = tp_size * pp_size
        rank_cores = _user_rank_cores(user_bind(), world, 1) or split_cores(
            sorted(cfg.saguaro.target_cores or os.sched_getaffinity(0)), world)
        if any(not cores for cores in rank_cores):
            raise SaguaroConfigError(f"speculative_config.saguaro.target_cores: {world} target ranks need a core "
                                     f"each, got {rank_cores}.")
        if user_bind() == "auto":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ[BIND_SET_BY_US] = \
                "|".join(",".join(map(str, cores)) for cores in rank_cores)
    resolved = cfg.model_dump()
    resolved["saguaro"]["proposal_transport"] = "host"  # the proposer writes its own ring: host memory
    resolved.update(
        draft_path=cfg.model,  # the drafter host's; named in logs only
        device=f"remote {cfg.saguaro.drafter_endpoint}",
        draft_cores=[],
        target_cores=sorted(sum(rank_cores, [])),
        target_rank_cores=rank_cores,
        vocab_size=vocab,
        proposal_ring_dir=ring["dir"],
    )
    return resolved
