"""Runs the draft model over batches of per-request token chunks, keeping each request's KV in the cache.

The runner knows requests, their blocks and how many tokens of KV are valid; it knows nothing of drafting
or sampling (the drafting loop sits on top of `forward`). Requests that do not fit are the caller's
decision: `reserve` each one first and leave out those that raise `OutOfBlocksError`.

A sequence can be forked (`fork`): the child shares the parent's first tokens of KV and is then extended
with ordinary `forward` chunks, which is how SSD's pre-drafting branches are run; `adopt` makes a child
the parent's continuation (a speculation-cache hit keeps the branch's KV instead of recomputing it).
Many forks at once (a pre-draft's branches) are a `ForkGroup` (`fork_group`): rows of arrays, stepped by
`forward_batch` and released in bulk, each fork becoming an ordinary sequence only where something needs one.

Decode-shaped forwards (one token per chunk) take `StaticDecode` when it is on (`static_buckets`, or
`cuda_graphs`): bucketed persistent buffers, a CUDA graph per bucket on CUDA (static_forward.py). Every
forward reads block tables from `BlockRows`, one persistent row per sequence rewritten only when it changed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, compress, groupby, repeat

import numpy as np
import torch

from saguaro_vllm.drafter import vllm_attention
from saguaro_vllm.drafter.attention import AttentionMetadata, reference_paged_attention
from saguaro_vllm.drafter.block_rows import BlockRows
from saguaro_vllm.drafter.kv_cache import BlockTable, ForkRows, KVCacheConfig, OutOfBlocksError, PagedKVCache
from saguaro_vllm.drafter.model.llama import LlamaForCausalLM
from saguaro_vllm.drafter.static_forward import BUCKETS, DEFAULT_MAX_LEN, StaticDecode
from saguaro_vllm.ops import loader
from saguaro_vllm.ops.branch_attention import decode_attention

logger = logging.getLogger(__name__)

# (request id, token ids, position of the first token == tokens already computed for the request)
Chunk = tuple[str, Sequence[int], int]


@dataclass(slots=True)
class _Request:
    block_table: BlockTable
    row: int  # its row of the runner's BlockRows
    num_computed: int = 0  # tokens whose KV is valid, always a prefix of the sequence


class DecodeBatch:
    """Sequences that are fed one token each, forward after forward (a pre-draft's branches), with their runner
    state as arrays: block-table rows, positions, and how far each can write without a new or a private block.
    `DraftModelRunner.forward_batch` runs them with no Python per row; the arrays are read again from the
    runner's requests only when something else changed the runner since (its `epoch`). Built by
    `DraftModelRunner.decode_batch`."""

    def __init__(self, seq_ids: Sequence[str], reqs: list[_Request]):
        self.seq_ids = list(seq_ids)
        self.reqs = reqs
        self.rows = np.zeros(len(reqs), dtype=np.int64)  # BlockRows row of each sequence
        self.positions = np.zeros(len(reqs), dtype=np.int64)  # == num_computed
        self.limits = np.zeros(len(reqs), dtype=np.int64)  # positions below it are in private blocks
        self.epoch = -1  # the runner's epoch the arrays were read at

    def __len__(self) -> int:
        return len(self.reqs)


class ForkGroup:
    """Forks admitted together (a pre-draft's branches, `DraftModelRunner.fork_group`) as rows of arrays: per
    fork its block-table row (int32, padded with 0: the parent's full prefix blocks, then its own, its partial
    block's copy and its growth), number of blocks and tokens of KV computed. No runner
    sequence per fork: 2048 forks at batch 64 x 32 branches cost ~5 us each as sequences. A fork id stays a
    runner sequence id all the same; the runner makes it an ordinary sequence the first time something other
    than `forward_batch`, `num_computed`, `has_request`, `adopt` or freeing needs one (`owned` is then False)."""

    def __init__(self, ids: list[str], rows: ForkRows, positions: np.ndarray, block_size: int):
        self.ids = ids
        self.index = dict(zip(ids, range(len(ids))))  # fork id -> row
        self.admitted = rows.admitted  # per row, the index of its fork among those asked for
        self.table = rows.table
        self.num_blocks = rows.num_blocks
        self.copied, self.grown = rows.copied, rows.grown
        self.positions = positions  # tokens of KV computed
        self.limits = rows.num_blocks * block_size  # positions below it are in the fork's own blocks
        self.owned = np.ones(len(ids), dtype=bool)  # rows whose fork the group holds (not freed nor made a sequence)
        self.num_owned = len(ids)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class _Piece:
    """The part `begin..end` of chunk `index` that one model pass processes."""

    index: int
    begin: int
    end: int


class DraftModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache_cfg: KVCacheConfig, max_tokens_per_seq: int = 512,
                 static_buckets: Sequence[int] | None = None, cuda_graphs: bool = False,
                 static_max_len: int | None = None):
        """`max_tokens_per_seq`: default cap on one sequence's tokens per model pass (chunked prefill).
        `static_buckets`: row buckets of the static decode path (off when None, unless `cuda_graphs`, which
        captures one graph per bucket of `static_forward.BUCKETS` or of `static_buckets`; CUDA only).
        `static_max_len`: the longest context that path covers (default: the cache's capacity, at most
        `static_forward.DEFAULT_MAX_LEN`). The static path takes one block of the cache as scratch."""
        if max_tokens_per_seq < 1:
            raise ValueError(f"max_tokens_per_seq must be >= 1, got {max_tokens_per_seq}")
        self.model = model
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        cfg = model.config
        self.kv_cache = PagedKVCache(
            kv_cache_cfg, cfg.num_layers, cfg.num_kv_heads, cfg.head_size, self.dtype, self.device
        )
        self.block_size = kv_cache_cfg.block_size
        self.max_tokens_per_seq = max_tokens_per_seq
        self._requests: dict[str, _Request] = {}
        self._groups: list[ForkGroup] = []  # those holding forks: a fork id is in one `owned` row at most
        #: changes with every change of any sequence's blocks or computed tokens other than through a
        #: `DecodeBatch`'s own forwards (which keep the arrays of that batch up to date)
        self._epoch = 0
        #: One-token-per-sequence passes use the compiled branch-attention op (when it is built for this
        #: device; `SAGUARO_OPS=reference` turns it off) instead of the per-sequence reference loop.
        self.fused_decode = loader.use_compiled(self.device)
        #: On CUDA every pass (decode and multi-token) runs vLLM's paged varlen attention (FlashAttention or its
        #: Triton `unified_attention`, see vllm_attention.py) when vLLM has it; `vllm_backend` is None elsewhere
        #: (CPU, or no vLLM), and the passes keep the paths above. `attention_impl` names what runs.
        self.attention_impl, self.vllm_backend = vllm_attention.select(
            self.device, self.dtype, cfg.head_size, self.block_size)
        self._rows = BlockRows()
        self.static: StaticDecode | None = None
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA draft device, not {self.device}")
        if cuda_graphs or static_buckets:
            # graph-safe attention: vLLM's kernels, or the compiled decode op (it reads no device value on
            # the host); the reference loops over host lengths that a graph would freeze
            capture = cuda_graphs and (self.vllm_backend is not None or self.fused_decode)
            if cuda_graphs and not capture:
                logger.warning("saguaro drafter: CUDA graphs need vLLM's attention kernels or the compiled "
                               "decode attention, and %s runs here: one-token forwards run the static buffers "
                               "without capture", self.attention_impl)
            (scratch,) = self.kv_cache.allocator.allocate(1)
            max_len = static_max_len or min(DEFAULT_MAX_LEN, kv_cache_cfg.num_blocks * self.block_size)
            self.static = StaticDecode(model, self.kv_cache.layers, self.block_size, static_buckets or BUCKETS,
                                       max_len, scratch, self._backend(1), capture)

    def capture_graphs(self) -> float:
        """Capture every bucket's CUDA graph now (the drafter does at start-up); seconds taken, 0 without
        graphs."""
        return self.static.capture_all() if self.static is not None else 0.0

    @property
    def graph_mode(self) -> str:
        """How one-token forwards run: "cuda-graphs", "static" (bucketed buffers, eager) or "dynamic"."""
        if self.static is None:
            return "dynamic"
        return "cuda-graphs" if self.static.capture else "static"

    # ---- request state -------------------------------------------------------------------------
    def add_request(self, req_id: str) -> None:
        if self.has_request(req_id):
            raise ValueError(f"request {req_id!r} is already known to the draft runner")
        self._requests[req_id] = _Request(self.kv_cache.new_block_table(), self._rows.acquire())

    def free_request(self, req_id: str) -> None:
        """Forget the request and let go of all its blocks (on finish or preemption; also for forks)."""
        if req_id not in self._requests:
            g, i = self._fork_of(req_id)
            self._release_rows(g, np.array([i]))
            return
        req = self._requests[req_id]
        self._epoch += 1
        req.block_table.shrink(0)
        self._rows.release(req.row)
        del self._requests[req_id]

    def free_many(self, req_ids: Sequence[str]) -> None:
        """`free_request` of each (all known, none twice), in order: the same free list, block for block;
        sequences' blocks checked and let go in one pass, their block-table rows cleared together, a fork
        group's forks released from its arrays (`BlockAllocator.free_rows`) without becoming sequences."""
        if len(set(req_ids)) != len(req_ids):
            raise ValueError("a request appears twice among those to free")
        requests = self._requests
        if self._groups and requests.keys().isdisjoint(req_ids):  # the usual garbage: one group's forks
            g = self._groups[-1]
            rows = np.fromiter(map(g.index.get, req_ids, repeat(-1)), dtype=np.int64, count=len(req_ids))
            if (rows >= 0).all() and g.owned[rows].all():
                self._release_rows(g, rows)
                return
        runs = [(holder, list(ids)) for holder, ids in groupby(req_ids, self._holder)]  # all checked first
        for holder, ids in runs:
            if holder is None:
                self._free_requests(ids)
            else:
                self._release_rows(holder, np.array([holder.index[s] for s in ids], dtype=np.int64))

    def _free_requests(self, req_ids: list[str]) -> None:
        reqs = [self._requests[r] for r in req_ids]
        self._epoch += 1
        self.kv_cache.allocator.free_many([r.block_table.blocks for r in reqs])
        for r in reqs:
            r.block_table.blocks = []
        self._rows.release_many([r.row for r in reqs])
        requests = self._requests
        for req_id in req_ids:
            del requests[req_id]

    def held(self, seq_ids: Sequence[str]) -> list[str]:
        """Those of `seq_ids` the runner holds (sequences or group forks), in order: `has_request` of each, in
        set operations (a round's 2048 released branches)."""
        wanted = set(seq_ids)
        found = self._requests.keys() & wanted
        for g in self._groups:
            common = list(g.index.keys() & wanted)
            if common:
                rows = np.fromiter(map(g.index.__getitem__, common), dtype=np.int64, count=len(common))
                found.update(compress(common, g.owned[rows].tolist()))
        return list(filter(found.__contains__, seq_ids))

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests or self._find(req_id) is not None

    def num_computed(self, req_id: str) -> int:
        req = self._requests.get(req_id)
        if req is not None:
            return req.num_computed
        g, i = self._fork_of(req_id)
        return int(g.positions[i])

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of KV (e.g. rejected drafts); frees unused blocks."""
        req = self._get(req_id)
        if not 0 <= num_tokens <= req.num_computed:
            raise ValueError(f"request {req_id!r}: cannot truncate to {num_tokens} tokens, "
                             f"{req.num_computed} are computed")
        self._epoch += 1
        req.num_computed = num_tokens
        req.block_table.shrink(num_tokens)

    def reserve(self, req_id: str, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens; raises OutOfBlocksError (changing nothing)."""
        req = self._get(req_id)
        self._epoch += 1
        req.block_table.ensure(req.num_computed + num_new_tokens, write_from=req.num_computed)

    def blocks_needed(self, req_id: str, num_new_tokens: int) -> int:
        """Blocks `reserve(req_id, num_new_tokens)` would allocate (growth and private copies)."""
        req = self._get(req_id)
        return req.block_table.blocks_needed(req.num_computed + num_new_tokens, write_from=req.num_computed)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """New sequence `child_id` holding the KV of `parent_id`'s first `num_tokens` tokens.

        Full blocks are shared, the partial last block is copied (one block; OutOfBlocksError, changing
        nothing, if there is none). Either side can then be extended, truncated or freed independently.
        """
        parent = self._get(parent_id)
        if self.has_request(child_id):
            raise ValueError(f"request {child_id!r} is already known to the draft runner")
        if not 0 <= num_tokens <= parent.num_computed:
            raise ValueError(f"request {parent_id!r}: cannot fork {num_tokens} tokens, "
                             f"{parent.num_computed} are computed")
        self._epoch += 1
        self._requests[child_id] = _Request(parent.block_table.fork(num_tokens), self._rows.acquire(), num_tokens)

    def fork_many(self, forks: Sequence[tuple[str, str, int, int]]) -> list[tuple[int, int] | None]:
        """For each `(parent_id, child_id, num_tokens, new_tokens)` in order: `fork(parent_id, child_id,
        num_tokens)` then `reserve(child_id, new_tokens)`, or nothing at all where the free blocks do not hold
        the fork's partial-block copy and its growth (None; what `fork` + `reserve` + `free_request` on
        failure leave: the same blocks, block for block). Returns per fork (blocks copied, blocks reserved
        for growth). The prefix blocks' reference counts are raised once per parent and depth, the partial
        blocks copied in one indexed copy per layer (`PagedKVCache.fork_tables`). Checks every fork first:
        ValueError changes nothing."""
        known = {p: self._get(p) for p in dict.fromkeys(f[0] for f in forks)}
        parents = [known[f[0]] for f in forks]
        children = set()
        for (parent_id, child_id, n, m), parent in zip(forks, parents, strict=True):
            if child_id in children or self.has_request(child_id):
                raise ValueError(f"request {child_id!r} is already known to the draft runner")
            children.add(child_id)
            if not 0 <= n <= parent.num_computed:
                raise ValueError(f"request {parent_id!r}: cannot fork {n} tokens, {parent.num_computed} are "
                                 "computed")
            if m < 0:
                raise ValueError(f"request {child_id!r}: cannot reserve {m} tokens")
        self._epoch += 1
        tables = self.kv_cache.fork_tables([p.block_table for p in parents], [f[2] for f in forks],
                                           [f[3] for f in forks])
        acquire, requests = self._rows.acquire, self._requests
        for (_, child_id, n, _), (table, _, _) in zip(forks, tables, strict=True):
            if table is not None:
                requests[child_id] = _Request(table, acquire(), n)
        return [None if table is None else (copied, grown) for table, copied, grown in tables]

    def fork_group(self, parent_ids: Sequence[str], child_ids: Sequence[str], parent_of: np.ndarray,
                   num_tokens: np.ndarray, new_tokens: np.ndarray) -> ForkGroup:
        """`fork_many` of the forks `(parent_ids[parent_of[i]], child_ids[i], num_tokens[i], new_tokens[i])`, in
        order (priority: a fork that does not fit is left out, a later smaller one may still fit), as one
        `ForkGroup` of those admitted (`ForkGroup.admitted`): the same blocks, free list and reference counts,
        with no Python per fork beyond its id. Checks every fork first: ValueError changes nothing."""
        parents = [self._get(p) for p in parent_ids]
        parent_of = np.asarray(parent_of, dtype=np.int64)
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        new_tokens = np.asarray(new_tokens, dtype=np.int64)
        wanted = set(child_ids)
        if len(wanted) != len(child_ids):
            raise ValueError("a fork id appears twice in one fork group")
        clash = next(iter(self._requests.keys() & wanted), None)  # (set operations: C speed for 2048 ids)
        for g in self._groups:
            if clash is None:
                clash = next((s for s in g.index.keys() & wanted if g.owned[g.index[s]]), None)
        if clash is not None:
            raise ValueError(f"request {clash!r} is already known to the draft runner")
        computed = np.array([p.num_computed for p in parents], dtype=np.int64)
        bad = np.flatnonzero((num_tokens < 0) | (num_tokens > computed[parent_of]) | (new_tokens < 0))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"request {parent_ids[parent_of[i]]!r}: cannot fork {num_tokens[i]} tokens and reserve "
                             f"{new_tokens[i]}, {computed[parent_of[i]]} are computed")
        self._epoch += 1
        rows = self.kv_cache.fork_rows([p.block_table.blocks for p in parents], parent_of, num_tokens, new_tokens)
        admitted = rows.admitted
        ids = list(child_ids) if len(admitted) == len(child_ids) else [child_ids[i] for i in admitted.tolist()]
        group = ForkGroup(ids, rows, num_tokens[admitted], self.block_size)
        if len(group):
            self._groups.append(group)
        return group

    def adopt(self, child_id: str, parent_id: str) -> None:
        """Make `child_id`'s sequence the sequence of `parent_id` and forget `child_id`; the parent's old
        blocks are let go (those the child or other forks still share stay)."""
        if child_id == parent_id:
            raise ValueError(f"request {child_id!r} cannot adopt itself")
        if child_id not in self._requests:  # a group's fork: its row becomes the parent's state, in place
            g, i = self._fork_of(child_id)
            parent = self._get(parent_id)
            self._epoch += 1
            parent.block_table.shrink(0)
            parent.block_table.blocks = g.table[i, : g.num_blocks[i]].tolist()
            parent.num_computed = int(g.positions[i])
            self._disown(g, i)
            return
        child, parent = self._get(child_id), self._get(parent_id)
        self._epoch += 1
        parent.block_table.shrink(0)
        self._rows.release(parent.row)
        self._requests[parent_id] = child
        del self._requests[child_id]

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA; nothing on CPU): timings the planner learns from must
        measure the forward, not how fast its kernels were launched."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.allocator.num_free

    # ---- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[Chunk], max_tokens_per_seq: int | None = None,
        num_logits: int | Sequence[int] = 1,
    ) -> torch.Tensor:
        """Write KV for every token of every chunk; return fp32 logits of each chunk's last `num_logits`
        tokens (one number for all chunks, or one per chunk), chunk by chunk: `[sum of them, vocab]`.

        Each chunk must start at its request's `num_computed` (call `truncate` first to roll back).
        Chunks longer than `max_tokens_per_seq` (default: the runner's) run over several passes.
        Raises OutOfBlocksError, having allocated nothing, if the chunks do not all fit.
        """
        if not chunks:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        counts = [num_logits] * len(chunks) if isinstance(num_logits, int) else list(num_logits)
        if len(counts) != len(chunks):
            raise ValueError(f"{len(chunks)} chunks but {len(counts)} num_logits")
        reqs = self._validate(chunks, counts)
        self._epoch += 1
        self._reserve_all(chunks, reqs)
        static = self.static
        if (static is not None and all(len(c[1]) == 1 for c in chunks)
                and static.fits(len(chunks), max(c[2] for c in chunks))):
            return self._run_static(chunks, reqs)
        limit = max_tokens_per_seq or self.max_tokens_per_seq
        done = [0] * len(chunks)
        rows: list[list[torch.Tensor]] = [[] for _ in chunks]
        passes = 0
        while True:
            pieces = [
                _Piece(i, done[i], min(len(c[1]), done[i] + limit))
                for i, c in enumerate(chunks)
                if done[i] < len(c[1])
            ]
            if not pieces:
                break
            logits, per_piece = self._run(chunks, reqs, pieces, counts)
            passes += 1
            if passes == 1 and all(p.end == len(chunks[p.index][1]) for p in pieces):
                return logits  # one pass fed every chunk whole: its rows are in chunk order already (no copy)
            for piece, part in zip(pieces, logits.split(per_piece), strict=True):
                rows[piece.index].append(part)
                done[piece.index] = piece.end
        return torch.cat([t for chunk_rows in rows for t in chunk_rows])

    def decode_batch(self, seq_ids: Sequence[str]) -> DecodeBatch:
        """A `DecodeBatch` of these sequences (each at most once), for `forward_batch`."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence appears twice in one decode batch")
        return DecodeBatch(seq_ids, [self._get(s) for s in seq_ids])

    @torch.inference_mode()
    def forward_batch(self, batch: DecodeBatch | ForkGroup, tokens: np.ndarray,
                      live: np.ndarray | None = None) -> torch.Tensor:
        """One token for each sequence of `batch` (or of those at the indices `live`, in that order):
        `tokens[i]` for the i-th of them. The same KV, fp32 logits `[rows, vocab]` and bookkeeping as
        `forward` with the chunks `(seq_id, [token], num_computed)`, which it runs instead where a row would
        need a new block or write a shared one (or, in a `ForkGroup`, is no longer the group's); otherwise
        without Python per row."""
        if isinstance(batch, ForkGroup):
            return self._forward_group(batch, tokens, live)
        if batch.epoch != self._epoch:
            self._refresh(batch)
        idx = slice(None) if live is None else live
        positions = batch.positions[idx]
        n = len(positions)
        if n == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        if not (positions < batch.limits[idx]).all():
            ids = batch.seq_ids if live is None else [batch.seq_ids[i] for i in live]
            return self.forward([(s, [t], p) for s, t, p in zip(ids, np.asarray(tokens).tolist(), positions.tolist(),
                                                                 strict=True)])
        rows = batch.rows[idx]
        static = self.static
        if static is not None and static.fits(n, int(positions.max())):
            logits = static.run(tokens, positions, rows, self._rows.array)
        else:
            logits = self._run_decode(self._rows.array, rows, positions, tokens)
        batch.positions[idx] += 1
        for req in batch.reqs if live is None else [batch.reqs[i] for i in live]:
            req.num_computed += 1
        self._epoch += 1  # other batches holding these sequences read them again
        batch.epoch = self._epoch
        return logits

    def _refresh(self, batch: DecodeBatch) -> None:
        """Read a batch's arrays from its sequences' state (and bring their block-table rows up to date)."""
        reqs = batch.reqs
        current = list(map(self._requests.get, batch.seq_ids))
        if current != reqs:  # (identity first: the same objects compare equal at C speed)
            seq_id = next(s for s, a, b in zip(batch.seq_ids, current, reqs, strict=True) if a is not b)
            raise ValueError(f"sequence {seq_id!r} of a decode batch was freed or adopted")
        rows = [r.row for r in reqs]
        self._rows.sync(rows, [r.block_table for r in reqs])
        batch.rows[:] = rows
        batch.positions[:] = [r.num_computed for r in reqs]
        bs, refs = self.block_size, self.kv_cache.allocator._refs
        limits = []
        for req in reqs:  # the first shared or missing block at or after the next position
            blocks, i = req.block_table.blocks, req.num_computed // bs
            end = len(blocks)
            while i < end and refs[blocks[i]] == 1:
                i += 1
            limits.append(i * bs)
        batch.limits[:] = limits
        batch.epoch = self._epoch

    def _forward_group(self, group: ForkGroup, tokens: np.ndarray, live: np.ndarray | None) -> torch.Tensor:
        """`forward_batch` of a fork group: its table rows and positions as they are."""
        live = None if live is None else np.asarray(live, dtype=np.int64)
        idx = slice(None) if live is None else live
        positions = group.positions[idx]
        n = len(positions)
        if n == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        if not ((positions < group.limits[idx]).all() and group.owned[idx].all()):
            ids = group.ids if live is None else [group.ids[i] for i in live.tolist()]
            for s, owned in zip(ids, group.owned[idx].tolist(), strict=True):
                if not owned and s not in self._requests:
                    raise ValueError(f"sequence {s!r} of a fork group was freed or adopted")
            return self.forward([(s, [t], self.num_computed(s)) for s, t in zip(ids, np.asarray(tokens).tolist(),
                                                                                strict=True)])
        rows = np.arange(n) if live is None else live
        static = self.static
        if static is not None and static.fits(n, int(positions.max())):
            logits = static.run(tokens, positions, rows, group.table)
        else:
            logits = self._run_decode(group.table, rows, positions, tokens)
        group.positions[idx] += 1
        return logits

    def _run_decode(self, tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, tokens) -> torch.Tensor:
        """`_run` for one token per row (`rows`: rows of `tables`, BlockRows' up to date or a fork group's),
        every row's logits."""
        n, bs = len(rows), self.block_size
        ints = np.empty(2 * n + 1, dtype=np.int32)  # query_start_loc, then seq_lens: one host-to-device copy
        query_start, seq_lens = ints[: n + 1], ints[n + 1 :]
        query_start[:] = np.arange(n + 1)
        np.add(positions, 1, out=seq_lens)
        seq_lens_cpu = seq_lens.tolist()
        max_seq_len = max(seq_lens_cpu)
        table = tables[rows, : -(-max_seq_len // bs)]
        longs = np.empty(3 * n, dtype=np.int64)  # ids, positions, slots
        longs[:n] = tokens
        longs[n : 2 * n] = positions
        np.add(table[np.arange(n), positions // bs].astype(np.int64) * bs, positions % bs, out=longs[2 * n :])
        longs_t, ints_t = self._array(longs), self._array(ints)
        meta = AttentionMetadata(
            slot_mapping=longs_t[2 * n :],
            query_start_loc=ints_t[: n + 1],
            seq_lens=ints_t[n + 1 :],
            block_table=self._array(table),
            query_start_loc_cpu=query_start.tolist(),
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=1,
            max_seq_len=max_seq_len,
            backend=self._backend(1),
        )
        hidden = self.model(longs_t[:n], longs_t[n : 2 * n], self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden)

    def _run(self, chunks: Sequence[Chunk], chunk_reqs: list[_Request], pieces: list[_Piece],
             num_logits: list[int]) -> tuple[torch.Tensor, list[int]]:
        """One model pass over `pieces`; returns the logits of each piece's tokens among the last
        `num_logits` of their chunk (possibly none), piece after piece, and how many rows each piece has."""
        reqs = [chunk_reqs[p.index] for p in pieces]
        rows = [r.row for r in reqs]
        self._rows.sync(rows, [r.block_table for r in reqs])
        n = len(pieces)
        # per piece: first and end offset in its chunk, the chunk's start, the chunk offset of its first
        # logit row (the chunk's last `num_logits` tokens)
        begin, end, start, first_logit = np.array(
            [(p.begin, p.end, chunks[p.index][2], len(chunks[p.index][1]) - num_logits[p.index]) for p in pieces],
            dtype=np.int64).reshape(n, 4).T
        sizes = end - begin
        ints = np.empty(2 * n + 1, dtype=np.int32)  # query_start_loc, then seq_lens: one host-to-device copy
        query_start, seq_lens = ints[: n + 1], ints[n + 1 :]
        query_start[0] = 0
        np.cumsum(sizes, out=query_start[1:])
        np.add(start, end, out=seq_lens)
        total = int(query_start[-1])
        owner = np.repeat(np.arange(n), sizes)  # the piece of each token
        offset = begin[owner] + np.arange(total) - query_start[owner]  # its offset in its chunk
        logit_rows = np.flatnonzero(offset >= first_logit[owner])
        longs = np.empty(3 * total + len(logit_rows), dtype=np.int64)  # ids, positions, slots, logit rows
        longs[:total] = list(chain.from_iterable(chunks[p.index][1][p.begin : p.end] for p in pieces))
        positions = longs[total : 2 * total]
        np.add(start[owner], offset, out=positions)
        bs = self.block_size
        seq_lens_cpu = seq_lens.tolist()
        table = self._rows.array[rows, : -(-max(seq_lens_cpu) // bs)]
        np.add(table[owner, positions // bs].astype(np.int64) * bs, positions % bs, out=longs[2 * total : 3 * total])
        longs[3 * total :] = logit_rows
        longs_t, ints_t = self._array(longs), self._array(ints)
        max_query_len = int(sizes.max())
        meta = AttentionMetadata(
            slot_mapping=longs_t[2 * total : 3 * total],
            query_start_loc=ints_t[: n + 1],
            seq_lens=ints_t[n + 1 :],
            block_table=self._array(table),
            query_start_loc_cpu=query_start.tolist(),
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens_cpu),
            backend=self._backend(max_query_len),
        )
        hidden = self.model(longs_t[:total], longs_t[total : 2 * total], self.kv_cache.layers, meta)
        for req, seq_len in zip(reqs, seq_lens_cpu, strict=True):
            req.num_computed = seq_len
        logit_counts = np.maximum(0, end - np.maximum(begin, first_logit)).tolist()
        return self.model.compute_logits(hidden[longs_t[3 * total :]]), logit_counts

    def _run_static(self, chunks: Sequence[Chunk], reqs: list[_Request]) -> torch.Tensor:
        """A decode-shaped forward through the static buffers (and the bucket's CUDA graph)."""
        rows = [r.row for r in reqs]
        self._rows.sync(rows, [r.block_table for r in reqs])
        logits = self.static.run([c[1][0] for c in chunks], [c[2] for c in chunks], rows, self._rows.array)
        for req in reqs:
            req.num_computed += 1
        return logits

    def _backend(self, max_query_len: int):
        """The attention of a pass: vLLM's kernels on CUDA, else the fused op for one-token passes."""
        if self.vllm_backend is not None:
            return self.vllm_backend
        if max_query_len == 1 and self.fused_decode:
            return decode_attention
        return reference_paged_attention

    # ---- helpers -------------------------------------------------------------------------------
    def _get(self, req_id: str) -> _Request:
        """The request's state; a group's fork becomes an ordinary sequence here (its blocks' references
        then belong to its table)."""
        req = self._requests.get(req_id)
        if req is not None:
            return req
        g, i = self._fork_of(req_id)
        table = self.kv_cache.new_block_table()
        table.blocks = g.table[i, : g.num_blocks[i]].tolist()
        req = self._requests[req_id] = _Request(table, self._rows.acquire(), int(g.positions[i]))
        self._epoch += 1
        self._disown(g, i)
        return req

    def _find(self, seq_id: str) -> tuple[ForkGroup, int] | None:
        """The group and row holding the fork `seq_id`, or None."""
        for g in self._groups:
            i = g.index.get(seq_id)
            if i is not None and g.owned[i]:
                return g, i
        return None

    def _fork_of(self, seq_id: str) -> tuple[ForkGroup, int]:
        found = self._find(seq_id)
        if found is None:
            raise KeyError(f"request {seq_id!r} is unknown to the draft runner (add_request first; a fork is "
                           "unknown once freed or adopted)")
        return found

    def _holder(self, seq_id: str) -> ForkGroup | None:
        """None for a sequence, the group for a group's fork; KeyError if neither."""
        return None if seq_id in self._requests else self._fork_of(seq_id)[0]

    def _disown(self, g: ForkGroup, i: int) -> None:
        g.owned[i] = False
        g.num_owned -= 1
        if not g.num_owned:
            self._groups.remove(g)

    def _release_rows(self, g: ForkGroup, rows: np.ndarray) -> None:
        """Let go of the group's forks at `rows` (owned, each once), in order: their own blocks freed, their
        prefix references dropped, all at once (`BlockAllocator.free_rows`)."""
        self._epoch += 1
        alloc = self.kv_cache.allocator
        if len(rows) < 32:  # a few (a batch of 1): row by row costs less than the arrays' fixed costs
            for table, n in zip(g.table[rows].tolist(), g.num_blocks[rows].tolist(), strict=True):
                alloc.free(table[:n])
        else:
            alloc.free_rows(g.table[rows], g.num_blocks[rows])
        g.owned[rows] = False
        g.num_owned -= len(rows)
        if not g.num_owned:
            self._groups.remove(g)

    def _validate(self, chunks: Sequence[Chunk], num_logits: list[int]) -> list[_Request]:
        """The chunks' requests, after checking the chunks against them."""
        reqs = [self._get(c[0]) for c in chunks]
        if len({c[0] for c in chunks}) < len(chunks):
            seen: set[str] = set()
            req_id = next(c[0] for c in chunks if c[0] in seen or seen.add(c[0]))
            raise ValueError(f"request {req_id!r} appears twice in one forward call")
        for (req_id, tokens, start), wanted, req in zip(chunks, num_logits, reqs, strict=True):
            if start != req.num_computed:
                raise ValueError(f"request {req_id!r}: chunk starts at {start} but {req.num_computed} tokens "
                                 "are computed; truncate first to roll back")
            if not 1 <= wanted <= len(tokens):
                raise ValueError(f"request {req_id!r}: num_logits={wanted} needs 1..{len(tokens)} "
                                 "(the chunk's length)")
        return reqs

    def _reserve_all(self, chunks: Sequence[Chunk], reqs: list[_Request]) -> None:
        """Allocate blocks for all chunks (growth and private copies of shared blocks), or none of them.

        The copy count is an upper bound (two forks writing one shared block copy it once), so once the
        check passes every `ensure` succeeds.
        """
        bs, refcount = self.block_size, self.kv_cache.allocator.refcount
        needs = [(req.block_table, s + len(t), s) for req, (_, t, s) in zip(reqs, chunks, strict=True)]
        # one token at position s: a new block when s starts one, else a copy of its block if shared (what
        # `blocks_needed` says, without its per-call lists)
        counts = [(1 if s // bs >= len(table.blocks) or refcount(table.blocks[s // bs]) > 1 else 0)
                  if n == s + 1 else table.blocks_needed(n, write_from=s) for table, n, s in needs]
        total = sum(counts)
        if total > self.num_free_blocks:
            raise OutOfBlocksError(total, self.num_free_blocks)
        for (table, n, s), count in zip(needs, counts, strict=True):
            if count:  # a table needing no block neither grows nor holds a shared block in its write range
                table.ensure(n, write_from=s)

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _array(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(self.device, non_blocking=True)
