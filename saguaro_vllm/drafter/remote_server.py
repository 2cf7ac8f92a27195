"""A drafter on its own host: `saguaro-vllm drafter --listen tcp://HOST:PORT --model DRAFT`.

Loads the draft once and serves one worker at a time (a vLLM engine's output rank, `saguaro.drafter_endpoint`)
over a CurveZMQ PAIR socket: only a worker holding the shared secret completes the handshake (the ZAP handler
admits the one worker key the secret gives, shared/secret.py). Each connection is a session: the worker's
`Hello` says what to draft for; the drafter checks the vocabulary, builds a fresh KV cache and drafting engine
with the worker's drafting options and its own host options, and answers `Ready`. Nothing survives a session,
so a worker that reconnects resends every context, as after a local drafter's restart.

What differs from a local drafter (server.py), and why:
- Sampled rows' q cannot go through the worker's shared memory: the drafter writes them into a private ring of
  the same shape (the drafting code is unchanged) and sends the written rows as array frames of the reply
  (`inline_probs`). ZeroMQ sends them without copying, so a slot is reused only once ZeroMQ let go of it.
- `StepRequest.sent_at` is the worker host's monotonic clock: it is mapped onto this host's (`ClockMap`) so
  the planner's verification and lateness times mean what they mean locally.
- It is not the worker's child: it runs until SIGTERM or Ctrl-C, and outlives its workers.
No vLLM import.
"""
from __future__ import annotations

import collections
import gc
import logging
import os
import signal
import time

import torch

from saguaro_vllm.drafter import server
from saguaro_vllm.shared.proposal_buffers import FREE, HELD, ProposalRing
from saguaro_vllm.shared.secret import curve_keys
from saguaro_vllm.shared.transport import Channel, Failed, Hello, MessageRejected, Ready, Shutdown, StepRequest, \
    StepResponse, ToRemoteDrafter

logger = logging.getLogger("saguaro_vllm.drafter")
IDLE_POLL_S = 0.5
#: A CURVE failure not followed by a disconnect within this long was a message failing on a live connection.
WEDGED_S = 1.0


class ClockMap:
    """The worker's `time.monotonic()` on this host's: each request's (received here - sent there) is the
    clocks' offset plus its transit; the smallest over the last `window` requests is the best estimate of the
    offset (a request that waited for a forward only arrives later), and the window follows a slow drift."""

    def __init__(self, window: int = 256):
        self._gaps: collections.deque[float] = collections.deque(maxlen=window)

    def local(self, sent_at: float, received_at: float) -> float:
        if sent_at <= 0:
            return 0.0  # unknown stays unknown
        self._gaps.append(received_at - sent_at)
        return sent_at + min(self._gaps)


class Session:
    """One worker's drafter: the engine built for its Hello, its private ring and the slots ZeroMQ holds."""

    def __init__(self, hello: Hello, drafter, ring: ProposalRing | None):
        self.id, self.drafter, self.ring = hello.session, drafter, ring
        self.clock = ClockMap()
        self.sending: dict[int, object] = {}  # ring slot -> the zmq.MessageTracker of the reply carrying it
        self.failing = 0

    def release_sent(self) -> None:
        """Give back the slots whose replies ZeroMQ has sent (it reads them until then: no copy)."""
        for slot, tracker in list(self.sending.items()):
            if tracker is True or tracker is False or tracker.done:
                if self.ring.header[slot, 0] == HELD:
                    self.ring.header[slot, 0] = FREE
                del self.sending[slot]

    def close(self) -> None:
        if self.drafter is not None and self.drafter.trace is not None:
            self.drafter.trace.close()
        self.drafter = None
        if self.ring is not None:
            self.ring.close()


def inline_probs(resp: StepResponse, ring: ProposalRing) -> int:
    """Turn a reply naming a slot of the private ring into one carrying the written rows' q as arrays (views
    of the slot: [len(draft), vocab] float32 per sampled row). Returns the slot (-1: none)."""
    slot = resp.probs_slot
    if slot < 0:
        return -1
    buf = ring.slot(slot).numpy()
    resp.probs = {j: buf[r, : len(resp.drafts[j])] for r, j in enumerate(resp.probs_rows)}
    resp.probs_slot, resp.probs_rows = -1, []
    return slot


class RemoteDrafter:
    def __init__(self, listen: str, cfg: dict, secret: bytes):
        self.cfg = cfg
        self.loaded = server.load_draft(cfg)
        self.vocab = self.loaded["model"].config.vocab_size
        self.keys = curve_keys(secret, server=True)
        self.chan = Channel(listen, bind=True, accepts=ToRemoteDrafter, curve=self.keys)
        self.auth = _authenticator(self.chan.ctx, self.keys.peer_public)
        self.session: Session | None = None
        self.refusing = False
        self.wedged_at: float | None = None
        self.fail_file = os.environ.get(server.FAIL_FILE_ENV)

    # ---- sessions ---------------------------------------------------------------------------------------------
    def _open(self, hello: Hello) -> None:
        self._end(None)
        if hello.vocab_size != self.vocab:
            logger.error("refused a worker: its vocabulary has %d tokens, the draft's %d", hello.vocab_size, self.vocab)
            self.chan.send(Failed(f"the draft's vocabulary ({self.vocab} tokens, {self.cfg['draft_path']}) differs "
                                  f"from the target's ({hello.vocab_size}); serve a draft trained with the target's "
                                  "tokenizer"), wait_s=server.CONTROL_WAIT_S)
            return
        cfg = {**self.cfg, "vocab_size": self.vocab, "num_speculative_tokens": hello.num_speculative_tokens,
               "max_model_len": hello.max_model_len, "saguaro": {**self.cfg["saguaro"], **hello.config}}
        try:
            drafter, info = server.make_drafter(self.loaded, cfg)
            ring = ProposalRing.create(hello.ring_rows, hello.num_speculative_tokens, self.vocab) \
                if hello.ring_rows else None
        except Exception as err:
            logger.exception("could not build a drafter for the worker")
            self.chan.send(Failed(f"{type(err).__name__}: {err}"[:65536]), wait_s=server.CONTROL_WAIT_S)
            return
        drafter.probs_ring = ring
        self.session = Session(hello, drafter, ring)
        info.update(threads=torch.get_num_threads(), cores=sorted(os.sched_getaffinity(0)), remote=True)
        self.chan.send(Ready(os.getpid(), info, session=hello.session), wait_s=server.CONTROL_WAIT_S)
        logger.info("a worker connected (session %s, mode %s, K=%d): serving it", hello.session,
                    cfg["saguaro"].get("mode"), hello.num_speculative_tokens)

    def _end(self, why: str | None) -> None:
        if self.session is None:
            return
        if why:
            logger.info("session %s ended: %s", self.session.id, why)
        self.session.close()
        self.session = None
        gc.collect()
        if self.cfg["device"].startswith("cuda"):
            torch.cuda.empty_cache()

    def _watch(self) -> None:
        """Connection events: one log line per change (a run of refused handshakes is one line). A worker's
        leaving needs no event: the next worker's Hello ends its session."""
        import zmq

        for event in self.chan.events():
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and self.wedged_at is None:
                self.wedged_at = time.monotonic()  # cleared by the refused connection's close, if it was one
            if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                if not self.refusing:
                    logger.warning("refused a connection: its CURVE handshake failed (a worker with another "
                                   "secret, or no Saguaro worker); further refusals are not logged until one "
                                   "succeeds")
                self.refusing = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refusing = False
            elif event == zmq.EVENT_DISCONNECTED:
                self.wedged_at = None
        if self.wedged_at is not None and time.monotonic() - self.wedged_at > WEDGED_S:
            self._rebind()

    def _rebind(self) -> None:
        """A message failed its CURVE authenticator on an established connection (altered on the way): libzmq
        4.3.5 drops it but leaves that connection's input stuck, and asserts later; a new socket ends it (the
        worker sees its connection closed and reconnects)."""
        logger.error("a message from the worker failed authentication (altered on the way?): closing the "
                     "connection and listening anew")
        self._end("the connection was closed")
        self.chan.close()
        self.chan = Channel(self.cfg["listen"], bind=True, accepts=ToRemoteDrafter, curve=self.keys)
        self.wedged_at = None

    # ---- the loop ---------------------------------------------------------------------------------------------
    def serve(self) -> int:
        logger.info("listening on %s (draft %s on %s, vocabulary %d)", self.cfg["listen"], self.cfg["draft_path"],
                    self.cfg["device"], self.vocab)
        while True:
            self._watch()
            busy = self.session is not None and self.session.drafter.busy
            try:
                msg = self.chan.recv(timeout_s=0 if busy else IDLE_POLL_S)
            except MessageRejected as err:
                logger.error("rejected a malformed message (%s)", err)
                if err.step is not None:
                    self.chan.send(StepResponse(err.step, [], {}, 0.0, error=f"request rejected: {err}"))
                continue
            received = time.monotonic()
            if msg is None:
                if busy and not server._advance(self.session.drafter):
                    return server.DEVICE_ERROR_EXIT
            elif isinstance(msg, Hello):
                self._open(msg)
            elif isinstance(msg, Shutdown):
                self._end("the worker closed it")
            elif self.session is None:
                self.chan.send(StepResponse(msg.step, [], {}, 0.0, error="no session: the worker sends Hello first"))
            elif (code := self._step(msg, received)) is not None:
                return code

    def _step(self, msg: StepRequest, received: float) -> int | None:
        s = self.session
        s.release_sent()
        msg.sent_at = s.clock.local(msg.sent_at, received)
        resp, s.failing, fatal = server.answer_step(s.drafter, msg, s.failing, self.fail_file)
        if fatal is not None:
            return server._exit_on_device_error(self.chan, msg, fatal)
        slot = inline_probs(resp, s.ring) if s.ring is not None else -1
        tracker = self.chan.send(resp, wait_s=server.REPLY_WAIT_S, track=slot >= 0)
        if slot >= 0:
            s.sending[slot] = tracker
        s.drafter.answered()
        return None

    def close(self) -> None:
        self._end(None)
        self.auth.stop()
        self.chan.close()


def _authenticator(ctx, worker_key: bytes):
    """ZeroMQ's ZAP handler (a thread) admitting only the worker key the shared secret gives."""
    from zmq.auth.thread import ThreadAuthenticator

    class _Keys:
        def callback(self, domain: str, key: bytes) -> bool:
            return key == worker_key

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="saguaro", credentials_provider=_Keys())
    return auth


def run(listen: str, cfg: dict, secret: bytes) -> int:
    """Serve until SIGTERM or Ctrl-C (exit 0), or a device error (DEVICE_ERROR_EXIT: restart the drafter)."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if cfg["device"] == "cpu" and cfg.get("draft_cores"):
        from saguaro_vllm.shared.placement import pin_process

        pin_process(cfg["draft_cores"])
    elif cfg["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(cfg["device"]))
    drafter = RemoteDrafter(listen, {**cfg, "listen": listen}, secret)
    gc.collect()
    gc.freeze()  # the loaded draft lives as long as the process (server.serve says why)
    try:
        return drafter.serve()
    except KeyboardInterrupt:
        logger.info("stopping")
        return 0
    finally:
        drafter.close()
