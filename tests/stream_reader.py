"""Streams greedy completions from a `vllm serve` and reports each chunk's arrival, as a process of its own.

The fault tests and benchmarks/fault_pauses.py measure the gaps between chunks as a user's client sees
them. On a 2-core machine such a client beside the server is itself a source of gaps: vLLM's engine core and
worker keep both cores busy once steps run without drafts, and a reader thread in the test's own process
waits for the GIL held by that process's other threads, which wait on the run queue, and reads chunks late
(benchmarks/notes.md "A drafter fault's pause"). This process holds nothing but the readers and runs them at real-time priority where
allowed (root or CAP_SYS_NICE), so each chunk is timed when the server sent it (give or take the network
stack), not when a busy test process got round to it.

    python tests/stream_reader.py URL MAX_TOKENS PROMPT_JSON...
Prints one JSON line per event: {"i": stream, "t": time.monotonic(), "text": ...} per chunk, {"i", "error"}
on a failure, {"i", "done": true} at a stream's end, and first {"realtime": bool}.
"""
from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
import urllib.parse


def realtime() -> bool:
    """SCHED_FIFO for this process (threads started later inherit it); False where not allowed."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return True
    except (OSError, AttributeError):
        return False


def stream(url: str, prompt: str, max_tokens: int, on_text, timeout_s: float = 120.0) -> None:
    """One streamed greedy completion read with the standard library: `on_text(text)` per SSE chunk."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    body = json.dumps({"model": "tiny", "prompt": prompt, "stream": True, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True})
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk['error']}")
            on_text(chunk["choices"][0]["text"] if chunk.get("choices") else "")
    finally:
        conn.close()


def main(argv: list[str]) -> int:
    url, max_tokens, prompts = argv[0], int(argv[1]), [json.loads(p) for p in argv[2:]]
    lock = threading.Lock()

    def emit(event: dict) -> None:
        line = json.dumps(event)
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    emit({"realtime": realtime()})

    def run(i: int) -> None:
        try:
            stream(url, prompts[i], max_tokens, lambda text: emit({"i": i, "t": time.monotonic(), "text": text}))
        except Exception as err:  # reported, asserted by the caller
            emit({"i": i, "error": f"{type(err).__name__}: {err}"})
        emit({"i": i, "done": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
