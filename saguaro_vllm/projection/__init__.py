"""Trace-driven projection (`saguaro-vllm project`, `saguaro-vllm calibrate`): replay a recorded run through
the product's own policy code under another cost model (docs/projection.md)."""
