"""Messages between the proposer (in vLLM's worker) and the drafter process, and the socket they travel on.

One ZeroMQ PAIR socket over a local `ipc://` endpoint in a 0700 directory, or over `tcp://` to a drafter on
another host (CurveZMQ with keys derived from a shared secret, `secret.py`; never TCP without it): messages
arrive in order, so the drafter's view of each request's context always equals what the proposer sent. Messages are
typed `msgspec` structs (as vLLM's own engine-core IPC), tagged so that one decoder per direction accepts
exactly the message types of that direction and rejects anything else. NumPy arrays (the proposal
probabilities) travel as raw frames after the msgpack header, described there by dtype and shape, so they
are neither pickled nor copied into the header. Every receive checks the message size and frame count
before decoding; `check_response` then checks a reply against the request it answers. No vLLM import here:
the drafter side must run without vLLM.
"""
from __future__ import annotations

import glob
import math
import os
import re
import shutil
import tempfile
from typing import Annotated, Any, Union

import numpy as np

try:
    import msgspec
except ImportError:  # the drafter driven in-process without msgspec (plain_structs.py says what works)
    from saguaro_vllm.shared import plain_structs as msgspec
try:
    import zmq
except ImportError:  # only `Channel` needs pyzmq; the messages and checks work without it
    zmq = None

#: vLLM treats temperatures below this as greedy (vllm.sampling_params._SAMPLING_EPS).
GREEDY_EPS = 1e-5
#: Hard per-frame limit of the socket (ZMQ_MAXMSGSIZE): a peer sending a bigger frame is disconnected.
MAX_FRAME_BYTES = 4 << 30
#: Default per-message limit (all frames) where the receiver knows no tighter bound.
DEFAULT_MAX_BYTES = 1 << 30
#: Limit of the control messages (Ready, Failed) and of a reply's header beyond its per-row allowance.
CONTROL_MAX_BYTES = 1 << 20
#: Dtypes an array frame may carry.
ARRAY_DTYPES = ("float32",)
#: Exit status of a drafter whose step hit a device error that poisons its CUDA context (drafter/server.py
#: `device_unusable`): it answers the step, exits with this, and its client restarts it.
DEVICE_ERROR_EXIT = 70

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Token = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
ReqId = Annotated[str, msgspec.Meta(max_length=4096)]


class MessageRejected(Exception):
    """A received message that is not a well-formed message of this direction; `reason` is a short label,
    `step` the step id its header names where one could be read (so the drafter can still answer)."""

    def __init__(self, reason: str, detail: str = "", step: int | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.step = reason, step


# ---- the messages -----------------------------------------------------------------------------------------
class SamplingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The per-request sampling parameters the draft proposal honours."""

    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: int = 0  # <= 0: disabled
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class RowUpdate(msgspec.Struct, forbid_unknown_fields=True):
    """One request of a step: the committed tokens appended since the last message, and how many drafts."""

    req_id: ReqId
    start: NonNegInt  # position of new_tokens[0] in the request's context
    new_tokens: list[Token]
    num_drafts: Annotated[int, msgspec.Meta(ge=0, le=64)]
    sampling: SamplingSpec | None = None  # set when the drafter sees the request for the first time


class StepRequest(msgspec.Struct, tag="step", forbid_unknown_fields=True):
    step: int
    rows: list[RowUpdate]
    finished: list[ReqId]
    #: `time.monotonic()` when the proposer sent the request (0: unknown). Linux's monotonic clock is shared
    #: by all processes, so the drafter measures the verification time and its own lateness with it.
    sent_at: float = 0.0


class StepResponse(msgspec.Struct, tag="reply", forbid_unknown_fields=True):
    step: int
    drafts: list[list[int]]
    #: row index -> float32 [len(drafts[row]), vocab] proposal probabilities, for sampled rows only.
    #: On the receiving side the arrays are views of the received frames.
    probs: dict[int, np.ndarray]
    compute_s: float
    #: requests whose context the drafter does not hold (lost state): resend them from position 0.
    resync: list[str] = []
    error: str | None = None
    live_requests: int = 0  # requests the drafter holds state for, after this step
    free_blocks: int = 0  # free blocks of the drafter's KV cache, after this step
    #: Per row: noroom (no drafts: the drafter's KV cache had no room), none (no drafts otherwise); in
    #: `mode: sync` drafted, in `mode: async` hit (from the speculation cache), jit or ngram (a miss and its
    #: backup), new (no round to look up: a new or resent request); and, async only, the accepted count a
    #: of the outcome looked up (-1: none derivable).
    row_status: list[str] = []
    row_depth: list[int] = []
    #: `mode: async` only: `ssd_drafter.SSDStats` of this step, as a dict.
    ssd: dict[str, Union[bool, int, float, str]] | None = None
    #: The proposal-ring slot (saguaro_vllm/shared/proposal_buffers.py) holding the sampled rows' q (-1: none), and
    #: for each of its rows, in order, the row of `drafts` it belongs to (q for all of that row's drafts).
    probs_slot: int = -1
    probs_rows: list[NonNegInt] = []
    #: Sampled rows that got no drafts this step because the slot had no row left for their q beside the
    #: one-hot rows of the step's other drafted rows (`saguaro.max_sampled_rows`; proposal_buffers.fit_rows).
    probs_capped: NonNegInt = 0


class Ready(msgspec.Struct, tag="ready", forbid_unknown_fields=True):
    pid: int
    info: dict[str, Any]
    session: str = ""  # a remote drafter: the `Hello.session` this answers


class Failed(msgspec.Struct, tag="failed", forbid_unknown_fields=True):
    error: str


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """A worker's first message to a remote drafter on a new connection: what the drafter must draft for
    (its vocabulary is checked against the draft's), and the proposal ring's shape, which the drafter mirrors
    locally. `session` comes back in `Ready`, so a worker never takes an older connection's Ready for this
    one. `config`: the worker's resolved `saguaro` options that shape drafting (mode, fan-out ...)."""

    session: Annotated[str, msgspec.Meta(max_length=64)]
    vocab_size: Annotated[int, msgspec.Meta(ge=1)]
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=64)]
    max_model_len: int | None
    ring_rows: NonNegInt
    config: dict[str, Any]


class Shutdown(msgspec.Struct, tag="shutdown", forbid_unknown_fields=True):
    pass


#: What the drafter may receive, and what the proposer may receive.
ToDrafter = Union[StepRequest, Shutdown]
ToRemoteDrafter = Union[StepRequest, Shutdown, Hello]
ToProposer = Union[StepResponse, Ready, Failed]


class _StepId(msgspec.Struct, tag="step"):
    """Only the step id of a StepRequest (other fields ignored): to answer a request that was rejected."""

    step: int


_step_id_decoder = msgspec.msgpack.Decoder(_StepId)


def rejected_step(header) -> int | None:
    """The step id of a StepRequest header that failed to decode, if it can be read at all."""
    try:
        return _step_id_decoder.decode(header).step
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


class _ArrayRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Header placeholder of an array: which raw frame holds it, its dtype and shape."""

    frame: NonNegInt
    dtype: str
    shape: list[NonNegInt]


# ---- encoding -----------------------------------------------------------------------------------------------
class _Codec:
    """msgpack header + raw array frames. One instance per socket (not thread-safe)."""

    def __init__(self, accepts: Any):
        self._frames: list = []
        self._used: set[int] = set()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(accepts, dec_hook=self._dec_hook)

    def encode(self, msg) -> list:
        self._frames = [b""]
        try:
            self._frames[0] = self._encoder.encode(msg)
            return self._frames
        finally:
            self._frames = []

    def _enc_hook(self, obj):
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            self._frames.append(arr.data if arr.size else b"")
            return _ArrayRef(len(self._frames) - 1, str(arr.dtype), list(arr.shape))
        raise NotImplementedError(f"cannot send a {type(obj).__name__}")

    def decode(self, frames: list):
        self._frames, self._used = frames, set()
        try:
            msg = self._decoder.decode(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
        except MessageRejected:
            raise
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise MessageRejected("malformed", str(err)) from None
        finally:
            self._frames = []
        if len(self._used) != len(frames) - 1:
            raise MessageRejected("frames", f"{len(frames) - 1} raw frames, {len(self._used)} referenced")
        return msg

    def _dec_hook(self, typ, obj):
        if typ is not np.ndarray:
            raise TypeError(f"unsupported type {typ}")
        try:
            ref = msgspec.convert(obj, _ArrayRef)
        except msgspec.ValidationError as err:
            raise MessageRejected("malformed", f"array reference: {err}") from None
        if ref.dtype not in ARRAY_DTYPES:
            raise MessageRejected("dtype", f"array dtype {ref.dtype!r}, allowed {ARRAY_DTYPES}")
        if not 1 <= ref.frame < len(self._frames) or ref.frame in self._used:
            raise MessageRejected("frames", f"array frame {ref.frame} missing or used twice")
        self._used.add(ref.frame)
        frame = self._frames[ref.frame]
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        dtype = np.dtype(ref.dtype)
        if math.prod(ref.shape) * dtype.itemsize != buf.nbytes:
            raise MessageRejected("shape", f"array shape {ref.shape} does not match its {buf.nbytes} bytes")
        return np.frombuffer(buf, dtype=dtype).reshape(ref.shape)


# ---- checks of a reply against its request ------------------------------------------------------------------
def reply_size_limit(req: StepRequest, vocab_size: int) -> tuple[int, int]:
    """(max bytes, max frames) of a legitimate reply to `req`: a header allowance per row and token, plus
    a float32 [num_drafts, vocab] array per row."""
    header = CONTROL_MAX_BYTES + sum(1024 + 2 * len(r.req_id) + 16 * r.num_drafts for r in req.rows)
    arrays = sum(r.num_drafts for r in req.rows) * vocab_size * 4
    return header + arrays, 1 + len(req.rows)


def check_response(req: StepRequest, resp: StepResponse, vocab_size: int) -> str | None:
    """None if `resp` is a usable answer to `req`, else the reason (a short label and what was wrong).

    Checks the step id, the row count, each draft's length (at most its row's `num_drafts`) and token ids
    (in [0, vocab)), the probability arrays (valid row, float32 [len(draft), vocab], values in [0, 1], the
    drafted token's probability > 0), the per-row status lists and that resynced ids were rows of `req`."""
    if resp.step != req.step:
        return f"step_id: reply to step {resp.step}, expected {req.step}"
    n = len(req.rows)
    if len(resp.drafts) != n:
        return f"rows: {len(resp.drafts)} draft rows for {n} rows sent"
    for j, (row, draft) in enumerate(zip(req.rows, resp.drafts)):
        if len(draft) > row.num_drafts:
            return f"draft_length: row {j} has {len(draft)} drafts, asked for {row.num_drafts}"
        for tok in draft:
            if not 0 <= tok < vocab_size:
                return f"token_id: row {j} has token {tok}, vocabulary is {vocab_size}"
    for j, q in resp.probs.items():
        if not 0 <= j < n:
            return f"probs_row: probabilities for row {j} of {n}"
        want = (len(resp.drafts[j]), vocab_size)
        if q.dtype != np.float32 or q.shape != want:
            return f"probs_shape: row {j} has {q.dtype} {list(q.shape)}, expected float32 {list(want)}"
        if q.size and not (q.min() >= 0.0 and q.max() <= 1.0):  # also false for NaN
            return f"probs_value: row {j} has probabilities outside [0, 1] or not finite"
        if q.size and not (q[np.arange(want[0]), resp.drafts[j]] > 0).all():
            return f"probs_value: row {j} drafted a token its probabilities give 0"
    if resp.probs_rows and resp.probs_slot < 0:
        return "probs_slot: rows with probabilities but no slot"
    if len(set(resp.probs_rows)) != len(resp.probs_rows):
        return "probs_rows: a row appears twice"
    for j in resp.probs_rows:
        if not 0 <= j < n or not resp.drafts[j] or j in resp.probs:
            return f"probs_rows: row {j} is not a row of {n} with drafts (and without inline probabilities)"
    for name in ("row_status", "row_depth"):
        if len(getattr(resp, name)) not in (0, n):
            return f"{name}: {len(getattr(resp, name))} entries for {n} rows"
    sent = {r.req_id for r in req.rows}
    if any(rid not in sent for rid in resp.resync):
        return "resync: a resynced request was not in the step"
    return None


# ---- endpoint and socket ------------------------------------------------------------------------------------
_DIR_RE = re.compile(r"^saguaro-(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_dirs(tmp: str | None = None) -> list[str]:
    """Remove this user's `saguaro-<pid>-*` socket directories whose owner process is gone (left behind
    when both the worker and its drafter were SIGKILLed). Returns the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(tmp or tempfile.gettempdir(), "saguaro-*")):
        m = _DIR_RE.match(os.path.basename(path))
        try:
            if m is None or os.stat(path).st_uid != os.getuid() or _pid_alive(int(m.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def new_endpoint() -> str:
    """A fresh local IPC endpoint in a private (0700) temp dir named after this process."""
    sweep_stale_dirs()
    base = tempfile.mkdtemp(prefix=f"saguaro-{os.getpid()}-")
    os.chmod(base, 0o700)
    return f"ipc://{base}/drafter.sock"


def endpoint_path(endpoint: str) -> str:
    return endpoint.removeprefix("ipc://")


def endpoint_dir(endpoint: str) -> str:
    return os.path.dirname(endpoint_path(endpoint))


#: ZeroMQ heartbeats on a TCP link: a peer that vanished without closing its connection (a host that lost
#: power, a cut cable) is dropped after HEARTBEAT_TIMEOUT_MS, so its end sees the disconnect and a drafter's
#: PAIR socket is free for the next worker. Pings travel on ZeroMQ's I/O thread, also while the drafter computes.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
#: How often ZeroMQ retries a TCP connect to a drafter that is not listening: 100 ms, doubling to this.
RECONNECT_IVL_MAX_MS = 2000


def tcp_endpoint(endpoint: str, field: str = "saguaro.drafter_endpoint") -> tuple[str, int]:
    """(host, port) of a `tcp://HOST:PORT` endpoint; ValueError naming `field` and the fix otherwise."""
    m = re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", endpoint or "")
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{field}: {endpoint!r} is not a tcp://HOST:PORT endpoint (e.g. tcp://10.0.0.5:5601; "
                         "a host name or an IP address and a port 1-65535)")
    return m.group(1), int(m.group(2))


class Channel:
    """A PAIR socket carrying typed messages. Sends never block; receives are size-checked and typed.

    `accepts` is the union of message types this end may receive (`ToDrafter` or `ToProposer`). A local
    `ipc://` endpoint needs no keys; a `tcp://` one needs `curve` (`secret.curve_keys`: the drafter, which
    binds, is the CURVE server) and has heartbeats and a monitor (`events`)."""

    def __init__(self, endpoint: str, bind: bool, accepts: Any, max_bytes: int = DEFAULT_MAX_BYTES,
                 curve=None):
        remote = endpoint.startswith("tcp://")
        if not endpoint.startswith("ipc://") and not remote:
            raise ValueError(f"drafter endpoint must be ipc:// (local) or tcp:// (remote), got {endpoint!r}")
        if remote and curve is None:
            raise ValueError("a tcp:// drafter link needs CURVE keys from the shared secret (secret.curve_keys)")
        if zmq is None:
            raise ImportError("pyzmq is not installed: the drafter socket (transport.Channel) needs it")
        self.max_bytes = max_bytes
        self.codec = _Codec(accepts)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.monitor = None
        if remote:
            self._secure(curve, bind)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    def _secure(self, curve, server: bool) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("the installed libzmq has no CURVE support (zmq.has('curve') is False): a remote "
                               "drafter link cannot be authenticated; install pyzmq's wheel, which bundles it")
        self.sock.curve_publickey, self.sock.curve_secretkey = curve.public, curve.secret
        if server:
            self.sock.curve_server = True
            self.sock.zap_domain = b"saguaro"  # the drafter's ZAP handler admits the worker key only
        else:
            self.sock.curve_serverkey = curve.peer_public
            self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a drafter that is not connected
            self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.monitor = self.sock.get_monitor_socket()

    def events(self) -> list[int]:
        """The connection events (`zmq.EVENT_*`) since the last call, without waiting (tcp:// only)."""
        out = []
        while self.monitor is not None and self.monitor.poll(0):
            from zmq.utils.monitor import recv_monitor_message

            out.append(int(recv_monitor_message(self.monitor)["event"]))
        return out

    def send(self, msg, wait_s: float = 0.0, track: bool = False):
        """Queue `msg` for the peer; False if no peer is connected (or its queue is full) within `wait_s`
        (default: do not wait). With `track`, a `zmq.MessageTracker` (done once ZeroMQ let go of the array
        frames, which it sends without copying) instead of True."""
        if wait_s > 0 and not self.sock.poll(int(wait_s * 1000), zmq.POLLOUT):
            return False
        try:
            tracker = self.sock.send_multipart(self.codec.encode(msg), copy=False, flags=zmq.NOBLOCK, track=track)
            return tracker if track else True
        except zmq.Again:
            return False

    def recv(self, timeout_s: float | None = None, max_bytes: int | None = None, max_frames: int | None = None):
        """The next message, or None if none arrives within `timeout_s` (None: wait forever).

        Raises MessageRejected (the message is consumed) if it exceeds `max_bytes` (default: the channel's)
        or `max_frames`, or is not a well-formed message of an accepted type."""
        if timeout_s is not None and not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        try:  # (a readable socket may still hold no whole message: one cut short by a dropped connection)
            frames = self.sock.recv_multipart(copy=False, flags=zmq.NOBLOCK if timeout_s is not None else 0)
        except zmq.Again:
            return None
        limit = self.max_bytes if max_bytes is None else max_bytes
        size = sum(f.buffer.nbytes for f in frames)
        try:
            if size > limit:
                raise MessageRejected("oversized", f"{size} bytes, limit {limit}")
            if max_frames is not None and len(frames) > max_frames:
                raise MessageRejected("frames", f"{len(frames)} frames, limit {max_frames}")
            return self.codec.decode(frames)
        except MessageRejected as err:
            if frames[0].buffer.nbytes <= CONTROL_MAX_BYTES:
                err.step = rejected_step(frames[0].buffer)
            raise

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        self.sock.close(linger=0)
