"""The remote drafter's client and the drafter's link-side pieces, without a model or an engine: the config
refusals, the worker's clock on the drafter's (`ClockMap`), q from the drafter's private ring through the
codec and the checks into the proposer's ring, and the client's states against a peer on 127.0.0.1 that
speaks the drafter's protocol (this test answers Hello and steps itself): ready after the handshake, no
drafts and a new generation when the drafter goes, back after it listens again, a drafter with another
secret refused with one log line."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from saguaro_vllm.drafter.remote_server import ClockMap, inline_probs
from saguaro_vllm.frontend.config import SaguaroConfigError, parse_speculative_config
from saguaro_vllm.shared.proposal_buffers import ProposalRing, SlotWriter
from saguaro_vllm.shared.secret import curve_keys
from saguaro_vllm.shared.transport import (Channel, Hello, Ready, RowUpdate, SamplingSpec, StepRequest,
                                           StepResponse, ToProposer, ToRemoteDrafter, _Codec, check_response)
from saguaro_vllm.worker.drafter_states import READY, RESTARTING
from saguaro_vllm.worker.metrics import SaguaroMetrics
from saguaro_vllm.worker.remote_client import RemoteDrafterClient

SECRET = b"client-test-secret-0123456789abc"
VOCAB, K = 50, 3


def _spec(**saguaro):
    return {"method": "saguaro", "model": "m", "num_speculative_tokens": K, "saguaro": saguaro}


def test_config_refuses_bad_remote_input_naming_the_field():
    with pytest.raises(SaguaroConfigError, match=r"saguaro\.drafter_endpoint: must be a tcp://HOST:PORT"):
        parse_speculative_config(_spec(drafter_endpoint="ipc:///tmp/d"))
    with pytest.raises(SaguaroConfigError, match=r"saguaro\.kv_cache_gb: configures the drafter process.*"
                                                 r"saguaro-vllm drafter --saguaro"):
        parse_speculative_config(_spec(drafter_endpoint="tcp://h:5601", kv_cache_gb=2.0))
    with pytest.raises(SaguaroConfigError, match=r"saguaro\.drafter_secret_file: only used with"):
        parse_speculative_config(_spec(drafter_secret_file="/x"))
    assert parse_speculative_config(_spec(drafter_endpoint="tcp://h:5601"))[0].saguaro.drafter_endpoint


def test_clock_map_takes_the_smallest_gap():
    clock = ClockMap()
    assert clock.local(100.0, 5100.002) == pytest.approx(5100.002)  # offset 5000, 2 ms in transit
    assert clock.local(101.0, 5101.5) == pytest.approx(5101.002)  # waited for a forward: not the offset
    assert clock.local(0.0, 7000.0) == 0.0  # unknown stays unknown


def _cfg(tmp_path, port: int) -> dict:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return {"vocab_size": VOCAB, "num_speculative_tokens": K, "max_model_len": None,
            "saguaro": {"mode": "sync", "drafter_endpoint": f"tcp://127.0.0.1:{port}",
                        "drafter_secret_file": str(secret), "step_timeout_s": 5.0, "startup_timeout_s": 5.0,
                        "step_deadline_floor_s": 0.5, "log_interval_s": 0}}


def _client(cfg, ring=None, logger=None) -> RemoteDrafterClient:
    logger = logger or logging.getLogger("test.remote_client")
    return RemoteDrafterClient(cfg, logger, metrics=SaguaroMetrics(cfg, logger), ring=ring)


def _request(step: int) -> StepRequest:
    rows = [RowUpdate("greedy", 0, [1, 2], K, SamplingSpec()),
            RowUpdate("sampled", 0, [3, 4], K, SamplingSpec(temperature=1.0))]
    return StepRequest(step, rows, [])


def test_q_crosses_from_the_drafter_ring_into_the_proposer_ring(tmp_path):
    """The drafter's slot rows as array frames (`inline_probs`), encoded and decoded by the real codec,
    checked against the request, copied into the proposer's ring (`_land`) exactly, and named there."""
    rng = np.random.default_rng(0)
    q = rng.random((2, VOCAB), dtype=np.float32)
    q /= q.sum(-1, keepdims=True)
    drafts = [[7, 8, 9], [int(q[0].argmax()), int(q[1].argmax())]]
    drafter_ring, proposer_ring = ProposalRing.create(4, K, VOCAB), ProposalRing.create(4, K, VOCAB)
    client = _client(_cfg(tmp_path, 1), ring=proposer_ring)
    try:
        writer = SlotWriter(drafter_ring, 7)
        writer.put(1, torch.from_numpy(q))
        slot, rows = writer.finish()
        resp = StepResponse(7, drafts, {}, 0.0, probs_slot=slot, probs_rows=rows)
        assert inline_probs(resp, drafter_ring) == slot and resp.probs_slot == -1
        got = _Codec(ToProposer).decode(_Codec(ToProposer).encode(resp))
        assert check_response(_request(7), got, VOCAB) is None
        client._land(got)
        assert got.probs == {} and got.probs_rows == [1] and proposer_ring.held(got.probs_slot, 7)
        assert np.array_equal(proposer_ring.slot(got.probs_slot).numpy()[0, :2], q)
        proposer_ring.release_held()
        proposer_ring.header[:, 0] = 2  # every slot held: nowhere to put q, so the sampled row loses its drafts
        again = _Codec(ToProposer).decode(_Codec(ToProposer).encode(
            StepResponse(8, drafts, {1: q}, 0.0)))
        client._land(again)
        assert again.drafts[1] == [] and again.drafts[0] == [7, 8, 9] and again.probs_slot == -1
    finally:
        client.close()
        drafter_ring.close()
        proposer_ring.close()


class Peer:
    """This test as the drafter, in a thread: a bound CURVE socket answering Hello with Ready and each step
    with K drafts of token 5 per row."""

    def __init__(self, port: int, secret: bytes = SECRET):
        import threading

        import zmq

        end = time.monotonic() + 5
        while True:  # the last peer's port is free once ZeroMQ's I/O thread closed it
            try:
                self.chan = Channel(f"tcp://127.0.0.1:{port}", bind=True, accepts=ToRemoteDrafter,
                                    curve=curve_keys(secret, server=True))
                break
            except zmq.ZMQError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            msg = self.chan.recv(timeout_s=0.02)
            if isinstance(msg, Hello):
                self.chan.send(Ready(123, {"remote": True}, session=msg.session))
            elif isinstance(msg, StepRequest):
                self.chan.send(StepResponse(msg.step, [[5] * r.num_drafts for r in msg.rows], {}, 0.0))

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.chan.close()


def _until(client: RemoteDrafterClient, state: str, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        client.poll()
        if client.state == state:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def zap():
    """The drafter's ZAP handler (one per process), admitting the worker key of SECRET."""
    from saguaro_vllm.drafter.remote_server import _authenticator

    import zmq

    auth = _authenticator(zmq.Context.instance(), curve_keys(SECRET, server=True).peer_public)
    yield
    auth.stop()


def test_client_connects_loses_and_reconnects(tmp_path, caplog, zap):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logger = logging.getLogger("test.remote_client.states")
    client = _client(_cfg(tmp_path, port), logger=logger)
    peer = Peer(port, secret=b"a-drafter-with-another-secret-00")
    try:
        with caplog.at_level(logging.WARNING, logger="test.remote_client.states"):
            assert _until(client, RESTARTING)
            restarts = client.restarts
            end = time.monotonic() + 10
            while client.restarts < restarts + 2 and time.monotonic() < end:  # refused twice more
                client.poll()
                time.sleep(0.01)
        refused = [r for r in caplog.records if "CURVE handshake: its secret differs" in r.getMessage()]
        assert client.restarts >= restarts + 2 and len(refused) == 1  # one line for the whole run
        peer.close()
        peer = Peer(port)
        assert _until(client, READY)
        generation = client.generation
        resp = client.step(StepRequest(1, [RowUpdate("r", 0, [1, 2], K, SamplingSpec())], []))
        assert resp.drafts == [[5] * K]
        peer.close()
        peer = None
        assert _until(client, RESTARTING) and client.generation == generation + 1
        peer = Peer(port)
        assert _until(client, READY)
        assert client.step(StepRequest(2, [RowUpdate("r", 0, [1, 2], K, SamplingSpec())], [])).drafts == [[5] * K]
    finally:
        client.close()
        if peer is not None:
            peer.close()
