"""The drafter process: loads the draft model on its own device/cores and answers drafting steps.

Started by the proposer as `python -m saguaro_vllm.drafter.server --endpoint ipc://... --config JSON
--parent-pid PID`. It exits when told to, when its socket closes, or when its parent process is gone, so it
never outlives the vLLM worker. No vLLM import: this runs (and is tested) where vLLM is not installed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback

import torch

from saguaro_vllm.transport import Channel, Failed, Ready, Shutdown, StepRequest, StepResponse

logger = logging.getLogger("saguaro_vllm.drafter")
PARENT_POLL_S = 1.0
DELAY_ENV = "SAGUARO_DRAFTER_DELAY_S"


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
    from saguaro_vllm.drafter.model.linear_kernels import install_linear_kernel, resolve_linear
    from saguaro_vllm.drafter.model.loader import load_draft_model
    from saguaro_vllm.drafter.runner import DraftModelRunner
    from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
    from saguaro_vllm.drafter.sync_drafter import SyncDrafter

    dtype = _dtype(cfg["dtype"])
    model = load_draft_model(cfg["draft_path"], dtype=dtype, device=cfg["device"])
    linear = resolve_linear(cfg["saguaro"].get("linear", "auto"), cfg["device"], cfg["dtype"])
    install_linear_kernel(model, linear)
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
    mode = cfg["saguaro"].get("mode", "sync")
    info = {"num_blocks": num_blocks, "mode": mode, "linear": linear}
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


def serve(endpoint: str, cfg: dict, parent_pid: int) -> int:
    chan = Channel(endpoint, bind=False)
    try:
        place_process(cfg)
        drafter, info = build_drafter(cfg)
    except Exception as err:  # report, don't hang the proposer
        chan.send(Failed(f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        time.sleep(0.5)
        return 1
    info.update(threads=torch.get_num_threads(), cores=sorted(os.sched_getaffinity(0)))
    chan.send(Ready(os.getpid(), info))
    while True:
        busy = drafter.busy
        msg = chan.recv(timeout_s=0 if busy else PARENT_POLL_S)
        if msg is None:
            if busy:
                _advance(drafter)
            elif not _parent_alive(parent_pid):
                return 0
            continue
        if isinstance(msg, Shutdown):
            return 0
        if isinstance(msg, StepRequest):
            try:
                resp = drafter.step(msg)
            except Exception as err:  # a failing step must not take the drafter down
                logger.exception("drafter step failed")
                for row in msg.rows:
                    drafter.free(row.req_id)
                resp = StepResponse(msg.step, [[] for _ in msg.rows], {}, 0.0,
                                    resync=[r.req_id for r in msg.rows], error=f"{type(err).__name__}: {err}")
            chan.send(resp)
            drafter.answered()


def _advance(drafter) -> None:
    """One pre-drafting forward (`mode: async`); a failure only loses this round's pre-drafts."""
    try:
        drafter.advance()
    except Exception:
        logger.exception("pre-drafting failed; this round's outcomes will miss")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--config", required=True, help="resolved Saguaro config as JSON")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="(saguaro-drafter pid=%(process)d) %(levelname)s %(message)s")
    return serve(args.endpoint, json.loads(args.config), args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
