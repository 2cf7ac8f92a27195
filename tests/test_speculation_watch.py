"""`SpeculationWatch` and its log line: a drafter that answers every step without drafts is reported once
when it stalls and once when it resumes, never per step."""
from __future__ import annotations

import logging

import pytest

from saguaro_vllm.worker.metrics import SaguaroMetrics
from saguaro_vllm.worker.speculation_watch import SpeculationWatch


def test_stalls_once_below_the_share_and_resumes_once_above_the_other():
    watch = SpeculationWatch(window=8, min_rows=16, stall_share=0.1, resume_share=0.3)
    changes = [watch.observe(4, 4) for _ in range(8)]
    assert changes == [None] * 8 and not watch.stalled
    changes = [watch.observe(4, 0, ["ngram"] * 4) for _ in range(8)]
    assert changes.count("stalled") == 1 and watch.stalled
    assert changes.index("stalled") == 7  # 4 of 32 rows drafted (12.5 %) is not yet below 10 %; 0 of 32 is
    assert watch.reasons() == {"ngram": 32}
    # a trickle of drafts (25 % < 30 %) keeps it stalled: no flapping
    assert [watch.observe(4, 1, ["none"] * 3) for _ in range(8)] == [None] * 8 and watch.stalled
    changes = [watch.observe(4, 4) for _ in range(8)]
    assert changes.count("resumed") == 1 and not watch.stalled


def test_needs_enough_rows_before_judging():
    watch = SpeculationWatch(window=64, min_rows=64)
    assert [watch.observe(1, 0, ["ngram"]) for _ in range(63)] == [None] * 63
    assert watch.observe(1, 0, ["ngram"]) == "stalled"


@pytest.mark.parametrize("bad", [(2, 3), (1, -1)])
def test_rejects_impossible_counts(bad):
    with pytest.raises(ValueError):
        SpeculationWatch().observe(*bad)


def test_metrics_log_one_line_per_change(caplog):
    logger = logging.getLogger("test.saguaro.watch")
    metrics = SaguaroMetrics({"saguaro": {"log_interval_s": 0}}, logger)
    with caplog.at_level(logging.INFO, logger="test.saguaro.watch"):
        for _ in range(100):
            metrics.on_step(0.01, 0.001, 2, 0, row_status=["ngram", "new"], drafted_rows=[False, False])
        for _ in range(100):
            metrics.on_step(0.01, 0.001, 2, 8, row_status=["hit", "jit"], drafted_rows=[True, True])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("Saguaro: speculation stalled: 0 of 64 rows got drafts") and "ngram 32" in lines[0]
    assert lines[1].startswith("Saguaro: speculation resumed")
    snap = metrics.snapshot()
    assert snap["speculating"] and snap["rows_undrafted"] == 200
