"""Code that runs before the engine starts, in the process that parses the user's configuration
(`vllm serve`'s API server or `LLM(...)`): the config model and its resolution against vLLM (draft path, vocabulary, device, CPU cores)."""
