"""Decode-shaped forwards (every row feeds exactly one token: branch steps, jit drafts, one-token glues)
through static, bucketed buffers, and on CUDA through one CUDA graph per bucket.

Why: a 16-layer draft launches ~700 kernels per forward, several ms of host time against ~1 ms of GPU time;
a graph replays them in one launch. A graph fixes every tensor's address and shape, so:

- rows are rounded up to a bucket (`BUCKETS`, e.g. 37 rows run as 64); padding rows feed token 0 at position
  0 into a scratch block the runner reserved (their KV lands there, their logits are dropped);
- the inputs live in persistent buffers written in place: token ids and positions (one `[2, rows]` int64
  tensor) and the block table (`[rows, width]` int32, `width` blocks cover `max_len` tokens, rounded up so
  that vLLM's Triton kernel never widens it); slot mapping and context lengths are derived from those on
  the device, inside the graph, so a forward copies two pinned host buffers to the device and nothing else;
- attention metadata is fixed per bucket (`max_seq_len` = the table's reach, FlashAttention's split count
  pinned to `GRAPH_NUM_SPLITS` as vLLM does under full graphs), so only graph-safe backends are captured:
  vLLM's FlashAttention and Triton `unified_attention` (vllm_attention.py), or where those are absent the
  compiled decode attention (`ops.branch_attention.decode_attention`, no host reads of device values).

A graph covers the model up to its final norm; the LM head runs after the replay on the real rows only
(padding rows would cost a `[rows, vocab]` matmul, and each graph would keep its own `[bucket, vocab]` fp32
output: 1 GiB for 2048 rows at a 128k vocabulary), so the graphs' outputs are `[bucket, hidden]` and their
pool stays small. Graphs are captured at start-up (`capture_all`, largest bucket first, every row a padding
row) or else the first time a bucket is needed, each after one eager warm-up run on a side stream (which
also makes the backends' lazy allocations), all into one memory pool. Without capture (CPU, or CUDA without
vLLM's kernels) the same buffers and bucketing run eagerly; on CPU this path is tested equal to the dynamic
one (tests/test_static_forward.py).
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from saguaro_vllm.drafter.attention import AttentionMetadata

logger = logging.getLogger(__name__)

#: Row buckets of decode-shaped forwards; a forward with more rows than the largest runs dynamically.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
#: Longest context (tokens) the static block table covers by default; longer rows run dynamically.
DEFAULT_MAX_LEN = 8192
#: FlashAttention's split-KV count under capture (vLLM's `flash_attn_max_num_splits_for_cuda_graph`): its
#: own heuristic would be fixed at capture time from the capture's lengths.
GRAPH_NUM_SPLITS = 32
#: vLLM's Triton kernel reads the block table in tiles of this many positions (vllm_attention._TILE_COVER).
_TILE = 128


def resolve_cuda_graphs(setting: bool | str, device: str | torch.device) -> bool:
    """`saguaro.cuda_graphs` for a drafter on `device`: "auto" is on exactly for CUDA; true elsewhere is an
    error (ValueError)."""
    cuda = torch.device(device).type == "cuda"
    if setting == "auto":
        return cuda
    if setting is True and not cuda:
        raise ValueError(f"cuda_graphs: true needs a CUDA draft device, not {device} (use \"auto\" or false)")
    return bool(setting)


class StaticDecode:
    """Persistent inputs of decode-shaped forwards, per-bucket graphs, and counters of what ran."""

    def __init__(self, model, kv_layers: list[torch.Tensor], block_size: int, buckets: Sequence[int],
                 max_len: int, scratch_block: int, backend, capture: bool):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"static buckets must be positive row counts, got {list(buckets)}")
        self.model, self.kv_layers, self.block_size, self.backend = model, kv_layers, block_size, backend
        self.buckets = sorted(set(int(b) for b in buckets))
        self.max_rows = self.buckets[-1]
        self.width = -(-(-(-max(1, max_len) // _TILE) * _TILE) // block_size)
        self.max_len = self.width * block_size
        self.scratch_block = scratch_block
        device = kv_layers[0].device
        self.capture = capture and device.type == "cuda"
        pin = device.type == "cuda"
        self._host_inputs = torch.zeros(2, self.max_rows, dtype=torch.int64, pin_memory=pin)
        self._host_table = torch.zeros(self.max_rows, self.width, dtype=torch.int32, pin_memory=pin)
        self._np_inputs, self._np_table = self._host_inputs.numpy(), self._host_table.numpy()
        if device.type == "cpu":  # the buffers the forward reads are the host buffers themselves
            self._inputs, self._table = self._host_inputs, self._host_table
        else:
            self._inputs = torch.zeros_like(self._host_inputs, device=device)
            self._table = torch.zeros_like(self._host_table, device=device)
        self._query_start = torch.arange(self.max_rows + 1, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if pin else None  # the last host-to-device copy of the buffers
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        #: forwards per bucket (eager or replayed), and the last bucket used: what tests and logs read
        self.runs: collections.Counter[int] = collections.Counter()
        self.last_bucket: int | None = None

    @property
    def graphs(self) -> list[int]:
        """Buckets captured so far."""
        return sorted(self._graphs)

    def bucket(self, rows: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, rows)]

    def fits(self, rows: int, max_position: int) -> bool:
        """Whether a decode-shaped forward of `rows` rows, none past `max_position`, takes this path."""
        return rows <= self.max_rows and max_position < self.max_len

    def run(self, token_ids: Sequence[int], positions: Sequence[int], table_rows: Sequence[int],
            tables: np.ndarray) -> torch.Tensor:
        """fp32 logits `[rows, vocab]` of one decode-shaped forward: row i feeds `token_ids[i]` at
        `positions[i]`, its block table being row `table_rows[i]` of `tables` (BlockRows.array)."""
        n = len(token_ids)
        b = self.bucket(n)
        if self._copied is not None:
            self._copied.synchronize()  # the previous forward's copy has left the pinned buffers
        inputs, table = self._np_inputs, self._np_table
        inputs[0, :n] = token_ids
        inputs[1, :n] = positions
        inputs[:, n:b] = 0
        w = min(self.width, tables.shape[1], -(-(int(np.max(positions)) + 1) // self.block_size))
        table[:n, :w] = tables[table_rows, :w]  # columns past w: stale block ids, never read (past the lengths)
        table[n:b, 0] = self.scratch_block
        if self._inputs is not self._host_inputs:
            self._inputs.copy_(self._host_inputs, non_blocking=True)  # whole: a slice of it is not contiguous
            self._table[:b].copy_(self._host_table[:b], non_blocking=True)
            self._copied.record()
        self.runs[b] += 1
        self.last_bucket = b
        entry = self._graph(b) if self.capture else None
        if entry is None:
            hidden = self._forward(b, [p + 1 for p in positions] + [1] * (b - n))
        else:
            entry[0].replay()
            hidden = entry[1]  # read by the LM head below, before any later replay can overwrite it
        return self.model.compute_logits(hidden[:n])

    def capture_all(self) -> float:
        """Capture every bucket not captured yet (at start-up, so that no round pays a capture), largest
        first (the smaller ones reuse its pool memory); every row a padding row. Returns the seconds taken."""
        t0 = time.perf_counter()
        if not self.capture:
            return 0.0
        self._copied.synchronize()
        self._np_inputs[:] = 0
        self._np_table[:, 0] = self.scratch_block
        self._inputs.copy_(self._host_inputs)
        self._table.copy_(self._host_table)
        for b in reversed(self.buckets):
            if self._graph(b) is None:
                break
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Bucket `b`'s graph, captured now if it is not yet; None (and no more capture) if that fails."""
        entry = self._graphs.get(b)
        if entry is None:
            try:
                entry = self._capture(b)
            except Exception:  # only a GPU shows whether a kernel captures: keep serving, eagerly
                logger.exception("saguaro drafter: capturing a CUDA graph of %d rows failed; one-token forwards "
                                 "run without graphs from now on", b)
                self.capture = False
        return entry

    def _forward(self, b: int, seq_lens_cpu: list[int]) -> torch.Tensor:
        """The model (to its final norm) over the first `b` rows of the buffers: hidden states `[b, hidden]`."""
        ids, positions, table = self._inputs[0, :b], self._inputs[1, :b], self._table[:b]
        bs = self.block_size
        slots = table.gather(1, (positions // bs)[:, None]).squeeze(1).long() * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=self._query_start[: b + 1], seq_lens=(positions + 1).int(),
            block_table=table, query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=seq_lens_cpu,
            max_query_len=1, max_seq_len=self.max_len, backend=self.backend,
        )
        meta.num_splits = GRAPH_NUM_SPLITS if self.capture else 0
        return self.model(ids, positions, self.kv_layers, meta)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm bucket `b` up eagerly on a side stream (it computes the current forward, which the replay
        then repeats bit for bit), then capture it into the shared pool."""
        lens = [1] * b  # only the reference attention reads these; it is never captured
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(b, lens)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b, lens)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[b] = (graph, out)
        return self._graphs[b]
