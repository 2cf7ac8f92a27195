"""The glue's rule (`predraft.glue_rows`) and how the glue is split into parts (`predraft._parts`): pure."""
import pytest

from saguaro_vllm.drafter.predraft import _parts, glue_rows


@pytest.mark.parametrize("done, seq_len, k, kept, expected", [
    (19, 20, 5, 5, (5, 1, False)),   # drafts drafted here, their depth distributions kept: x_K's row only
    (19, 20, 5, 6, (6, 0, False)),   # K + 1 kept (drafted past x_K): x_K fed for its KV, no logit row
    (19, 20, 5, 3, (0, 6, True)),    # fewer kept than drafts: every depth recomputed from the context
    (14, 20, 5, 0, (0, 6, False)),   # after an n-gram backup: the drafts' rows come from this forward
    (10, 20, 5, 5, (0, 6, False)),   # KV short of the drafts: kept distributions do not line up, recomputed
    (17, 20, 5, 0, (0, 6, True)),    # only the last three uncomputed and nothing kept: recompute all
    (19, 20, 0, 0, (0, 1, False)),   # a round of zero drafts: the bonus distribution alone
])
def test_glue_rows(done, seq_len, k, kept, expected):
    have, need, recompute = glue_rows(done, seq_len, k, kept)
    assert (have, need, recompute) == expected
    assert have + need == k + 1  # every depth's distribution, kept or computed


@pytest.mark.parametrize("sizes, cap, expected", [
    ([1, 1, 1], 3, [[0, 1, 2]]),
    ([6, 6, 1], 6, [[0], [1], [2]]),
    ([6, 1, 1, 6], 8, [[0, 1, 2], [3]]),
    ([], 4, []),
])
def test_parts_hold_at_most_cap_rows(sizes, cap, expected):
    parts = _parts(sizes, cap)
    assert parts == expected
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
