"""Command-line tools that run outside any engine: the `saguaro-vllm` CLI, the demo run and the
`vllm serve` subprocess helper the benchmarks and tests use."""
