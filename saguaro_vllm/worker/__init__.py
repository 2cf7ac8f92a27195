"""Code that runs inside vLLM's worker process: the proposer vLLM calls each step, its client of the
drafter process, the client's restart policy, and the Prometheus metrics."""
