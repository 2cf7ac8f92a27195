"""Messages between the proposer (in vLLM's worker) and the drafter process, and the socket they travel on.

One ZeroMQ PAIR socket over a local `ipc://` endpoint (never TCP): messages are delivered in order, so the
drafter's view of each request's context always equals what the proposer sent. Payloads are pickled
dataclasses of plain Python lists and NumPy arrays (local and trusted: both ends are our processes).
No vLLM import here: the drafter side must run without vLLM.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile
import uuid

import numpy as np
import zmq

#: vLLM treats temperatures below this as greedy (vllm.sampling_params._SAMPLING_EPS).
GREEDY_EPS = 1e-5
SEND_TIMEOUT_MS = 2000


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """The per-request sampling parameters the draft proposal honours."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0: disabled
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclasses.dataclass
class RowUpdate:
    """One request of a step: the committed tokens appended since the last message, and how many drafts."""

    req_id: str
    start: int  # position of new_tokens[0] in the request's context
    new_tokens: list[int]
    num_drafts: int
    sampling: SamplingSpec | None = None  # set when the drafter sees the request for the first time


@dataclasses.dataclass
class StepRequest:
    step: int
    rows: list[RowUpdate]
    finished: list[str]
    #: `time.monotonic()` when the proposer sent the request (0: unknown). Linux's monotonic clock is shared
    #: by all processes, so the drafter measures the verification time and its own lateness with it.
    sent_at: float = 0.0


@dataclasses.dataclass
class StepResponse:
    step: int
    drafts: list[list[int]]
    #: row index -> float32 [num_drafts, vocab] proposal probabilities, for sampled rows only.
    probs: dict[int, np.ndarray]
    compute_s: float
    #: requests whose context the drafter does not hold (lost state): resend them from position 0.
    resync: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    live_requests: int = 0  # requests the drafter holds state for, after this step
    free_blocks: int = 0  # free blocks of the drafter's KV cache, after this step
    #: Per row: noroom (no drafts: the drafter's KV cache had no room), none (no drafts otherwise); in
    #: `mode: sync` drafted, in `mode: async` hit (from the speculation cache), jit or ngram (a miss and its
    #: backup), new (no round to look up: a new or resent request); and, async only, the accepted count a
    #: of the outcome looked up (-1: none derivable).
    row_status: list[str] = dataclasses.field(default_factory=list)
    row_depth: list[int] = dataclasses.field(default_factory=list)
    #: `mode: async` only: `ssd_drafter.SSDStats` of this step, as a dict.
    ssd: dict | None = None


@dataclasses.dataclass
class Ready:
    pid: int
    info: dict


@dataclasses.dataclass
class Failed:
    error: str


@dataclasses.dataclass
class Shutdown:
    pass


def new_endpoint() -> str:
    """A fresh local IPC endpoint in a private temp dir."""
    base = tempfile.mkdtemp(prefix="saguaro-")
    os.chmod(base, 0o700)
    return f"ipc://{base}/drafter-{uuid.uuid4().hex[:8]}.sock"


def endpoint_path(endpoint: str) -> str:
    return endpoint.removeprefix("ipc://")


class Channel:
    """A PAIR socket with pickled messages and receive time-outs."""

    def __init__(self, endpoint: str, bind: bool):
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"drafter endpoint must be local ipc://, got {endpoint!r}")
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        # PAIR sockets block on send while no peer is connected: never let a dead peer hang us.
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    def send(self, msg) -> bool:
        """Send `msg`; False if the peer could not take it within SEND_TIMEOUT_MS."""
        try:
            self.sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
            return True
        except zmq.Again:
            return False

    def recv(self, timeout_s: float | None = None):
        """The next message, or None if none arrives within `timeout_s` (None: wait forever)."""
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000)):
            return None
        return pickle.loads(self.sock.recv(copy=False))

    def close(self) -> None:
        self.sock.close(linger=0)
