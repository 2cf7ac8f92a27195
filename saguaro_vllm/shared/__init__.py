"""What the worker and the drafter process both import: the message types and channel between them,
the proposal ring, CPU core pinning, and the msgspec stand-in for a drafter without vLLM."""
