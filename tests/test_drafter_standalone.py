"""The drafter without vLLM, pyzmq, msgspec or pydantic (a GPU machine with torch alone, the GPU check's
setting): in a subprocess where importing any of them raises ImportError, `SSDDrafter` rounds run on a random
draft (tests/device_rounds.py), hit and miss, and none of those packages got imported."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("vllm", "zmq", "msgspec", "pydantic")

SCRIPT = """
import importlib.abc, json, sys
BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked for this test: {{name}}")

sys.meta_path.insert(0, Blocker())
for name in BLOCKED:
    sys.modules.pop(name, None)
sys.path.insert(0, {tests!r})
import torch
import device_rounds
from saguaro_vllm.shared import transport
from saguaro_vllm.drafter import server  # the drafter process's module imports too (its socket needs pyzmq)

model = device_rounds.make_model("smoke", torch.float32, "cpu")
rows = [device_rounds.run_config(model, batch, 8, rounds=2, num_blocks=512) for batch in (1, 3)]
try:
    transport.Channel("ipc:///tmp/none", bind=True, accepts=transport.ToDrafter)
    channel = "opened"
except ImportError as exc:
    channel = str(exc)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({{"rows": rows, "loaded": loaded, "channel": channel,
                   "structs": transport.msgspec.__name__}}))
"""


def test_drafter_rounds_run_without_vllm_zmq_msgspec_pydantic():
    code = SCRIPT.format(blocked=BLOCKED, tests=str(ROOT / "tests"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    assert out["structs"] == "saguaro_vllm.shared.plain_structs"  # transport fell back to the plain structs
    assert "pyzmq is not installed" in out["channel"]
    for row in out["rows"]:
        assert row["hits"] == row["batch"] and row["jit_misses"] == row["batch"], row
        assert row["branch_steps"] > 0 and row["glue_ms"] and row["branch_step_ms"] and row["jit_ms"], row
        assert sum(row["fanout"]) > 0 and row["planned_budget"] == 8, row


def test_plain_structs_behave_like_the_messages():
    from saguaro_vllm.shared import plain_structs

    class Spec(plain_structs.Struct, frozen=True):
        temperature: float = 0.0
        top_k: int = 0

    class Reply(plain_structs.Struct, tag="reply"):
        step: int
        resync: list = []

    a, b = Reply(1), Reply(step=1)
    a.resync.append("x")
    assert b.resync == [] and a != b and Reply(2, ["y"]).resync == ["y"]
    assert Spec(0.5) == Spec(temperature=0.5) and hash(Spec()) == hash(Spec())
    try:
        Spec().top_k = 3
        raise AssertionError("frozen")
    except AttributeError:
        pass
    for bad in (lambda: Reply(), lambda: Reply(1, [], 3), lambda: Reply(1, nope=2)):
        try:
            bad()
            raise AssertionError("accepted a bad constructor call")
        except TypeError:
            pass
    try:
        plain_structs.msgpack.Encoder().encode(a)
        raise AssertionError("encoded without msgspec")
    except plain_structs.MissingMsgspec as exc:
        assert "msgspec is not installed" in str(exc)
