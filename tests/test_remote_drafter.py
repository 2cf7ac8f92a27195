"""A drafter on another host (`saguaro.drafter_endpoint`), played over 127.0.0.1 by `saguaro-vllm drafter`.

Two engines in all: a plain one (the reference) and one Saguaro engine (`mode: async`) whose drafter is
remote, running five jobs in a row while the test stops and starts remote drafters between them
(`Job.before`):

1. greedy: the plain engine's tokens, with drafts proposed and accepted through the remote drafter;
2. t1: temperature 1, 1500 samples of one prompt: the plain engine's distribution (chi-square, the same
   harness as test_saguaro_distribution.py), with drafts accepted (sampled rows' q crossed the link);
3. killed: the drafter SIGKILLed before the job: every request completes with the plain engine's tokens;
4. wrong secret: a drafter with another secret on the same port: refused in the handshake (the worker's log
   and the drafter's say so), no drafts, the plain engine's tokens;
5. restarted: a drafter with the right secret again: the worker reconnects and drafts are accepted again.
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import numpy as np
import pytest

import remote_drafters
from distribution import ENGINE_DEFAULTS, EXACT_P, PROMPT, build_tiny_pair, compare
from engine_runs import Job, run_engine

N = 1500  # samples of the T=1 check: enough for a 24-token vocabulary's positions 1-4 (min_count 10)
GREEDY = [[1, 7, 3, 12, 5], [4, 4, 9, 2], [11, 3, 8, 8, 1, 6], [2, 19, 5], [7, 7, 7, 1], [13, 2, 6, 9, 10]]
GREEDY_PARAMS = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
T1 = Job("t1", [list(PROMPT)] * N, {"temperature": 1.0, "max_tokens": 5, "ignore_eos": True})
CONTROL = [sys.executable, str(Path(remote_drafters.__file__).resolve())]
#: Longer than the reconnect backoff's cap (remote_client.RECONNECT_MAX_BACKOFF_S) and ZeroMQ's connect retry
#: (transport.RECONNECT_IVL_MAX_MS): by the next job the worker has tried the new drafter (in ZeroMQ's I/O
#: thread while the engine idles) or reconnects at its first step.
BACKOFF_WAIT_S = "6"


def _then(*commands: list[str]) -> list[str]:
    """One command running `commands` in turn (a job has one `before`)."""
    return ["sh", "-c", " && ".join(" ".join(c) for c in commands)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _secret(path: Path, text: bytes) -> str:
    path.write_bytes(text)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    target, draft = build_tiny_pair(root / "pair")
    return {"root": root, "target": str(target), "draft": str(draft), "port": _free_port(),
            "secret": _secret(root / "secret", b"the-shared-secret-of-this-test-0"),
            "wrong": _secret(root / "wrong", b"another-secret-not-the-workers-1")}


@pytest.fixture(scope="module")
def plain(setup):
    return run_engine(setup["target"], [Job("greedy", GREEDY, GREEDY_PARAMS), T1],
                      engine_kwargs={**ENGINE_DEFAULTS, "seed": 0})


@pytest.fixture(scope="module")
def remote(setup):
    root, port, draft = setup["root"], str(setup["port"]), setup["draft"]
    pidfile = str(root / "drafter.pid")
    logs = {name: root / f"drafter-{name}.log" for name in ("first", "wrong", "restarted")}
    start = lambda name, secret: CONTROL + ["start", pidfile, str(logs[name]), port, secret, draft]  # noqa: E731
    remote_drafters.start(pidfile, str(logs["first"]), setup["port"], setup["secret"], draft)
    spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3,
            "saguaro": {"mode": "async", "drafter_endpoint": f"tcp://127.0.0.1:{port}",
                        "drafter_secret_file": setup["secret"], "target_cores": [0]}}
    jobs = [Job("greedy", GREEDY, GREEDY_PARAMS), T1,
            Job("killed", GREEDY, GREEDY_PARAMS, sequential=True, before=CONTROL + ["kill", pidfile]),
            Job("wrong", GREEDY, GREEDY_PARAMS, sequential=True,
                before=_then(start("wrong", setup["wrong"]), CONTROL + ["sleep", BACKOFF_WAIT_S])),
            Job("restarted", GREEDY + GREEDY, GREEDY_PARAMS, sequential=True,
                before=_then(CONTROL + ["kill", pidfile], start("restarted", setup["secret"]),
                             CONTROL + ["sleep", BACKOFF_WAIT_S]))]
    engine_log = root / "engine.log"
    try:
        runs = run_engine(setup["target"], jobs, speculative_config=spec,
                          engine_kwargs={**ENGINE_DEFAULTS, "seed": 1}, log_path=engine_log)
    finally:
        remote_drafters.kill(pidfile)
    return {"runs": runs, "log": engine_log.read_text(), **{n: p.read_text() for n, p in logs.items()}}


def test_greedy_through_the_remote_drafter_equals_plain_vllm(plain, remote):
    run = remote["runs"]["greedy"]
    assert run.token_ids == plain["greedy"].token_ids
    assert run.spec.draft_tokens > 0 and run.spec.accepted > 0
    assert "connecting to the remote drafter at tcp://127.0.0.1" in remote["log"]
    assert "'remote': True" in remote["log"]  # the Ready line: the drafts came from the remote drafter
    assert "a worker connected" in remote["first"]


def test_sampled_rows_keep_the_target_distribution(plain, remote):
    run = remote["runs"]["t1"]
    pvalues = compare(np.asarray(plain["t1"].token_ids), np.asarray(run.token_ids))
    assert min(pvalues.values()) > EXACT_P, pvalues
    assert run.spec.accepted > 0  # sampled drafts were verified: their q crossed the link


def test_a_killed_remote_drafter_costs_drafts_only(plain, remote):
    assert remote["runs"]["killed"].token_ids == plain["greedy"].token_ids
    assert "closed the connection" in remote["log"]


def test_a_drafter_with_another_secret_is_refused(plain, remote):
    run = remote["runs"]["wrong"]
    assert run.token_ids == plain["greedy"].token_ids
    assert run.spec.draft_tokens == 0
    assert "refused the connection in the CURVE handshake: its secret differs" in remote["log"]
    assert "refused a connection: its CURVE handshake failed" in remote["wrong"]
    assert "a worker connected" not in remote["wrong"]


def test_a_restarted_remote_drafter_is_reconnected(plain, remote):
    run = remote["runs"]["restarted"]
    assert run.token_ids == plain["greedy"].token_ids * 2
    assert run.spec.accepted > 0
    assert "a worker connected" in remote["restarted"]
