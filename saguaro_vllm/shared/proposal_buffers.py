"""Proposal probabilities between the drafter and the proposer without serialising them: a shared ring.

Sampled drafts need their exact proposal q (float32 `[K, vocab]` per row: 2.6 MB at a 128k vocabulary) in
vLLM's rejection sampler. Instead of travelling through the socket, q is written by the drafter straight
into a slot of a ring that both processes map (a file in a private 0700 directory, on `/dev/shm` where
there is one), and the step answer names only the slot and which row each slot row belongs to. Modelled on
vLLM's `shm_broadcast.ShmRingBuffer`: fixed-size slots plus a small header of per-slot flags, each flag
moved by one side only, so no lock is needed.

Slot layout: float32 `[rows, K, vocab]` (rows: `ring_rows`, at most `saguaro.max_sampled_rows`, 256 by
default, and at most the engine's `max_num_seqs`), preceded by a header of `slots` records `(state, seq)`
(int64 each). The file is sparse and never pre-touched: memory is used only by the rows written so far,
i.e. by what the largest sampled batch needed. Ownership of a slot:

    FREE    --drafter: acquire(seq)-->  WRITING  --drafter: publish()-->  HELD  --proposer: release_held()--> FREE

- the drafter writes only slots it moved to WRITING, and only while answering a request;
- the proposer reads a slot only while it is HELD with the `seq` of the answer it accepted, and hands
  vLLM a zero-copy view of it (CPU) or one contiguous copy (other devices);
- vLLM consumes that view in the next step's sampling (`GPUModelRunner._get_spec_decode_draft_probs`
  concatenates the rows into a new tensor) and clears it at the start of the next `propose_draft_token_ids`,
  so the proposer releases every HELD slot at the start of its next `propose`: the slot of the last answer,
  and any slot of an answer it dropped (a late answer to an abandoned step), so none leaks;
- a drafter that finds no FREE slot (more than `slots - 1` late answers between two steps) gives its
  sampled rows no drafts that step (exact: vLLM then decodes them normally) instead of overwriting.

Only rows with sampled drafts occupy slot rows (compactly, from row 0); greedy rows of the same batch get
one-hot rows after them, written by the proposer in the slot it holds (`assemble`; rows of requests the
target decodes greedily only hold a place: vLLM never reads their q). So a step whose rows
with drafts outnumber the slot's rows while one of them is sampled cannot hand vLLM every row's q: the
drafter keeps the sampled rows that fit beside the deterministic ones (`fit_rows`) and gives the others no
drafts that step (exact, just slower); the answer counts them (`probs_capped`).

Where the file lives (`ring_dir`): `/dev/shm` when it can hold the ring's worst case (every row of both
slots written), else the temp dir when that can (a disk-backed file: the same memory in the page cache, plus
writeback), else nowhere: the front end refuses the config (resolve.py) before any engine process starts,
and `create` re-checks the directory the front end chose. A sparse file on a full filesystem kills the
process that writes a new page with SIGBUS instead of raising, hence the check of the worst case.
"""
from __future__ import annotations

import math
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Collection, Sequence

import numpy as np
import torch

FREE, WRITING, HELD = 0, 1, 2
HEADER_FIELDS = 2  # (state, seq) per slot, int64
PAGE = 4096


#: `saguaro.max_sampled_rows: "auto"`: rows of the ring (at most `max_num_seqs`), see docs/configuration.md.
AUTO_MAX_SAMPLED_ROWS = 256
SLOTS = 2
#: Where the ring may go, in order of preference (the temp dir is appended at run time).
SHM_DIR = "/dev/shm"


def ring_rows(max_sampled_rows: int | str, max_num_seqs: int) -> int:
    """Rows of each slot: the cap `max_sampled_rows` ("auto": 256), never more than a step can have."""
    cap = AUTO_MAX_SAMPLED_ROWS if max_sampled_rows == "auto" else int(max_sampled_rows)
    return max(0, min(cap, int(max_num_seqs)))


def ring_bytes(rows: int, k: int, vocab: int, slots: int = SLOTS) -> int:
    """The file's size (the header page plus every slot): what a ring whose every row was written uses."""
    return _header_bytes(slots) + slots * rows * k * vocab * 4


def _header_bytes(slots: int) -> int:
    return -(-slots * HEADER_FIELDS * 8 // PAGE) * PAGE


def free_bytes(directory: str) -> int | None:
    """Space an unprivileged writer may still use in `directory` (None: not a writable directory)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        return None
    return st.f_bavail * st.f_frsize


def candidate_dirs() -> list[str]:
    return [SHM_DIR, tempfile.gettempdir()]


def ring_dir(size: int) -> tuple[str | None, dict[str, int | None]]:
    """(the first of /dev/shm and the temp dir with `size` bytes free, or None; the free bytes of each)."""
    free = {d: free_bytes(d) for d in candidate_dirs()}
    return next((d for d, b in free.items() if b is not None and b >= size), None), free


def gib(n: float) -> str:
    """A byte count for messages: GiB, MiB or KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def shortage_message(rows: int, k: int, vocab: int, free: dict[str, int | None], field: str,
                     slots: int = SLOTS) -> str:
    """Why no directory can hold the ring, and the fixes (front end and proposer say the same)."""
    size = ring_bytes(rows, k, vocab, slots)
    where = ", ".join(f"{d}: {'not a writable directory' if b is None else gib(b) + ' free'}"
                      for d, b in free.items())
    per_row = slots * k * vocab * 4
    best = max((b for b in free.values() if b is not None), default=0)
    fit = max(0, (best - _header_bytes(slots)) // per_row)
    smaller = (f"lower {field} to {fit} (what fits now; sampled rows beyond it in a step get no drafts)"
               if fit else f"set {field} to 0 (sampled requests then get no drafts; greedy ones still do)")
    return (f"{field}: the proposal ring (sampled rows' draft probabilities, shared between the target worker "
            f"and the drafter) needs up to {gib(size)} ({slots} slots x {rows} rows x K={k} x vocab {vocab} x 4 "
            f"B), more than any place for it has ({where}). Fixes: give the container more shared memory "
            f"(docker run --shm-size={math.ceil(size / 2**30) + 1}g, or --ipc=host; Kubernetes: an emptyDir "
            f"with medium Memory on /dev/shm), or {smaller}, or free space in the temp dir (TMPDIR). The file "
            "is sparse (memory is used only by the rows written), but a full filesystem would kill the writer "
            "with SIGBUS, so the worst case must fit")


class ProposalRing:
    """A ring of `slots` float32 `[rows, k, vocab]` buffers in one memory-mapped file (see module doc).

    The proposer `create`s it (and removes it on `close`); the drafter `attach`es with `spec()`.
    The file is sparse: memory is only used for rows that were written at least once.
    """

    def __init__(self, path: str, rows: int, k: int, vocab: int, slots: int, owner: bool,
                 device: str = "cpu", ipc: dict | None = None):
        if rows < 1 or k < 1 or vocab < 1 or slots < 1:
            raise ValueError(f"proposal ring: rows, k, vocab and slots must be >= 1 (got {rows}, {k}, {vocab}, "
                             f"{slots})")
        self.path, self.rows, self.k, self.vocab, self.slots, self.owner = path, rows, k, vocab, slots, owner
        self.device = device  # where the slots live: "cpu" (in the file) or the target's "cuda:N"
        self.slot_floats = rows * k * vocab
        header_bytes = _header_bytes(slots)
        on_host = device == "cpu"
        size = ring_bytes(rows, k, vocab, slots) if on_host else header_bytes  # device slots: the header only
        self.nbytes = ring_bytes(rows, k, vocab, slots)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0), 0o600)
        try:
            if owner:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"proposal ring {path}: size {os.fstat(fd).st_size} bytes, expected {size} for "
                                 f"rows={rows} k={k} vocab={vocab} slots={slots}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.header = np.frombuffer(self._mm, dtype=np.int64, count=slots * HEADER_FIELDS).reshape(slots, 2)
        self.ipc = ipc
        if on_host:
            data = np.frombuffer(self._mm, dtype=np.float32, offset=header_bytes, count=slots * self.slot_floats)
            self._data = data.reshape(slots, rows, k, vocab)
            self._tensor = torch.from_numpy(self._data)  # shares the mapping (no copy)
        elif owner:  # device memory of the target's GPU, shared with the drafter by a CUDA IPC handle
            self._data = None
            # zeros once (a memset at start-up): rows `assemble` leaves as they are (`unread`) then hold zeros
            # or an earlier q, finite floats like the host ring's (its unwritten pages read as zeros)
            self._tensor = torch.zeros(slots, rows, k, vocab, dtype=torch.float32, device=device)
            self.ipc = export_cuda_tensor(self._tensor)
        else:
            self._data = None
            self._tensor = import_cuda_tensor(ipc)
        self._next = 0
        self._finalizer = weakref.finalize(self, _remove, os.path.dirname(path) if owner else None)

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, rows: int, k: int, vocab: int, slots: int = SLOTS, base_dir: str | None = None,
               field: str = "saguaro.max_sampled_rows", device: str = "cpu") -> ProposalRing:
        """A new ring in a fresh private (0700) directory of `base_dir` (default: `ring_dir`'s choice); the
        caller owns it and must `close` it. Raises OSError (naming `field` and the fixes) when the directory
        cannot hold the ring's worst case. The file is sparse and nothing is pre-touched. With a CUDA
        `device` the slots are device memory there (`transport_for` decides) and the file holds the header."""
        size = ring_bytes(rows, k, vocab, slots) if device == "cpu" else _header_bytes(slots)
        if base_dir is None:
            base_dir, free = ring_dir(size)
        else:
            free = {base_dir: free_bytes(base_dir)}
            if free[base_dir] is None or free[base_dir] < size:
                base_dir = None
        if base_dir is None:
            raise OSError(shortage_message(rows, k, vocab, free, field, slots))
        d = tempfile.mkdtemp(prefix="saguaro-probs-", dir=base_dir)
        os.chmod(d, 0o700)
        try:
            return cls(os.path.join(d, "ring"), rows, k, vocab, slots, owner=True, device=device)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise

    @classmethod
    def attach(cls, spec: dict) -> ProposalRing:
        """The drafter's handle on the proposer's ring, from `spec()`."""
        return cls(spec["path"], int(spec["rows"]), int(spec["k"]), int(spec["vocab"]), int(spec["slots"]),
                   owner=False, device=spec.get("device", "cpu"), ipc=spec.get("ipc"))

    def spec(self) -> dict:
        out = {"path": self.path, "rows": self.rows, "k": self.k, "vocab": self.vocab, "slots": self.slots}
        if self.device != "cpu":
            out.update(device=self.device, ipc=self.ipc)
        return out

    def describe(self) -> str:
        """One phrase for the start-up log line: where, the shape and the reserved bytes."""
        where = (f"device memory of {self.device} (header in {os.path.dirname(os.path.dirname(self.path))})"
                 if self.device != "cpu" else os.path.dirname(os.path.dirname(self.path)))
        return (f"{where}, {self.slots} slots x {self.rows} rows x K={self.k} "
                f"x vocab {self.vocab} float32 = {gib(self.nbytes)} ({self.nbytes} bytes) reserved")

    def resident_bytes(self) -> int:
        """Bytes the slots use now: the file's written rows (sparse holes use nothing); device slots are
        allocated whole."""
        return os.stat(self.path).st_blocks * 512 if self.device == "cpu" else self.nbytes

    def close(self) -> None:
        """Unmap; the owner also removes the file and its directory. Views handed out must be dropped first."""
        self.header = self._data = self._tensor = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes when it does
            pass
        self._finalizer()

    # ---- drafter side ---------------------------------------------------------------------------------
    def acquire(self, seq: int) -> int | None:
        """A FREE slot, now WRITING for answer `seq` (round robin); None if the proposer holds them all."""
        for i in range(self.slots):
            s = (self._next + i) % self.slots
            if self.header[s, 0] == FREE:
                self.header[s, 1] = seq
                self.header[s, 0] = WRITING
                self._next = (s + 1) % self.slots
                return s
        return None

    def publish(self, slot: int) -> None:
        """The drafter finished writing `slot`: from now on the proposer holds it. Device slots: the
        drafter's copies into them (asynchronous, from its own GPU) complete first, so the proposer may read
        them on any stream (one host synchronisation per answer)."""
        if self.header[slot, 0] != WRITING:
            raise RuntimeError(f"proposal ring: publish of slot {slot} in state {int(self.header[slot, 0])}")
        if self.device != "cpu":
            torch.cuda.synchronize(self.device)
        self.header[slot, 0] = HELD

    def abandon(self, slot: int) -> None:
        """The drafter will not publish `slot` (its step failed): give it back."""
        if self.header[slot, 0] == WRITING:
            self.header[slot, 0] = FREE

    # ---- both sides -----------------------------------------------------------------------------------
    def slot(self, slot: int) -> torch.Tensor:
        """float32 `[rows, k, vocab]` tensor over the slot's memory (no copy)."""
        return self._tensor[slot]

    # ---- proposer side --------------------------------------------------------------------------------
    def held(self, slot: int, seq: int) -> bool:
        """Whether `slot` is HELD with the content of answer `seq` (else it must not be read)."""
        return 0 <= slot < self.slots and self.header[slot, 0] == HELD and self.header[slot, 1] == seq

    def release_held(self) -> None:
        """Give every HELD slot back to the drafter (vLLM no longer reads any of them: see module doc)."""
        held = self.header[:, 0] == HELD
        self.header[held, 0] = FREE


def _same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device


def transport_for(target_device: str, draft_device: str, peer_access=None) -> str:
    """Where sampled rows' q travels: "device" (slots in the target GPU's memory, written by the drafter's
    GPU over CUDA IPC and peer copies: no host round trip) when both sides are CUDA devices that can reach
    each other (the same device, or peer access), else "host" (the shared-memory file; a CUDA target then
    gets one copy of the used rows per step). `peer_access(a, b)`: default `torch.cuda.can_device_access_peer`."""
    if not (target_device.startswith("cuda") and draft_device.startswith("cuda")):
        return "host"
    a, b = torch.device(target_device).index or 0, torch.device(draft_device).index or 0
    if a == b:
        return "device"
    check = peer_access or torch.cuda.can_device_access_peer
    try:
        return "device" if check(a, b) and check(b, a) else "host"
    except (RuntimeError, AssertionError):  # a device not visible here
        return "host"


def export_cuda_tensor(t: torch.Tensor) -> dict:
    """A CUDA tensor's IPC handle as plain JSON (no pickle: it travels in the drafter's bootstrap file).
    torch's `reduce_tensor` gives the handle, sizes and offsets; types are named, bytes base64-encoded."""
    import base64

    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    b64 = lambda x: None if x is None else base64.b64encode(bytes(x)).decode()  # noqa: E731
    return {"size": list(size), "stride": list(stride), "offset": int(offset), "dtype": str(dtype).removeprefix(
        "torch."), "device": int(device), "handle": b64(handle), "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset), "ref_handle": b64(ref_handle), "ref_offset": int(ref_offset),
        "event_handle": b64(event_handle), "event_sync": bool(event_sync)}


def import_cuda_tensor(ipc: dict) -> torch.Tensor:
    """The tensor `export_cuda_tensor` described, opened in this process (`cudaIpcOpenMemHandle`). The
    device index is the exporter's: the drafter inherits the worker's `CUDA_VISIBLE_DEVICES`."""
    import base64

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    raw = lambda x: None if x is None else base64.b64decode(x)  # noqa: E731
    return rebuild_cuda_tensor(torch.Tensor, tuple(ipc["size"]), tuple(ipc["stride"]), ipc["offset"],
                               torch.UntypedStorage, getattr(torch, ipc["dtype"]), ipc["device"], raw(ipc["handle"]),
                               ipc["storage_bytes"], ipc["storage_offset"], False, raw(ipc["ref_handle"]),
                               ipc["ref_offset"], raw(ipc["event_handle"]), ipc["event_sync"])


def _remove(directory: str | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class SlotWriter:
    """The drafter's writes of one answer: slot rows handed out in order, one per sampled request row."""

    def __init__(self, ring: ProposalRing | None, seq: int):
        self.ring, self.seq = ring, seq
        self.slot = ring.acquire(seq) if ring is not None else None
        self.rows: list[int] = []  # answer row of each slot row, in order
        self._index: dict[int, int] = {}  # answer row -> its slot row
        self.written: dict[int, int] = {}  # answer row -> positions written in place (`put_positions`)

    @property
    def available(self) -> bool:
        return self.slot is not None

    def row_of(self, answer_row: int) -> int:
        """The slot row of `answer_row`, handing out the next one on first use."""
        r = self._index.get(answer_row)
        if r is None:
            if len(self.rows) >= self.ring.rows:
                raise RuntimeError(f"proposal ring: more than {self.ring.rows} sampled rows in one step")
            r = self._index[answer_row] = len(self.rows)
            self.rows.append(answer_row)
        return r

    def buffer(self) -> torch.Tensor:
        """The slot as float32 `[rows, k, vocab]` (writable)."""
        return self.ring.slot(self.slot)

    def put(self, answer_row: int, probs: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """Copy one row's q (`[n, vocab]` or n tensors of `[vocab]`) into its slot row."""
        r = self.row_of(answer_row)
        dest = self.ring.slot(self.slot)[r]
        if isinstance(probs, torch.Tensor):
            dest[: probs.shape[0]].copy_(probs)
        else:
            for pos, p in enumerate(probs):
                dest[pos].copy_(p)

    def put_rows(self, items: Sequence[tuple[int, Sequence[torch.Tensor] | torch.Tensor]]) -> None:
        """`put` for several rows: (answer row, its q rows). Where the q rows live on another device than the
        slot (a CUDA drafter, the host ring), they are stacked there and moved in one transfer instead of one
        synchronous copy per row and position (320 at batch 64, K=5); on the slot's device, copied row by row
        (stacking first would copy everything twice)."""
        flat = [(a, pos, p) for a, probs in items for pos, p in enumerate(probs)]
        if not flat:
            return
        if _same_device(flat[0][2], self.buffer()):
            for a, probs in items:
                self.put(a, probs)
            return
        self.put_positions([a for a, _, _ in flat], [pos for _, pos, _ in flat], torch.stack([p for _, _, p in flat]))

    def put_positions(self, answer_rows: Sequence[int], positions: Sequence[int], q: torch.Tensor) -> None:
        """Write row n of `q` `[n, vocab]` at position `positions[n]` of `answer_rows[n]`'s slot row: one
        batched write for a whole draft position (the K-step loop's q' goes straight into the slot)."""
        if not answer_rows:
            return
        buf = self.buffer()
        idx = torch.tensor([self.row_of(a) for a in answer_rows], dtype=torch.long)
        pos = torch.tensor(list(positions), dtype=torch.long)
        buf.index_put_((idx.to(buf.device), pos.to(buf.device)), q.to(device=buf.device, dtype=buf.dtype))
        for a, p in zip(answer_rows, positions, strict=True):
            self.written[a] = max(self.written.get(a, 0), p + 1)

    def compact(self, keep) -> None:
        """Drop the slot rows of answer rows for which `keep(row)` is false (e.g. their drafts were cut after
        writing), moving later rows up so the slot stays compact from row 0 (order kept)."""
        buf, kept = self.buffer(), []
        for old, a in enumerate(self.rows):
            if keep(a):
                if len(kept) != old:
                    buf[len(kept)].copy_(buf[old])
                kept.append(a)
            else:
                self.written.pop(a, None)
        self.rows = kept
        self._index = {a: r for r, a in enumerate(kept)}

    def finish(self) -> tuple[int, list[int]]:
        """(slot, rows) for the answer; publishes the slot, or frees it when nothing was written."""
        if self.slot is None:
            return -1, []
        if not self.rows:
            self.ring.abandon(self.slot)
            return -1, []
        self.ring.publish(self.slot)
        return self.slot, list(self.rows)

    def abandon(self) -> None:
        if self.slot is not None:
            self.ring.abandon(self.slot)
            self.slot = None


def assemble(slot: torch.Tensor, prob_rows: Sequence[int], drafts: Sequence[Sequence[int]],
             k: int, device: torch.device | str | None = None,
             unread: Collection[int] = ()) -> tuple[torch.Tensor, list[int]]:
    """The rejection sampler's `[rows, k, vocab]` proposal tensor for one step, inside the held `slot`.

    `prob_rows[r]`: the answer row whose q the drafter wrote into slot row r (its first len(drafts[row])
    positions). Every other answer row with drafts was chosen deterministically (greedy) and gets one-hot
    rows after them (q = 1 at the draft: exact for any deterministic choice). Returns the tensor (a view of
    the slot's first rows, no copy) and the answer row of each of its rows. Positions past a row's drafts
    are left as they are: vLLM reads only the drafts it schedules, never more than were proposed.

    `unread`: answer rows whose q vLLM never reads, i.e. requests the target decodes greedily (its rejection
    sampler verifies them against the target's argmax; their q only feeds a recovered token it discards). They
    still get a row (vLLM wants one for every request with drafts) but it is left as it is: no zero-fill of
    `[k, vocab]` floats per row and step (2.6 MB at a 128k vocabulary) when greedy and sampled requests share
    a batch. Rows of sampled requests with deterministic drafts (n-gram backups) still get their one-hot rows.

    `device` other than the slot's (a host ring feeding a CUDA target): the sampled rows are copied there in
    one transfer and the one-hot rows are built there, so greedy rows never cross as zeros.
    """
    m = len(prob_rows)
    sampled = set(prob_rows)
    greedy = [j for j, toks in enumerate(drafts) if toks and j not in sampled]
    rows = list(prob_rows) + greedy
    if len(rows) > slot.shape[0]:
        raise RuntimeError(f"proposal ring: {len(rows)} rows with drafts, slot has {slot.shape[0]}")
    if device is not None and not _same_device(slot, torch.empty(0, device=device)):
        out = torch.empty((len(rows), *slot.shape[1:]), dtype=slot.dtype, device=device)
        out[:m].copy_(slot[:m])
        if greedy:
            out[m:].zero_()
            out[m:][draft_positions([list(drafts[j])[:k] for j in greedy], device=out.device)] = 1.0
        return out, rows
    onehot = [n for n, j in enumerate(greedy) if j not in unread]
    if onehot:
        block = slot[m: m + len(greedy)]
        if len(onehot) == len(greedy):
            block.zero_()
            block[draft_positions([list(drafts[j])[:k] for j in greedy], device=block.device)] = 1.0
        else:
            at = torch.tensor(onehot, dtype=torch.long).to(block.device, non_blocking=True)
            block.index_fill_(0, at, 0.0)
            r, pos, tok = draft_positions([list(drafts[greedy[n]])[:k] for n in onehot], device=block.device)
            block[at[r], pos, tok] = 1.0
    return slot[: len(rows)], rows


def fit_rows(sampled: Sequence[int], drafts: Sequence[Sequence[int]], rows: int) -> tuple[list[int], list[int]]:
    """(kept, dropped): the sampled rows (rows of `drafts` with q, in slot order) that one slot of `rows` rows
    holds beside a one-hot row for every other row with drafts (`assemble`), and the rest, which must lose
    their drafts this step. Dropping sampled rows rather than deterministic ones loses the fewest rows'
    drafts: the one-hot rows are needed only while a sampled row is in the slot, so with more deterministic
    rows than the slot has, dropping every sampled row keeps all the others."""
    chosen = set(sampled)
    others = sum(1 for j, d in enumerate(drafts) if d and j not in chosen)
    room = max(0, rows - others)
    return list(sampled[:room]), list(sampled[room:])


def draft_positions(drafts: Sequence[Sequence[int]], device: torch.device | str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, position, token) index tensors of every draft token of `drafts`, for one gather or scatter.
    Built on the host; with a `device` other than the CPU, moved there in one non-blocking transfer (the host
    does not wait for the device, as it would for each of three tensors indexing a device tensor)."""
    lens = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
    n = int(lens.sum())
    idx = np.empty((3, n), dtype=np.int64)
    idx[0] = np.repeat(np.arange(len(drafts), dtype=np.int64), lens)
    idx[1] = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    idx[2] = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=n)
    out = torch.from_numpy(idx)
    if device is not None and torch.device(device).type != "cpu":
        out = out.to(device, non_blocking=True)
    return out[0], out[1], out[2]
