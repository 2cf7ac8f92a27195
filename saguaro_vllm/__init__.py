"""saguaro-vllm: Speculative Speculative Decoding (SSD / Saguaro) for vLLM.

Importing this package is cheap and does not import vLLM; the vLLM integration is applied by
`saguaro_vllm.plugin.register`, which vLLM calls through the `vllm.general_plugins` entry point.
"""

__version__ = "0.1.0"
