"""Runs the draft model over batches of per-request token chunks, keeping each request's KV in the cache.

The runner knows requests, their blocks and how many tokens of KV are valid; it knows nothing of drafting
or sampling (the drafting loop sits on top of `forward`). Requests that do not fit are the caller's
decision: `reserve` each one first and leave out those that raise `OutOfBlocksError`.

A sequence can be forked (`fork`): the child shares the parent's first tokens of KV and is then extended
with ordinary `forward` chunks, which is how SSD's pre-drafting branches are run; `adopt` makes a child
the parent's continuation (a speculation-cache hit keeps the branch's KV instead of recomputing it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from saguaro_vllm.drafter import vllm_attention
from saguaro_vllm.drafter.attention import AttentionMetadata
from saguaro_vllm.drafter.kv_cache import BlockTable, KVCacheConfig, OutOfBlocksError, PagedKVCache
from saguaro_vllm.drafter.model.llama import LlamaForCausalLM
from saguaro_vllm.ops import loader
from saguaro_vllm.ops.branch_attention import decode_attention

# (request id, token ids, position of the first token == tokens already computed for the request)
Chunk = tuple[str, Sequence[int], int]


@dataclass
class _Request:
    block_table: BlockTable
    num_computed: int = 0  # tokens whose KV is valid, always a prefix of the sequence


@dataclass(frozen=True)
class _Piece:
    """The part `begin..end` of chunk `index` that one model pass processes."""

    index: int
    begin: int
    end: int


class DraftModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache_cfg: KVCacheConfig, max_tokens_per_seq: int = 512):
        """`max_tokens_per_seq`: default cap on one sequence's tokens per model pass (chunked prefill)."""
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
        #: One-token-per-sequence passes use the compiled branch-attention op (when it is built for this
        #: device; `SAGUARO_OPS=reference` turns it off) instead of the per-sequence reference loop.
        self.fused_decode = loader.use_compiled(self.device)
        #: On CUDA every pass (decode and multi-token) runs vLLM's paged varlen attention (FlashAttention or its
        #: Triton `unified_attention`, see vllm_attention.py) when vLLM has it; `vllm_backend` is None elsewhere
        #: (CPU, or no vLLM), and the passes keep the paths above. `attention_impl` names what runs.
        self.attention_impl, self.vllm_backend = vllm_attention.select(
            self.device, self.dtype, cfg.head_size, self.block_size)

    # ---- request state -------------------------------------------------------------------------
    def add_request(self, req_id: str) -> None:
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already known to the draft runner")
        self._requests[req_id] = _Request(self.kv_cache.new_block_table())

    def free_request(self, req_id: str) -> None:
        """Forget the request and let go of all its blocks (on finish or preemption; also for forks)."""
        self._get(req_id).block_table.shrink(0)
        del self._requests[req_id]

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def num_computed(self, req_id: str) -> int:
        return self._get(req_id).num_computed

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of KV (e.g. rejected drafts); frees unused blocks."""
        req = self._get(req_id)
        if not 0 <= num_tokens <= req.num_computed:
            raise ValueError(f"request {req_id!r}: cannot truncate to {num_tokens} tokens, "
                             f"{req.num_computed} are computed")
        req.num_computed = num_tokens
        req.block_table.shrink(num_tokens)

    def reserve(self, req_id: str, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens; raises OutOfBlocksError (changing nothing)."""
        req = self._get(req_id)
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
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} is already known to the draft runner")
        if not 0 <= num_tokens <= parent.num_computed:
            raise ValueError(f"request {parent_id!r}: cannot fork {num_tokens} tokens, "
                             f"{parent.num_computed} are computed")
        self._requests[child_id] = _Request(parent.block_table.fork(num_tokens), num_tokens)

    def adopt(self, child_id: str, parent_id: str) -> None:
        """Make `child_id`'s sequence the sequence of `parent_id` and forget `child_id`; the parent's old
        blocks are let go (those the child or other forks still share stay)."""
        child, parent = self._get(child_id), self._get(parent_id)
        if child_id == parent_id:
            raise ValueError(f"request {child_id!r} cannot adopt itself")
        parent.block_table.shrink(0)
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
        self._validate(chunks, counts)
        self._reserve_all(chunks)
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
            logits, per_piece = self._run(chunks, pieces, counts)
            passes += 1
            if passes == 1 and all(p.end == len(chunks[p.index][1]) for p in pieces):
                return logits  # one pass fed every chunk whole: its rows are in chunk order already (no copy)
            for piece, part in zip(pieces, logits.split(per_piece), strict=True):
                rows[piece.index].append(part)
                done[piece.index] = piece.end
        return torch.cat([t for chunk_rows in rows for t in chunk_rows])

    def _run(self, chunks: Sequence[Chunk], pieces: list[_Piece], num_logits: list[int]
             ) -> tuple[torch.Tensor, list[int]]:
        """One model pass over `pieces`; returns the logits of each piece's tokens among the last
        `num_logits` of their chunk (possibly none), piece after piece, and how many rows each piece has."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        logit_counts: list[int] = []
        tables: list[list[int]] = []
        for p in pieces:
            req_id, tokens, start = chunks[p.index]
            table = self._requests[req_id].block_table
            first, last = start + p.begin, start + p.end
            input_ids.extend(tokens[p.begin : p.end])
            positions.extend(range(first, last))
            slots.extend(table.slots(first, last))
            row0 = query_start[-1] - p.begin  # flat row of chunk offset 0
            wanted_from = max(p.begin, len(tokens) - num_logits[p.index])
            logit_rows.extend(range(row0 + wanted_from, row0 + p.end))
            logit_counts.append(max(0, p.end - wanted_from))
            query_start.append(row0 + p.end)
            seq_lens.append(last)
            tables.append(table.blocks[: -(-last // self.block_size)])
        max_query_len = max(p.end - p.begin for p in pieces)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc=self._tensor(query_start, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_table=self._padded(tables),
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )
        if self.vllm_backend is not None:
            meta.backend = self.vllm_backend
        elif max_query_len == 1 and self.fused_decode:
            meta.backend = decode_attention
        input_t, positions_t = self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64)
        hidden = self.model(input_t, positions_t, self.kv_cache.layers, meta)
        for p, seq_len in zip(pieces, seq_lens, strict=True):
            self._requests[chunks[p.index][0]].num_computed = seq_len
        return self.model.compute_logits(hidden[self._tensor(logit_rows, torch.int64)]), logit_counts

    # ---- helpers -------------------------------------------------------------------------------
    def _get(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} is unknown to the draft runner (add_request first)") from None

    def _validate(self, chunks: Sequence[Chunk], num_logits: list[int]) -> None:
        seen: set[str] = set()
        for (req_id, tokens, start), wanted in zip(chunks, num_logits, strict=True):
            req = self._get(req_id)
            if req_id in seen:
                raise ValueError(f"request {req_id!r} appears twice in one forward call")
            seen.add(req_id)
            if start != req.num_computed:
                raise ValueError(f"request {req_id!r}: chunk starts at {start} but {req.num_computed} tokens "
                                 "are computed; truncate first to roll back")
            if not 1 <= wanted <= len(tokens):
                raise ValueError(f"request {req_id!r}: num_logits={wanted} needs 1..{len(tokens)} "
                                 "(the chunk's length)")

    def _reserve_all(self, chunks: Sequence[Chunk]) -> None:
        """Allocate blocks for all chunks (growth and private copies of shared blocks), or none of them.

        The copy count is an upper bound (two forks writing one shared block copy it once), so once the
        check passes every `ensure` succeeds.
        """
        needs = [(self._requests[r].block_table, s + len(t), s) for r, t, s in chunks]
        total = sum(table.blocks_needed(n, write_from=s) for table, n, s in needs)
        if total > self.num_free_blocks:
            raise OutOfBlocksError(total, self.num_free_blocks)
        for table, n, s in needs:
            table.ensure(n, write_from=s)

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)
