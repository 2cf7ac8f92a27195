"""The drafter process: loads the draft model on its own device/cores and answers drafting steps.

Started by the proposer as `python -m saguaro_vllm.drafter.server --bootstrap DIR/bootstrap.json`: the
resolved config, the endpoint and the parent's pid come in that 0600 file inside the private 0700 socket
directory (never on the command line, which every local user can read); the drafter deletes it once read.
It exits when told to, on SIGTERM, or when its parent process dies (Linux `PR_SET_PDEATHSIG`, plus a poll
of the parent while idle), so it never outlives the vLLM worker; on the way out it removes its socket
directory. It ignores SIGINT (a Ctrl-C reaches the whole process group): the worker stops it. No vLLM
import: this runs (and is tested) where vLLM is not installed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import gc
import os
import shutil
import signal
import sys
import time
import traceback

if __name__ == "__main__":
    # Ctrl-C sends SIGINT to vLLM's whole process group, the drafter included. Its parent, vLLM's worker, is
    # what stops on it, and stops the drafter in turn (a Shutdown message, SIGTERM, vLLM killing the worker's
    # children, or the parent-death signal). Ignored here, before torch's import, because Python's default
    # handler raises KeyboardInterrupt wherever the drafter is (ZeroMQ's poll, mostly) and prints its
    # traceback into vLLM's log, and because a worker still stepping would take a drafter that exited ahead of
    # it for a crash (a warning, and a replacement started). Only in the drafter process, not where this module
    # is imported (tests).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import torch  # noqa: E402

from saguaro_vllm.shared.proposal_buffers import ProposalRing  # noqa: E402
from saguaro_vllm.shared.start_placement import restore_priority  # noqa: E402
from saguaro_vllm.shared.transport import (  # noqa: E402
    DEVICE_ERROR_EXIT,
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
#: asks for its rows again), as a drafter with a bug would. A file whose text starts with "cuda" makes the
#: step raise a CUDA error instead ("CUDA error: an illegal memory access ..."), as a poisoned GPU would:
#: the drafter then exits with DEVICE_ERROR_EXIT and its client restarts it.
FAIL_FILE_ENV = "SAGUARO_DRAFTER_FAIL_FILE"


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def place_process(cfg: dict) -> None:
    """Pin this process to its own cores (CPU drafter) and size torch's thread pool to them."""
    cores = cfg.get("draft_cores") or []
    if cfg["device"] == "cpu" and cores:
        from saguaro_vllm.shared.placement import pin_process

        pin_process(cores)
    elif cfg["device"].startswith("cuda"):
        index, count = torch.device(cfg["device"]).index or 0, torch.cuda.device_count()
        if index >= count:  # (the front end checked its own view; under Ray the worker's may differ)
            raise ValueError(
                f"speculative_config.saguaro.device: {cfg['device']!r} is not visible to the drafter, which sees "
                f"{count} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, "
                "inherited from the vLLM worker that starts it). Set saguaro.device to a GPU that worker sees "
                "(numbered as it sees them, e.g. 'cuda:0'), or 'cpu'; under the Ray executor use the mp executor "
                "(--distributed-executor-backend mp) to place the drafter on a GPU of its own.")
        torch.cuda.set_device(torch.device(cfg["device"]))


def build_drafter(cfg: dict):
    """The draft model, its paged KV cache and the drafting engine for `cfg` (the resolved config)."""
    return make_drafter(load_draft(cfg), cfg)


def load_draft(cfg: dict) -> dict:
    """The draft model with its linear kernels installed and warmed (what outlives a remote drafter's
    sessions): {"model", "linear", "warmed_rows", "warm_s"}."""
    from saguaro_vllm.drafter.model.linear_kernels import (install_linear_kernel, resolve_linear,
                                                          warm_linear_kernels)
    from saguaro_vllm.drafter.model.loader import load_draft_model

    model = load_draft_model(cfg["draft_path"], dtype=_dtype(cfg["dtype"]), device=cfg["device"])
    linear = resolve_linear(cfg["saguaro"].get("linear", "auto"), cfg["device"], cfg["dtype"])
    install_linear_kernel(model, linear)
    warmed_rows, warm_s = warm_linear_kernels(model, cfg["saguaro"]["max_tokens_per_forward"])
    return {"model": model, "linear": linear, "warmed_rows": warmed_rows, "warm_s": warm_s}


def make_drafter(loaded: dict, cfg: dict):
    """The paged KV cache, runner and drafting engine around a loaded draft, for `cfg`: (drafter, info)."""
    from saguaro_vllm.drafter.kv_cache import KVCacheConfig, kv_budget_bytes, num_blocks_for_budget
    from saguaro_vllm.drafter.runner import DraftModelRunner
    from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
    from saguaro_vllm.drafter.static_forward import resolve_cuda_graphs
    from saguaro_vllm.drafter.sync_drafter import SyncDrafter
    from saguaro_vllm.drafter.trace import TraceRecorder
    from saguaro_vllm.ops import loader as ops_loader

    dtype = _dtype(cfg["dtype"])
    model, linear = loaded["model"], loaded["linear"]
    warmed_rows, warm_s = loaded["warmed_rows"], loaded["warm_s"]
    mc = model.config
    block_size = cfg["saguaro"]["block_size"]
    # "auto" on a GPU of its own: a share of the memory left free once the draft is loaded (kv_cache.py)
    kv_bytes = kv_budget_bytes(cfg["saguaro"]["kv_cache_gb"], cfg["device"])
    try:
        num_blocks = num_blocks_for_budget(kv_bytes, mc.num_layers, block_size, mc.num_kv_heads, mc.head_size,
                                           dtype)
    except ValueError as err:
        raise ValueError(f"speculative_config.saguaro.kv_cache_gb {cfg['saguaro']['kv_cache_gb']!r} gives "
                         f"{kv_bytes} bytes on {cfg['device']}: {err} (set saguaro.kv_cache_gb to a number of "
                         "GiB, or free memory on the draft's device)") from None
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=block_size),
                              max_tokens_per_seq=cfg["saguaro"]["max_tokens_per_forward"],
                              cuda_graphs=resolve_cuda_graphs(cfg["saguaro"].get("cuda_graphs", "auto"),
                                                              cfg["device"]),
                              static_max_len=cfg.get("max_model_len"))
    graphs_s = runner.capture_graphs()  # every bucket now, none in the middle of a round (static_forward.py)
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        _slow_down(runner, delay)
    mode = cfg["saguaro"].get("mode", "async")
    info = {"num_blocks": num_blocks, "kv_cache_gib": round(kv_bytes / 2**30, 3), "mode": mode, "linear": linear,
            "warmed_rows": warmed_rows,
            "warm_s": round(warm_s, 2),
            # e.g. "attention=cpp sampling=cpp linear=packed (saguaro_ops, sources: package)"
            "ops": ops_loader.summary(cfg["device"], linear=linear),
            "attention": runner.attention_impl,  # what every forward's attention runs (vllm_attention.py)
            "graphs": runner.graph_mode,  # how one-token forwards run: cuda-graphs, static or dynamic
            "graphs_s": round(graphs_s, 2)}
    if mode == "async":
        drafter = SSDDrafter(runner, vocab_size=cfg["vocab_size"], options=cfg["saguaro"],
                             max_model_len=cfg.get("max_model_len"))
    else:
        drafter = SyncDrafter(runner, vocab_size=cfg["vocab_size"], max_model_len=cfg.get("max_model_len"))
    drafter.trace = TraceRecorder.open(cfg["saguaro"], {
        "mode": mode, "k": cfg.get("num_speculative_tokens"), "options": cfg["saguaro"],
        "device": cfg["device"], "draft": cfg.get("draft_path"), "vocab_size": cfg["vocab_size"]})
    return drafter, info


def _slow_down(runner, delay_s: float) -> None:
    """Testing aid (`SAGUARO_DRAFTER_DELAY_S`): every drafter forward takes `delay_s` longer, e.g. to
    check that a drafter slower than the target still gives exact output. Both kinds of forward: `forward`
    and `forward_batch` (branch steps; once, also where it runs `forward` for rows without room)."""
    inside = [False]

    def slowed(fn):
        def slow_forward(*args, **kwargs):
            outer, inside[0] = inside[0], True
            try:
                if not outer:
                    time.sleep(delay_s)
                return fn(*args, **kwargs)
            finally:
                inside[0] = outer
        return slow_forward

    runner.forward = slowed(runner.forward)
    runner.forward_batch = slowed(runner.forward_batch)


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


def device_unusable(err: BaseException) -> bool:
    """Whether `err` leaves this process's device unusable: a CUDA error (an illegal address, a launch
    failure, an ECC error ...) poisons the CUDA context, so every later step would fail the same way; only a
    new process gets a working context. torch raises them as `torch.cuda.CudaError`, `torch.AcceleratorError`
    (newer torch) or a RuntimeError reading "CUDA error: ...". Running out of memory is not one of them."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return False
    kinds = tuple(k for k in (getattr(torch.cuda, "CudaError", None), getattr(torch, "AcceleratorError", None))
                  if isinstance(k, type))
    if kinds and isinstance(err, kinds):
        return True
    return isinstance(err, RuntimeError) and str(err).lstrip().startswith("CUDA error")


def _exit_on_device_error(chan: Channel, msg: StepRequest | None, err: Exception) -> int:
    """Answer the step in flight (no drafts, its rows to be resent) and return DEVICE_ERROR_EXIT: the drafter
    exits and its client starts a new one (within saguaro.max_restarts)."""
    logger.error("drafter: a step raised a device error that leaves the GPU unusable in this process; exiting "
                 "with status %d so that a new drafter is started", DEVICE_ERROR_EXIT, exc_info=err)
    if msg is not None:
        chan.send(StepResponse(msg.step, [[] for _ in msg.rows], {}, 0.0, resync=[r.req_id for r in msg.rows],
                               error=f"{type(err).__name__}: {err} (the drafter exits: device unusable)"[:4096]),
                  wait_s=REPLY_WAIT_S)
        time.sleep(0.5)  # the socket drops unsent messages on close (linger 0): let the reply go out
    return DEVICE_ERROR_EXIT


def _reply_error(drafter, msg: StepRequest, err: Exception, first: bool) -> StepResponse:
    """A failing step must not take the drafter down: free its rows and ask for them to be resent. The first
    failure of a run of them is logged with its traceback, the others only answered."""
    if first:
        logger.exception("drafter step failed; failing steps are not logged again until one succeeds")
    for row in msg.rows:
        drafter.free(row.req_id)
    return StepResponse(msg.step, [[] for _ in msg.rows], {}, 0.0, resync=[r.req_id for r in msg.rows],
                        error=f"{type(err).__name__}: {err}")


def serve(endpoint: str, cfg: dict, parent_pid: int, restore_nice: int | None = None) -> int:
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
        # Everything loaded so far (torch, the model, its kernels) lives as long as the process: moved out of
        # the collector's sight, so a full collection scans only what steps allocate. Without it a full
        # collection landed every few hundred steps, 0.13 s long at batch 64 x 32 branches (host-overhead
        # benchmark), on the critical path whenever a request came meanwhile. vLLM freezes its own heap alike.
        gc.collect()
        gc.freeze()
        if restore_nice is not None:  # loaded at a lower priority than the worker's (shared/start_placement.py)
            restore_priority(restore_nice)
        info.update(threads=torch.get_num_threads(), cores=sorted(os.sched_getaffinity(0)),
                    nice=os.getpriority(os.PRIO_PROCESS, 0))
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
                if busy and not _advance(drafter):
                    return DEVICE_ERROR_EXIT
                elif not _parent_alive(parent_pid):
                    return 0
                continue
            if isinstance(msg, Shutdown):
                return 0
            resp, failing, fatal = answer_step(drafter, msg, failing, fail_file)
            if fatal is not None:
                return _exit_on_device_error(chan, msg, fatal)
            chan.send(resp, wait_s=REPLY_WAIT_S)
            drafter.answered()
    finally:
        trace = getattr(locals().get("drafter"), "trace", None)
        if trace is not None:
            trace.close()
        chan.close()


def answer_step(drafter, msg: StepRequest, failing: int, fail_file: str | None):
    """(the reply to `msg`, consecutive failed steps after it, None), or (None, failing, the error) when the
    step left the device unusable: the caller answers and exits (`_exit_on_device_error`)."""
    try:
        if fail_file and os.path.exists(fail_file):
            _injected_failure(fail_file)
        resp = drafter.step(msg)
    except Exception as err:
        if device_unusable(err):
            return None, failing, err
        return _reply_error(drafter, msg, err, first=not failing), failing + 1, None
    if failing:
        logger.info("drafter steps succeed again after %d failed ones", failing)
    return resp, 0, None


def _injected_failure(fail_file: str) -> None:
    """`SAGUARO_DRAFTER_FAIL_FILE`: raise as a buggy drafter would, or as a poisoned GPU ("cuda" in the file)."""
    try:
        with open(fail_file) as f:
            kind = f.read(16).strip().lower()
    except OSError:
        kind = ""
    if kind.startswith("cuda"):
        raise RuntimeError(f"CUDA error: an illegal memory access was encountered (injected: {FAIL_FILE_ENV}="
                           f"{fail_file})")
    raise RuntimeError(f"injected failure ({FAIL_FILE_ENV}={fail_file})")


def _advance(drafter) -> bool:
    """One pre-drafting forward (`mode: async`); a failure only loses this round's pre-drafts, unless it left
    the device unusable (then False: the drafter must exit)."""
    try:
        drafter.advance()
    except Exception as err:
        if device_unusable(err):
            logger.error("drafter: a device error during pre-drafting left the GPU unusable in this process; "
                         "exiting with status %d so that a new drafter is started", DEVICE_ERROR_EXIT,
                         exc_info=err)
            return False
        logger.exception("pre-drafting failed; this round's outcomes will miss")
    return True


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
        return serve(boot["endpoint"], boot["config"], int(boot["parent_pid"]), boot.get("restore_nice"))
    except _Exit:
        return 0
    finally:
        _exiting = True
        shutil.rmtree(socket_dir, ignore_errors=True)


if __name__ == "__main__":
    code = main()
    if code == DEVICE_ERROR_EXIT:  # skip interpreter teardown: freeing memory in a poisoned CUDA context can hang
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
