"""The remote drafter's link without any model or engine: the shared secret (file, environment, refused when
missing, short or readable by others), the CURVE keys derived from it, and the link's guarantees over
127.0.0.1: the right secret connects and carries typed messages; another secret, or a key that is not the
secret's, is refused in the handshake and delivers nothing; a byte tampered with after the handshake drops
the connection without delivering the message; a recorded session replayed on a new connection delivers
nothing. The tampering and the replay go through a TCP relay in this file that forwards bytes as they are."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from saguaro_vllm.shared import secret as sec
from saguaro_vllm.shared.secret import CurveKeys, SecretError, curve_keys, read_secret
from saguaro_vllm.shared.transport import Channel, Hello, Ready, ToProposer, ToRemoteDrafter, tcp_endpoint

SECRET = b"s3cret-shared-by-both-hosts-0123"
OTHER = b"another-secret-of-32-bytes-45678"


# ---- the secret -----------------------------------------------------------------------------------------------
def test_secret_from_a_private_file_and_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    assert read_secret(str(path)) == SECRET
    monkeypatch.setenv(sec.SECRET_ENV, SECRET.decode())
    assert read_secret(None) == SECRET


def test_secret_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(sec.SECRET_ENV, raising=False)
    with pytest.raises(SecretError, match="saguaro.drafter_secret_file: a remote drafter needs a shared secret.*"
                                          "SAGUARO_DRAFTER_SECRET"):
        read_secret(None)
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o644)
    with pytest.raises(SecretError, match=r"readable or writable by others \(mode 644\); run `chmod 600"):
        read_secret(str(path))
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(SecretError, match="has 5 bytes, at least 16"):
        read_secret(str(path))
    with pytest.raises(SecretError, match="cannot read"):
        read_secret(str(tmp_path / "missing"))


def test_keys_pair_up_only_for_the_same_secret():
    drafter, worker = curve_keys(SECRET, server=True), curve_keys(SECRET, server=False)
    assert drafter.peer_public == worker.public and worker.peer_public == drafter.public
    assert zmq.curve_public(drafter.secret) == drafter.public
    assert curve_keys(OTHER, server=False).public != worker.public


def test_endpoint_form():
    assert tcp_endpoint("tcp://10.0.0.5:5601") == ("10.0.0.5", 5601)
    assert tcp_endpoint("tcp://drafter-1.internal:80") == ("drafter-1.internal", 80)
    for bad in ("ipc:///tmp/x", "tcp://host", "tcp://host:0", "tcp://host:70000", "http://h:1"):
        with pytest.raises(ValueError, match="saguaro.drafter_endpoint: .* is not a tcp://HOST:PORT"):
            tcp_endpoint(bad)


# ---- the link -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zap():
    """The ZAP handler the remote drafter runs (one per process: ZeroMQ has one ZAP endpoint per context)."""
    from saguaro_vllm.drafter.remote_server import _authenticator

    keys = curve_keys(SECRET, server=True)
    chan = Channel("tcp://127.0.0.1:*", bind=True, accepts=ToRemoteDrafter, curve=keys)
    auth = _authenticator(chan.ctx, keys.peer_public)
    chan.close()
    yield
    auth.stop()


@pytest.fixture
def drafter_end(zap):
    """A drafter's end: the bound CURVE server socket, on a free port, closed after each test (as the drafter
    closes it after a message failed authentication: libzmq leaves that connection stuck)."""
    chan = Channel("tcp://127.0.0.1:*", bind=True, accepts=ToRemoteDrafter, curve=curve_keys(SECRET, server=True))
    yield int(chan.sock.last_endpoint.decode().rsplit(":", 1)[1]), chan
    chan.close()


def _hello() -> Hello:
    return Hello("abc", 24, 3, None, 0, {"mode": "sync"})


def _wait_events(chan: Channel, want: set[int], timeout_s: float = 5.0) -> list[int]:
    seen: list[int] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not want & set(seen):
        seen += chan.events()
        time.sleep(0.02)
    return seen


def test_the_secret_connects_and_carries_messages(drafter_end):
    port, drafter = drafter_end
    worker = Channel(f"tcp://127.0.0.1:{port}", bind=False, accepts=ToProposer, curve=curve_keys(SECRET, False))
    try:
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED in _wait_events(worker, {zmq.EVENT_HANDSHAKE_SUCCEEDED})
        assert worker.send(_hello())
        assert drafter.recv(timeout_s=5) == _hello()
        assert drafter.send(Ready(1, {}, session="abc"))
        assert worker.recv(timeout_s=5).session == "abc"
    finally:
        worker.close()


@pytest.mark.parametrize("who", ["another secret", "a key that is not the secret's"])
def test_a_worker_without_the_secret_is_refused(drafter_end, who):
    port, drafter = drafter_end
    if who == "another secret":
        keys = curve_keys(OTHER, server=False)
        refused = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}
    else:  # knows the drafter's public key, not the secret: the ZAP handler refuses its key
        public, secret_key = zmq.curve_keypair()
        keys = CurveKeys(public, secret_key, curve_keys(SECRET, server=False).peer_public)
        refused = {zmq.EVENT_HANDSHAKE_FAILED_AUTH}
    worker = Channel(f"tcp://127.0.0.1:{port}", bind=False, accepts=ToProposer, curve=keys)
    try:
        seen = _wait_events(worker, refused)
        assert refused & set(seen) and zmq.EVENT_HANDSHAKE_SUCCEEDED not in seen
        assert not worker.send(_hello())  # never connected: nothing queued for the drafter
        assert drafter.recv(timeout_s=0.5) is None
    finally:
        worker.close()


class Relay:
    """A TCP relay from a local port to the drafter's, forwarding bytes as they come; `tamper` flips one
    byte of the next worker-to-drafter chunk, `recorded` keeps every worker-to-drafter byte."""

    def __init__(self, port: int):
        self.target, self.tamper, self.recorded = port, False, bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        up = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(conn, up, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(up, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_worker: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_worker:
                    if self.tamper:
                        data, self.tamper = data[:-1] + bytes([data[-1] ^ 0x01]), False
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _through(relay: Relay) -> Channel:
    worker = Channel(f"tcp://127.0.0.1:{relay.port}", bind=False, accepts=ToProposer, curve=curve_keys(SECRET, False))
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED in _wait_events(worker, {zmq.EVENT_HANDSHAKE_SUCCEEDED})
    return worker


def test_a_tampered_message_is_not_delivered(drafter_end):
    port, drafter = drafter_end
    relay = Relay(port)
    worker = _through(relay)
    try:
        relay.tamper = True
        assert worker.send(_hello())
        assert drafter.recv(timeout_s=1.0) is None
        # the drafter's CURVE layer found the message's authenticator wrong and dropped it
        assert zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in _wait_events(drafter, {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL})
    finally:
        worker.close()


def test_a_replayed_session_is_not_delivered(drafter_end):
    port, drafter = drafter_end
    relay = Relay(port)
    worker = _through(relay)
    assert worker.send(_hello())
    assert drafter.recv(timeout_s=5) == _hello()
    time.sleep(0.2)
    worker.close()
    recorded = bytes(relay.recorded)
    assert len(recorded) > 200  # the greeting, the handshake and the message
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(recorded)
        time.sleep(0.5)
        assert drafter.recv(timeout_s=1.0) is None


def test_no_tcp_link_without_keys():
    with pytest.raises(ValueError, match="needs CURVE keys"):
        Channel("tcp://127.0.0.1:*", bind=True, accepts=ToRemoteDrafter)
