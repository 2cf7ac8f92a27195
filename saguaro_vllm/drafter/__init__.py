"""The drafter: the draft model runtime that runs in its own process (plain torch, no vLLM import).

Kept import-light on purpose: submodules pull in torch and the model code only when used.
"""
