"""The Triton branch-attention kernel against the plain-torch reference, on CPU through Triton's interpreter
(`TRITON_INTERPRET=1`, set in a subprocess so it cannot leak into other tests or engine processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
# (batch, branches, prefix lengths, block size, K, heads, kv heads, head size, dtype, non-contiguous)
CASES = [
    (1, 1, [1], 16, 1, 4, 4, 64, "float32", False),
    (3, 7, [19, 1, 257], 32, 5, 8, 2, 64, "float16", False),
    (2, 5, [40, 3], 16, 3, 8, 2, 64, "bfloat16", False),
    (1, 7, [1000], 16, 3, 8, 2, 64, "float32", False),
    (16, 1, [19, 257], 32, 2, 4, 2, 128, "float32", False),
    (3, 7, [19, 257, 1], 16, 4, 8, 2, 64, "float32", True),
]
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

SCRIPT = r"""
import json, sys, torch
from test_ops_branch_attention import make_case
from saguaro_vllm.ops import reference
from saguaro_vllm.ops.triton_attention import branch_attention
out = []
for i, (b, m, pre, bs, k, h, hkv, d, dtype, nc) in enumerate(json.loads(sys.argv[1])):
    args = make_case(b, m, pre, bs, k, h, hkv, d, getattr(torch, dtype), "cpu", seed=i, noncontig=nc)
    got = branch_attention(**args).float()
    ref = reference.branch_attention(**args).float()
    err = ((got - ref).abs() / (1 + ref.abs())).max().item()
    out.append({"err": err, "shape_ok": got.shape == args["query"].shape, "finite": bool(got.isfinite().all())})
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i][:2] + CASES[i][8:])))
def test_triton_branch_attention_matches_reference(results, index):
    r = results[index]
    assert r["shape_ok"] and r["finite"]
    assert r["err"] <= TOL[CASES[index][8]], r
