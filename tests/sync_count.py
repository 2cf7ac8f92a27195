"""Counting device-to-host transfers (test helper, not a test).

On a GPU every `.item()`, `.tolist()`, `int(t)`, `bool(t)`, `float(t)`, `.cpu()` or `.numpy()` of a device
tensor waits for the device: a host synchronisation. The drafter runs on CPU here, where they cost nothing,
but the same calls happen: `CountTransfers` (a `TorchFunctionMode`) counts them on every tensor, with the
source line of each, so a test can bound them per forward as a GPU would pay them.
"""
from __future__ import annotations

import collections
import traceback

from torch.overrides import TorchFunctionMode

TRANSFERS = frozenset({"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"})


class CountTransfers(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.total = 0
        self.where: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in TRANSFERS:
            self.total += 1
            frame = next((f for f in reversed(traceback.extract_stack(limit=8)[:-1])
                          if "saguaro_vllm" in f.filename), None)
            self.where[f"{frame.filename.rsplit('saguaro_vllm/', 1)[-1]}:{frame.lineno}" if frame else "?"] += 1
        return func(*args, **(kwargs or {}))
