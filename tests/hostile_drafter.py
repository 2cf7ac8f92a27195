"""A drafter process that speaks the wire protocol but answers each step as a script says (test helper).

Started by `DrafterClient(..., server_module="hostile_drafter")` exactly like the real drafter (bootstrap
file, socket, Ready), it plays the local peer of the trust model: `cfg["script"]` lists one action per
step (the last one repeats). Actions: `ok` (K drafts of token 1 per row, float32 probabilities for rows with
`sampling.temperature > 0`), `wrong_step`, `oov` (a token id = vocab), `too_many` (K+1 drafts),
`bad_probs_shape`, `nan_probs`, `float64_probs`, `unreferenced_frame`, `oversized` (a reply far larger
than any legitimate one: megabytes of probabilities), `wrong_type` (a Ready during a step), `garbage` (bytes that are not
msgpack), `resync` (rows whose id starts with
"bad" resynced), `busy:S` (spin the CPU S seconds, then `ok`), `sleep:S` (sleep S
seconds, then `ok`), `hang` (never answer), `exit` (exit code 3), `echo_finished` (`ok`, with the
finished ids it received in `ssd["finished"]`), `disconnect:S` (close the socket for S seconds, then
reconnect; this step gets no answer), `ok_then_disconnect:S`.
"""
from __future__ import annotations

import json
import os
import sys
import time

import msgspec
import numpy as np
import zmq

from saguaro_vllm.shared.transport import Channel, Ready, StepResponse, ToDrafter


def _ok(req, k: int, vocab: int, finished: str | None = None) -> StepResponse:
    drafts = [[1] * row.num_drafts for row in req.rows]
    probs = {}
    for j, row in enumerate(req.rows):
        if row.sampling is not None and row.sampling.temperature > 0 and row.num_drafts:
            q = np.full((row.num_drafts, vocab), 1.0 / vocab, np.float32)
            probs[j] = q
    return StepResponse(req.step, drafts, probs, 0.0, ssd={"finished": finished} if finished is not None else None)


def answer(chan: Channel, req, action: str, k: int, vocab: int) -> Channel:
    name, _, arg = action.partition(":")
    if name in ("busy", "sleep"):
        end = time.monotonic() + float(arg)
        while time.monotonic() < end:
            if name == "sleep":
                time.sleep(0.01)
        name = "ok"
    if name == "ok":
        chan.send(_ok(req, k, vocab), wait_s=2)
    elif name == "echo_finished":
        chan.send(_ok(req, k, vocab, ",".join(req.finished)), wait_s=2)
    elif name == "resync":
        resp = _ok(req, k, vocab)
        resp.resync = [r.req_id for r in req.rows if r.req_id.startswith("bad")]
        resp.drafts = [[] if r.req_id in resp.resync else d for r, d in zip(req.rows, resp.drafts)]
        chan.send(resp, wait_s=2)
    elif name == "ok_then_disconnect":
        chan.send(_ok(req, k, vocab), wait_s=2)
        time.sleep(0.2)
        return answer(chan, req, f"disconnect:{arg}", k, vocab)
    elif name == "wrong_step":
        resp = _ok(req, k, vocab)
        resp.step += 1
        chan.send(resp, wait_s=2)
    elif name == "oov":
        resp = _ok(req, k, vocab)
        resp.drafts[0][0] = vocab
        chan.send(resp, wait_s=2)
    elif name == "too_many":
        resp = _ok(req, k, vocab)
        resp.drafts[0].append(1)
        chan.send(resp, wait_s=2)
    elif name in ("bad_probs_shape", "nan_probs", "float64_probs"):
        resp = _ok(req, k, vocab)
        q = np.full((len(resp.drafts[0]), vocab), 1.0 / vocab, np.float32)
        if name == "bad_probs_shape":
            q = q[:, : vocab - 1].copy()
        elif name == "nan_probs":
            q[0, 3] = np.nan
        else:
            q = q.astype(np.float64)
        resp.probs = {0: q}
        chan.send(resp, wait_s=2)
    elif name == "unreferenced_frame":
        frames = chan.codec.encode(_ok(req, k, vocab))
        chan.sock.send_multipart([*frames, b"\0" * 64])
    elif name == "oversized":
        resp = _ok(req, k, vocab)
        resp.probs = {0: np.zeros((len(resp.drafts[0]), 1 << 18), np.float32)}  # 1 MiB per draft
        chan.send(resp, wait_s=2)
    elif name == "wrong_type":
        chan.send(Ready(os.getpid(), {}), wait_s=2)
    elif name == "garbage":
        chan.sock.send(b"\xc1 not msgpack")
    elif name == "hang":
        while True:
            time.sleep(1)
    elif name == "exit":
        sys.exit(3)
    elif name == "disconnect":
        endpoint = chan.endpoint
        chan.close()
        time.sleep(float(arg))
        chan = Channel(endpoint, bind=False, accepts=ToDrafter)
        chan.endpoint = endpoint
    else:
        raise ValueError(f"unknown action {action!r}")
    return chan


def main() -> int:
    path = sys.argv[sys.argv.index("--bootstrap") + 1]
    with open(path) as f:
        boot = json.load(f)
    os.unlink(path)
    cfg = boot["config"]
    script, k, vocab = cfg["script"], cfg["num_speculative_tokens"], cfg["vocab_size"]
    chan = Channel(boot["endpoint"], bind=False, accepts=ToDrafter)
    chan.endpoint = boot["endpoint"]
    chan.send(Ready(os.getpid(), {"hostile": True}), wait_s=10)
    n = 0
    while True:
        try:
            msg = chan.recv(timeout_s=1.0)
        except (msgspec.DecodeError, zmq.ZMQError):
            continue
        if msg is None:
            if os.getppid() != boot["parent_pid"]:
                return 0
            continue
        if type(msg).__name__ == "Shutdown":
            return 0
        chan = answer(chan, msg, script[min(n, len(script) - 1)], k, vocab)
        n += 1


if __name__ == "__main__":
    sys.exit(main())
