"""Load a draft model from a Hugging Face directory (`config.json` + safetensors, sharded or not).

`read_model_info` is cheap (no weights read) and raises the same errors as loading, so the engine can
refuse a bad draft before anything starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from saguaro_vllm.drafter.model.config import DraftModelConfig
from saguaro_vllm.drafter.model.layers import MergedLinear
from saguaro_vllm.drafter.model.llama import LlamaForCausalLM
from saguaro_vllm.drafter.model.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_SKIPPED_KEYS = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_info(path: str | Path) -> DraftModelConfig:
    """Parse and validate a draft model directory without reading its weights."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(
            f"draft model path {root} is not a directory; pass a local Hugging Face model directory "
            "(config.json + *.safetensors), e.g. one downloaded with `huggingface-cli download`"
        )
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ValueError(f"draft model {root} has no config.json; point to the directory that holds it")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"draft model {root}: config.json is not valid JSON ({e})") from None
    try:
        cfg = DraftModelConfig.from_hf(hf, str(root))
    except KeyError as e:
        raise ValueError(f"draft model {root}: config.json lacks the required field {e.args[0]!r}") from None
    weight_files(root)
    return cfg


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its shard index when there is one."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"draft model {root}: shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"draft model {root} has no *.safetensors weights; the drafter reads safetensors only "
            "(convert a .bin checkpoint with `model.save_pretrained(dir, safe_serialization=True)`)"
        )
    return files


def load_draft_model(
    path: str | Path, dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str = "cpu"
) -> LlamaForCausalLM:
    """Build the model for `path` directly in `dtype` on `device` and fill it from the checkpoint."""
    dtype, device = resolve_dtype(dtype), resolve_device(device)
    cfg = read_model_info(path)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg)
    # Materialise uninitialised storage at the target dtype/device: every tensor is then overwritten.
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    _load_weights(model, Path(path))
    return model.eval().requires_grad_(False)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype or its name; only the dtypes the draft kernels are written for."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"draft dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(device: torch.device | str) -> torch.device:
    """`cpu` or an existing `cuda:N`; a clear error instead of a CUDA failure deep in loading."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"draft device {device} is not available "
                             f"({torch.cuda.device_count()} CUDA devices visible)")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"draft device {device} is not supported; use cpu or cuda:N")
    return dev


def _load_weights(model: LlamaForCausalLM, root: Path) -> None:
    params = dict(model.named_parameters())
    expected = _expected_targets(model, params)
    loaded: set[tuple[str, str | None]] = set()
    skip_lm_head = model.config.tie_word_embeddings
    for file in weight_files(root):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_SKIPPED_KEYS) or (skip_lm_head and key == "lm_head.weight"):
                    continue
                name, shard = _target(model, key)
                if name not in params:
                    raise ValueError(f"draft model {root}: unexpected tensor {key!r} in {file.name}")
                _copy_into(model, name, shard, params[name], f.get_tensor(key), root, key)
                loaded.add((name, shard))
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"draft model {root}: checkpoint lacks tensors {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _target(model: LlamaForCausalLM, key: str) -> tuple[str, str | None]:
    """Map a checkpoint key to (our parameter name, shard of a fused weight or None)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in model.stacked_params:
            fused, shard = model.stacked_params[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return key, None


def _expected_targets(model: nn.Module, params: dict[str, nn.Parameter]) -> set[tuple[str, str | None]]:
    expected: set[tuple[str, str | None]] = set()
    for name in params:
        owner = model.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, MergedLinear):
            expected.update((name, shard) for shard in owner.shard_sizes)
        else:
            expected.add((name, None))
    return expected


def _copy_into(
    model: nn.Module,
    name: str,
    shard: str | None,
    param: nn.Parameter,
    tensor: torch.Tensor,
    root: Path,
    key: str,
) -> None:
    if shard is None:
        if tensor.shape != param.shape:
            raise ValueError(f"draft model {root}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        return
    try:
        model.get_submodule(name.rpartition(".")[0]).load_shard(param, shard, tensor)
    except ValueError as e:
        raise ValueError(f"draft model {root}: tensor {key!r}: {e}") from None
