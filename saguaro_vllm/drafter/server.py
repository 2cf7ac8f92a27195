"""The drafter process: loads the draft model on its own device/cores and answers drafting steps.

Started by the proposer as `python -m saguaro_vllm.drafter.server --bootstrap DIR/bootstrap.json`: the
resolved config, the endpoint and the parent's pid come in that 0600 file inside the private 0700 socket
directory (never on the command line, which every local user can read); the drafter deletes it once read.
It exits when told to, on SIGTERM, or when its parent process dies (Linux `PR_SET_PDEATHSIG`, plus a poll
of the parent while idle), so it never outlives the vLLM worker; on the way out it removes its socket
directory. No vLLM import: this runs (and is tested) where vLLM is not installed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback

import torch

from saguaro_vllm.proposal_buffers import ProposalRing
from saguaro_vllm.transport import (
    Channel,
    Failed,
    MessageRejected,
    Ready,
    Shutdown,
    StepRequest,
    StepResponse,
    ToDrafter,
)

logger = logging.getLogger("saguaro_vllm.drafter")
PARENT_POLL_S = 1.0
CONTROL_WAIT_S = 10.0  # Ready / Failed wait this long for the proposer's socket (connects are asynchronous)
REPLY_WAIT_S = 2.0
DELAY_ENV = "SAGUARO_DRAFTER_DELAY_S"
#: Testing aid: while the file this names exists, every step raises (the drafter answers "no drafts" and
#: asks for its rows again), as a drafter with a bug would.
FAIL_FILE_ENV = "SAGUARO_DRAFTER_FAIL_FILE"


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def place_process(cfg: dict) -> None:
    """Pin this process to its own cores (CPU drafter) and size torch's thread pool to them."""
    cores = cfg.get("draft_cores") or []
    if cfg["device"] == "cpu" and cores:
        from saguaro_vllm.placement import pin_process

        pin_process(cores)
    elif cfg["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(cfg["device"]))


def build_drafter(cfg: dict):
    """The draft model, its paged KV cache and the drafting engine for `cfg` (the resolved config)."""
    from saguaro_vllm.drafter.kv_cache import KVCacheConfig, num_blocks_for_budget
    from saguaro_vllm.drafter.model.linear_kernels import (install_linear_kernel, resolve_linear,
                                                          warm_linear_kernels)
    from saguaro_vllm.drafter.model.loader import load_draft_model
    from saguaro_vllm.drafter.runner import DraftModelRunner
    from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
    from saguaro_vllm.drafter.sync_drafter import SyncDrafter
    from saguaro_vllm.ops import loader as ops_loader

    dtype = _dtype(cfg["dtype"])
    model = load_draft_model(cfg["draft_path"], dtype=dtype, device=cfg["device"])
    linear = resolve_linear(cfg["saguaro"].get("linear", "auto"), cfg["device"], cfg["dtype"])
    install_linear_kernel(model, linear)
    warmed_rows, warm_s = warm_linear_kernels(model, cfg["saguaro"]["max_tokens_per_forward"])
    mc = model.config
    block_size = cfg["saguaro"]["block_size"]
    num_blocks = num_blocks_for_budget(
        int(cfg["saguaro"]["kv_cache_gb"] * 2**30), mc.num_layers, block_size, mc.num_kv_heads, mc.head_size,
        dtype,
    )
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=block_size),
                              max_tokens_per_seq=cfg["saguaro"]["max_tokens_per_forward"])
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        _slow_down(runner, delay)
    mode = cfg["saguaro"].get("mode", "async")
    info = {"num_blocks": num_blocks, "mode": mode, "linear": linear, "warmed_rows": warmed_rows,
            "warm_s": round(warm_s, 2),
            # e.g. "attention=cpp sampling=cpp linear=packed (saguaro_ops, sources: package)"
            "ops": ops_loader.summary(cfg["device"], linear=linear)}
    if mode == "async":
        return SSDDrafter(runner, vocab_size=cfg["vocab_size"], options=cfg["saguaro"],
                          max_model_len=cfg.get("max_model_len")), info
    return SyncDrafter(runner, vocab_size=cfg["vocab_size"], max_model_len=cfg.get("max_model_len")), info


def _slow_down(runner, delay_s: float) -> None:
    """Testing aid (`SAGUARO_DRAFTER_DELAY_S`): every drafter forward takes `delay_s` longer, e.g. to
    check that a drafter slower than the target still gives exact output."""
    forward = runner.forward

    def slow_forward(*args, **kwargs):
        time.sleep(delay_s)
        return forward(*args, **kwargs)

    runner.forward = slow_forward


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return os.getppid() == pid


PR_SET_PDEATHSIG = 1
#: Sent by the kernel when the parent dies. Not SIGTERM: the kernel also sends it when only the *thread*
#: that started us exits, and then the parent process (our ppid) is still alive and we must stay.
PARENT_DEATH_SIGNAL = signal.SIGUSR1


class _Exit(BaseException):
    """Raised by the signal handlers to unwind the server loop (and run its clean-up)."""


_exiting = False  # set once clean-up began: later signals must not interrupt it


def watch_parent(parent_pid: int) -> None:
    """Exit as soon as the parent process dies: PR_SET_PDEATHSIG where the kernel has it (Linux)."""
    def on_parent_signal(signum, frame):
        if os.getppid() != parent_pid and not _exiting:  # re-parented: the parent process is gone
            raise _Exit()

    def on_term(signum, frame):
        if not _exiting:
            raise _Exit()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(PARENT_DEATH_SIGNAL, on_parent_signal)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
        except (OSError, AttributeError):
            logger.warning("PR_SET_PDEATHSIG unavailable; the drafter polls its parent instead")
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        raise _Exit()


def _reply_error(drafter, msg: StepRequest, err: Exception, first: bool) -> StepResponse:
    """A failing step must not take the drafter down: free its rows and ask for them to be resent. The first
    failure of a run of them is logged with its traceback, the others only answered."""
    if first:
        logger.exception("drafter step failed; failing steps are not logged again until one succeeds")
    for row in msg.rows:
        drafter.free(row.req_id)
    return StepResponse(msg.step, [[] for _ in msg.rows], {}, 0.0, resync=[r.req_id for r in msg.rows],
                        error=f"{type(err).__name__}: {err}")


def serve(endpoint: str, cfg: dict, parent_pid: int) -> int:
    chan = Channel(endpoint, bind=False, accepts=ToDrafter)
    try:
        try:
            place_process(cfg)
            drafter, info = build_drafter(cfg)
            if cfg.get("proposal_ring"):  # the proposer's shared buffers for sampled rows' q
                drafter.probs_ring = ProposalRing.attach(cfg["proposal_ring"])
                info["proposal_transport"] = "device" if drafter.probs_ring.device != "cpu" else "host"
        except Exception as err:  # report, don't hang the proposer
            chan.send(Failed(f"{type(err).__name__}: {err}\n{traceback.format_exc()}"[:65536]), wait_s=CONTROL_WAIT_S)
            time.sleep(0.5)
            return 1
        info.update(threads=torch.get_num_threads(), cores=sorted(os.sched_getaffinity(0)))
        chan.send(Ready(os.getpid(), info), wait_s=CONTROL_WAIT_S)
        rejected: set[str] = set()
        fail_file = os.environ.get(FAIL_FILE_ENV)
        failing = 0  # consecutive failed steps
        while True:
            busy = drafter.busy
            try:
                msg = chan.recv(timeout_s=0 if busy else PARENT_POLL_S)
            except MessageRejected as err:  # cannot happen with our proposer: say so once per kind
                if err.reason not in rejected:
                    rejected.add(err.reason)
                    logger.error("drafter: rejected a malformed request (%s); further ones are only answered "
                                 "with an error", err)
                if err.step is not None:  # answer it, so the proposer counts it instead of waiting
                    chan.send(StepResponse(err.step, [], {}, 0.0, error=f"request rejected: {err}"),
                              wait_s=REPLY_WAIT_S)
                continue
            if msg is None:
                if busy:
                    _advance(drafter)
                elif not _parent_alive(parent_pid):
                    return 0
                continue
            if isinstance(msg, Shutdown):
                return 0
            try:
                if fail_file and os.path.exists(fail_file):
                    raise RuntimeError(f"injected failure ({FAIL_FILE_ENV}={fail_file})")
                resp = drafter.step(msg)
            except Exception as err:
                resp = _reply_error(drafter, msg, err, first=not failing)
                failing += 1
            else:
                if failing:
                    logger.info("drafter steps succeed again after %d failed ones", failing)
                failing = 0
            chan.send(resp, wait_s=REPLY_WAIT_S)
            drafter.answered()
    finally:
        chan.close()


def _advance(drafter) -> None:
    """One pre-drafting forward (`mode: async`); a failure only loses this round's pre-drafts."""
    try:
        drafter.advance()
    except Exception:
        logger.exception("pre-drafting failed; this round's outcomes will miss")


def read_bootstrap(path: str) -> dict:
    """The private start-up message (endpoint, parent pid, resolved config); deleted once read."""
    with open(path) as f:
        boot = json.load(f)
    os.unlink(path)
    return boot


def main(argv: list[str] | None = None) -> int:
    global _exiting
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap", required=True, help="0600 JSON file with endpoint, parent_pid, config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="(saguaro-drafter pid=%(process)d) %(levelname)s %(message)s")
    socket_dir = os.path.dirname(os.path.abspath(args.bootstrap))
    try:
        boot = read_bootstrap(args.bootstrap)
        watch_parent(int(boot["parent_pid"]))
        return serve(boot["endpoint"], boot["config"], int(boot["parent_pid"]))
    except _Exit:
        return 0
    finally:
        _exiting = True
        shutil.rmtree(socket_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
