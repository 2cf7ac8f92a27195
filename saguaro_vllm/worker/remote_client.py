"""The proposer's handle on a drafter on another host (`saguaro.drafter_endpoint`): connect, never spawn.

The same state machine as a local drafter (`DrafterClient`: starting, ready, late, restarting; every
failure is "no drafts this step", vLLM decodes normally, a request never fails or waits), with a
connection in place of a process:

    starting --CURVE handshake, Hello--> Ready --> ready --connection lost--> restarting --backoff--> ...

- The link is a PAIR socket over TCP with CurveZMQ keys derived from the shared secret (shared/secret.py);
  ZeroMQ's heartbeats drop a drafter whose host vanished. A refused handshake (another secret), a lost
  connection or a drafter that stays silent past `step_timeout_s` closes the socket; a new one connects
  after `RestartPolicy`'s backoff (0.5 s doubling to 5 s, without a budget: the drafter's restarts are its
  host's business, and a connection attempt costs nothing here). While the drafter is not listening ZeroMQ
  retries the TCP connect itself (transport.RECONNECT_IVL_MAX_MS).
- Every new connection is a new drafter as far as the proposer knows: `generation` bumps and every context
  is resent. The worker's `Hello` says what to draft for (vocabulary, K, the drafting options); a drafter
  that cannot serve it answers `Failed` and speculation is disabled, naming why.
- Sampled rows' q cannot reach this host through shared memory: they travel as array frames of the reply
  (size-checked against the request, `transport.reply_size_limit`, and value-checked by `check_response`)
  and are copied into a slot of the proposer's own proposal ring, so the proposer uses them as it uses a
  local drafter's.
- A remote drafter's CPU cannot be probed: a drafter past its step deadline is taken as computing (`late`)
  until `step_timeout_s`.
"""
from __future__ import annotations

import secrets
import sys

import numpy as np

from saguaro_vllm.shared.proposal_buffers import ProposalRing
from saguaro_vllm.shared.secret import curve_keys, read_secret
from saguaro_vllm.shared.transport import CONTROL_MAX_BYTES, Channel, Failed, Hello, MessageRejected, Ready, \
    StepRequest, StepResponse, ToProposer
from saguaro_vllm.worker.drafter_client import DrafterClient
from saguaro_vllm.worker.drafter_policy import RestartPolicy
from saguaro_vllm.worker.drafter_states import RESTARTING

#: How long vLLM's model loading waits for a remote drafter before starting without it (it connects later).
READY_WAIT_S = 10.0
#: A connected drafter answers Hello after building its KV cache (and CUDA graphs): at most this long.
HELLO_TIMEOUT_S = 60.0
RECONNECT_BACKOFF_S, RECONNECT_MAX_BACKOFF_S = 0.5, 5.0
#: The worker's options the remote drafter drafts with; its host's own (device, cores, KV cache ...) are
#: given on its command line (`saguaro-vllm drafter`).
DRAFTING_OPTIONS = ("mode", "fanout", "fanout_budget", "max_fanout_budget", "miss_fanout", "backup", "depth",
                    "fallback", "finish_predraft", "sampling_scale", "sampling_scale_tokens")


def _events():
    import zmq

    return zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED, (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class RemoteDrafterClient(DrafterClient):
    def __init__(self, cfg: dict, logger, metrics=None, vocab_size: int | None = None,
                 ring: ProposalRing | None = None, **kwargs):
        opts = cfg["saguaro"]
        self.remote = opts["drafter_endpoint"]
        self.keys = curve_keys(read_secret(opts.get("drafter_secret_file")), server=False)
        self.ring = ring
        self._session = ""
        self._handshaken = False
        self._hello_at: float | None = None
        self._gone_reason: str | None = None
        self._last_loss: str | None = None
        super().__init__(cfg, logger, metrics=metrics, vocab_size=vocab_size, **kwargs)
        self.policy = RestartPolicy(max_restarts=sys.maxsize, backoff_s=RECONNECT_BACKOFF_S,
                                    max_backoff_s=RECONNECT_MAX_BACKOFF_S, clock=self.clock)
        self.logger.info("Saguaro: connecting to the remote drafter at %s", self.remote)

    # ---- the connection (in place of DrafterClient's process) -------------------------------------------------
    def _start(self) -> None:
        self._restart_at = None
        self.endpoint = self.remote
        self.chan = Channel(self.remote, bind=False, accepts=ToProposer, curve=self.keys)
        self._session = secrets.token_hex(8)
        self._handshaken, self._hello_at, self._gone_reason = False, None, None
        self._started_at = self.clock()

    def _gone(self) -> str | None:
        if self.chan is None or self._gone_reason is not None:
            return self._gone_reason
        succeeded, disconnected, failed = _events()
        for event in self.chan.events():
            if event == succeeded:
                self._handshaken = True
            elif event in failed:
                self._gone_reason = (
                    "refused the connection in the CURVE handshake: its secret differs from this worker's "
                    "(saguaro.drafter_secret_file or $SAGUARO_DRAFTER_SECRET), or it is no Saguaro drafter")
            elif event == disconnected and self._handshaken:
                self._gone_reason = ("closed the connection (it stopped, its host is unreachable, or it serves "
                                     "another worker)")
        return self._gone_reason

    def _probe(self) -> None:
        return None  # another host's process: nothing to probe

    def _busy(self, late: dict) -> bool:
        late["probed"] = self.clock()
        return True  # cannot be probed: late until saguaro.step_timeout_s

    def _poll_loading(self) -> None:
        if (gone := self._gone()) is not None:
            self._lost(gone)
            return
        if self._hello_at is None:
            if self._handshaken:
                self._hello_at = self.clock()
                self.chan.send(self._hello())
            return
        try:
            msg = self.chan.recv(timeout_s=0, max_bytes=CONTROL_MAX_BYTES)
        except MessageRejected as err:
            self._lost(f"sent a malformed start-up message ({err})")
            return
        if isinstance(msg, Ready) and msg.session == self._session:
            self._last_loss = None
            self._on_ready(msg)
        elif isinstance(msg, Failed):
            self._disable(f"the remote drafter at {self.remote} cannot serve this worker: {msg.error}")
        elif self.clock() - self._hello_at > HELLO_TIMEOUT_S:
            self._lost(f"did not answer this worker's hello within {HELLO_TIMEOUT_S:.0f} s")

    def _hello(self) -> Hello:
        opts = self.cfg["saguaro"]
        return Hello(self._session, self.vocab_size, int(self.cfg["num_speculative_tokens"]),
                     self.cfg.get("max_model_len"), self.ring.rows if self.ring is not None else 0,
                     {k: opts[k] for k in DRAFTING_OPTIONS if k in opts})

    def _lost(self, reason: str) -> None:
        """The connection is gone with the drafter's state: a new one after the backoff (no budget)."""
        self._retire()
        self.generation += 1
        self._failed_at = self.clock()
        delay = self.policy.next_delay()
        self.restarts += 1
        self.metrics.on_drafter_restart()
        self._restart_at = self.clock() + delay
        self._set_state(RESTARTING)
        if reason != self._last_loss:  # a drafter refusing every attempt the same way is logged once
            self.logger.warning("Saguaro: the remote drafter at %s %s; reconnecting (in %.1f s, then at most every "
                                "%.0f s); steps go on without drafts", self.remote, reason, delay,
                                RECONNECT_MAX_BACKOFF_S)
        self._last_loss = reason

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return super().wait_ready(READY_WAIT_S if timeout_s is None else timeout_s)

    # ---- steps: q into the proposer's ring ----------------------------------------------------------------------
    def step(self, req: StepRequest) -> StepResponse:
        resp = super().step(req)
        if resp.probs:
            try:
                self._land(resp)
            except Exception as err:  # a bug here must cost drafts, not the request
                self.logger.exception("Saguaro: could not take the remote drafter's probabilities")
                raise self._unavailable("client_error", str(err), delivered=True) from None
        return resp

    def _land(self, resp: StepResponse) -> None:
        """Copy the reply's q arrays into a slot of the proposer's ring and name it in the reply, as a local
        drafter's reply names the slot it wrote. Without a slot (none free, or no ring) those rows lose their
        drafts this step (exact: decoded without speculation)."""
        rows = list(resp.probs)
        slot = self.ring.acquire(resp.step) if self.ring is not None and len(rows) <= self.ring.rows else None
        if slot is None:
            for j in rows:
                resp.drafts[j] = []
            resp.probs = {}
            return
        buf = self.ring.slot(slot).numpy()
        for r, j in enumerate(rows):
            q = resp.probs[j]
            np.copyto(buf[r, : q.shape[0]], q)
        self.ring.publish(slot)
        resp.probs_slot, resp.probs_rows, resp.probs = slot, rows, {}

