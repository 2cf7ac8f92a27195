"""Drafter faults through a running `vllm serve`: SIGKILL, SIGSTOP (a hang, never continued) and a drafter
that raises inside its steps, each injected while 8 greedy streams are in flight (`serve_faults.py`, run on
the shared servers of `serve_cases.py` before their request cases, with nothing else running).

Each test passes only if every request of the faulty batch completed with the plain server's greedy output,
the fault cost at most one bounded wait (no stream waited MAX_GAP_S for a chunk, the batch took at most
SLACK_S longer than the healthy one before it), `/metrics` counted the failed steps and exactly the expected
restarts, the faulty drafter process is gone, and drafts and accepted tokens grew again after recovery.

Then a quiet stop: the same servers stopped as a user stops `vllm serve` (`serve_stop.py`) exit, log no
traceback from our code (a KeyboardInterrupt in the drafter's ZeroMQ poll, on Ctrl-C, would be one) and
leave no drafter behind.
"""
from __future__ import annotations

import pytest

from serve_faults import FAULTS
from serve_stop import EXIT_WAIT_S, STOPS, our_traceback_lines

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(("fault", "mode"), [(f, m) for f, m, _ in FAULTS], ids=[f"{f}-{m}" for f, m, _ in FAULTS])
def test_fault_mid_batch(served, fault, mode):
    result = served["faults"][f"{fault}-{mode}"]
    assert "error" not in result, result["error"]
    print(f"[faults] {fault} ({mode}): {result['figures']}")  # the assertions ran in serve_faults.check_fault


@pytest.mark.parametrize("mode", sorted(STOPS))
def test_stop_is_quiet(served, mode):
    """The sync server gets SIGTERM (`kill PID`), the async one SIGINT on its whole process group (Ctrl-C):
    vllm serve exits, its log from the signal on has no traceback from our code (the drafter's, mostly), and
    every drafter is gone."""
    stop = served["stops"][mode]
    assert "error" not in stop, stop["error"]
    how = f"{stop['signal']} to the {'process group' if stop['group'] else 'server process'}"
    assert stop["drafters"], "no drafter process was running when the server was stopped"
    assert stop["exit_code"] is not None, f"vllm serve did not exit within {EXIT_WAIT_S:.0f} s of {how}"
    ours = our_traceback_lines(stop["log"])
    assert not ours, f"a traceback of ours in the log after {how}: {ours}\n{stop['log'][-8000:]}"
    assert not stop["survivors"], f"drafter(s) {stop['survivors']} outlived the server after {how}"
    print(f"[stop] {how}: exit code {stop['exit_code']}, drafters {stop['drafters']} gone "
          f"{stop['seconds']} s after the signal")
