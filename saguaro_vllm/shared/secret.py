"""The shared secret of a remote drafter and the CurveZMQ keys both ends derive from it.

A drafter on another host (`saguaro-vllm drafter --listen tcp://...`) and the workers that connect to it
(`saguaro.drafter_endpoint`) hold the same secret: from a file (`saguaro.drafter_secret_file` / the drafter's
`--secret-file`) that only its owner may read, or from the `SAGUARO_DRAFTER_SECRET` environment variable. No
key ever travels: each end derives a CURVE key pair per role from the secret (HMAC-SHA256 of the secret and
the role's name as the 32-byte Curve25519 secret key), so a worker knows the drafter's public key and the
drafter admits exactly the worker key the secret gives. CurveZMQ then encrypts and authenticates every
frame with per-connection short-term keys and nonces: a tampered frame drops the connection, a replayed
one is refused (tests/test_remote_auth.py). Both the front end and the drafter import this; no vLLM import.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

SECRET_ENV = "SAGUARO_DRAFTER_SECRET"
#: A shorter secret is refused: 16 bytes is the floor for a key someone could otherwise guess offline.
MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """No usable secret; the message names where it was looked for and the fix."""


def read_secret(path: str | None, field: str = "saguaro.drafter_secret_file") -> bytes:
    """The secret from `path` (a file only its owner may read or write), else from `SAGUARO_DRAFTER_SECRET`.
    Surrounding whitespace (a trailing newline) is not part of it. `field` names the option in errors."""
    if path:
        path = os.path.expanduser(path)
        try:
            st = os.stat(path)
        except OSError as err:
            raise SecretError(f"{field}: cannot read {path!r} ({err.strerror}); give the path of a file holding "
                              f"the secret (e.g. `head -c 32 /dev/urandom | base64 > {path}; chmod 600 {path}`)") from None
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{field}: {path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(f"{field}: {path!r} is readable or writable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`")
        with open(path, "rb") as f:
            secret, where = f.read().strip(), path
    else:
        secret, where = os.environ.get(SECRET_ENV, "").strip().encode(), f"${SECRET_ENV}"
        if not secret:
            raise SecretError(f"{field}: a remote drafter needs a shared secret: set {field} to a file holding it "
                              f"(mode 600) or set the environment variable {SECRET_ENV}, the same on both hosts")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{field}: the secret in {where} has {len(secret)} bytes, at least {MIN_SECRET_BYTES} are "
                          "needed (e.g. `head -c 32 /dev/urandom | base64`)")
    return secret


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE keys of one end: its own pair and the other end's public key."""

    public: bytes
    secret: bytes
    peer_public: bytes


def _pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    import zmq
    from zmq.utils import z85

    seed = hmac.new(secret, b"saguaro-vllm drafter link v1 " + role, hashlib.sha256).digest()
    secret_z85 = z85.encode(seed)
    return zmq.curve_public(secret_z85), secret_z85


def curve_keys(secret: bytes, server: bool) -> CurveKeys:
    """The drafter's (`server`) or a worker's CURVE keys, derived from the shared secret."""
    server_pub, server_sec = _pair(secret, b"drafter")
    client_pub, client_sec = _pair(secret, b"worker")
    if server:
        return CurveKeys(server_pub, server_sec, client_pub)
    return CurveKeys(client_pub, client_sec, server_pub)


def curve_supported() -> bool:
    import zmq

    return bool(zmq.has("curve"))
