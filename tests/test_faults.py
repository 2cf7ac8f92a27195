"""Drafter faults through a running `vllm serve`: SIGKILL, SIGSTOP (a hang, never continued) and a drafter
that raises inside its steps, each injected while 8 greedy streams are in flight (`serve_faults.py`, run on
the shared servers of `serve_cases.py` before their request cases, with nothing else running).

Each test passes only if every request of the faulty batch completed with the plain server's greedy output,
the fault cost at most one bounded wait (no stream waited MAX_GAP_S for a chunk, the batch took at most
SLACK_S longer than the healthy one before it), `/metrics` counted the failed steps and exactly the expected
restarts, the faulty drafter process is gone, and drafts and accepted tokens grew again after recovery.
"""
from __future__ import annotations

import pytest

from serve_faults import FAULTS

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(("fault", "mode"), [(f, m) for f, m, _ in FAULTS], ids=[f"{f}-{m}" for f, m, _ in FAULTS])
def test_fault_mid_batch(served, fault, mode):
    result = served["faults"][f"{fault}-{mode}"]
    assert "error" not in result, result["error"]
    print(f"[faults] {fault} ({mode}): {result['figures']}")  # the assertions ran in serve_faults.check_fault
