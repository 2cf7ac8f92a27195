"""Counting device-to-host transfers (test helper, not a test).

On a GPU every `.item()`, `.tolist()`, `int(t)`, `bool(t)`, `float(t)`, `.cpu()` or `.numpy()` of a device
tensor waits for the device: a host synchronisation. The drafter runs on CPU here, where they cost nothing,
but the same calls happen: `CountTransfers` (a `TorchFunctionMode`) counts them on every tensor, with the
source line of each, so a test can bound them per forward as a GPU would pay them.
"""
from __future__ import annotations

import collections
import traceback

import torch

from torch.overrides import TorchFunctionMode

TRANSFERS = frozenset({"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"})
#: calls whose output size depends on the data: on a GPU the host waits for the device to learn it
DATA_DEPENDENT = frozenset({"nonzero", "masked_select", "unique", "argwhere", "nonzero_static"})


class CountTransfers(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.total = 0
        self.where: collections.Counter = collections.Counter()
        self.data_dependent = 0  # `DATA_DEPENDENT` calls (also host waits on a GPU; counted apart)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in DATA_DEPENDENT or (name == "__getitem__" and any(
                getattr(a, "dtype", None) is torch.bool for a in _flat(args[1:]))):
            self.data_dependent += 1
        if name in TRANSFERS:
            self.total += 1
            frame = next((f for f in reversed(traceback.extract_stack(limit=8)[:-1])
                          if "saguaro_vllm" in f.filename), None)
            self.where[f"{frame.filename.rsplit('saguaro_vllm/', 1)[-1]}:{frame.lineno}" if frame else "?"] += 1
        return func(*args, **(kwargs or {}))


def _flat(items):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flat(item)
        else:
            yield item
