"""Every sequence's block table as one row of a persistent host array, rewritten only when it changed.

A forward used to rebuild its `[rows, blocks]` table from nested Python lists (24 ms for 2048 branch rows x
128 blocks on CPU). Here each sequence of the runner owns a row of one int32 array; before a forward, a row
whose `BlockTable.blocks` differ from the copy it was last written from is rewritten (one list comparison per
row, a C-level loop), and the forward's table is one numpy gather of the rows it needs. Entries past a table's
last block are 0, the padding the attention kernels expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from saguaro_vllm.drafter.kv_cache import BlockTable


class BlockRows:
    def __init__(self, rows: int = 64, width: int = 64):
        self.array = np.zeros((rows, width), dtype=np.int32)
        self._free = list(range(rows - 1, -1, -1))
        self._written: dict[int, list[int]] = {}  # row -> the blocks it holds

    def acquire(self) -> int:
        """A zeroed row for a new sequence."""
        if not self._free:
            old = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self._written[row] = []
        return row

    def release(self, row: int) -> None:
        self.array[row, : len(self._written.pop(row))] = 0
        self._free.append(row)

    def release_many(self, rows: Sequence[int]) -> None:
        """`release` of each row, in order."""
        width = max((len(self._written[row]) for row in rows), default=0)
        if width:
            self.array[np.asarray(rows, dtype=np.int64), :width] = 0
        for row in rows:
            del self._written[row]
        self._free.extend(rows)

    def sync(self, rows: Sequence[int], tables: Sequence[BlockTable]) -> None:
        """Bring `rows` up to date with `tables` (row i holds table i)."""
        written = self._written
        changed = [(row, table.blocks) for row, table in zip(rows, tables, strict=True) if written[row] != table.blocks]
        if len(changed) < 8:  # a few rows (a jit draft, a prefill): row by row
            for row, blocks in changed:
                n, old = len(blocks), written[row]
                if n > self.array.shape[1]:
                    self._widen(n)
                self.array[row, :n] = blocks
                if len(old) > n:
                    self.array[row, n : len(old)] = 0
                written[row] = blocks.copy()
            return
        # many (a pre-draft's new branches): the old entries zeroed and the new ones written in one scatter each
        idx = np.fromiter((row for row, _ in changed), dtype=np.int64, count=len(changed))
        lengths = np.fromiter((len(b) for _, b in changed), dtype=np.int64, count=len(changed))
        old_width = max(len(written[row]) for row, _ in changed)
        if lengths.max() > self.array.shape[1]:
            self._widen(int(lengths.max()))
        if old_width:
            self.array[idx, :old_width] = 0
        values = np.fromiter(chain.from_iterable(b for _, b in changed), dtype=np.int32, count=int(lengths.sum()))
        starts = np.cumsum(lengths) - lengths
        cols = np.arange(len(values)) - np.repeat(starts, lengths)
        self.array[np.repeat(idx, lengths), cols] = values
        for row, blocks in changed:
            written[row] = blocks.copy()

    def _widen(self, width: int) -> None:
        new = np.zeros((self.array.shape[0], max(width, 2 * self.array.shape[1])), dtype=np.int32)
        new[:, : self.array.shape[1]] = self.array
        self.array = new
