"""`saguaro-vllm doctor [--speculative-config FILE] [MODEL]`: what a user runs before serving.

One line per check, OK / WARN / FAIL, each problem with its fix: vLLM (version, reviewed patch targets, model
runner), torch and CUDA, the GPUs visible, peer access between the target's and the draft's GPUs, the ops
(built or loadable, which implementation each device uses), and with a speculative config: its placement
(CPU cores or devices), the drafter's KV memory, the proposal ring against /dev/shm, and the draft's
architecture and vocabulary against the target `MODEL`'s. The config checks are the front end's own
(`frontend/resolve.py`), so doctor and `vllm serve` agree. Exit code 1 when a check fails.

What the machine has comes from one `Machine` (vLLM's platform, torch's CUDA view, peer access), which the
tests replace by a described fake to check the GPU paths on CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclasses.dataclass
class Check:
    status: str
    name: str
    message: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


@dataclasses.dataclass
class Machine:
    """What doctor reads of the machine: vLLM's platform, torch's CUDA view and peer access."""

    cpu_platform: bool
    cuda_build: str | None  # torch.version.cuda
    gpus: list[str]  # names of the visible CUDA devices
    peer_access: Callable[[int, int], bool]

    @classmethod
    def detect(cls) -> Machine:
        import torch

        cpu_platform = not torch.cuda.is_available()  # without vLLM: what torch sees
        if importlib.util.find_spec("vllm") is not None:
            from vllm.platforms import current_platform

            cpu_platform = current_platform.is_cpu()
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(cpu_platform, torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(count)],
                   torch.cuda.can_device_access_peer)


def check_vllm() -> list[Check]:
    from saguaro_vllm import patches
    from saguaro_vllm.patches import compat

    if importlib.util.find_spec("vllm") is None:
        return [Check(FAIL, "vLLM", "not installed.", f"{patches.SUPPORTED_INSTALL}.")]
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("vllm")
    except PackageNotFoundError:
        installed = patches.installed_vllm_version()
    out = []
    try:
        patches.check_vllm_version(installed)
    except patches.UnsupportedVLLMVersion as err:
        out.append(Check(FAIL, "vLLM", f"{installed}: outside the supported range ({patches.supported_range()}); "
                                       "the plugin leaves vLLM unpatched and refuses method 'saguaro'.",
                         f"{patches.SUPPORTED_INSTALL}."))
        del err
    else:
        try:
            bad = [r for r in compat.check(compat.installed_vllm_root(), installed) if r.status != "ok"]
        except KeyError:
            out.append(Check(WARN, "vLLM", f"{installed}: in the supported range, but its patch targets were "
                                           "never reviewed (no fingerprints for this release).",
                             "use a reviewed release (docs/vllm-compat.md) or run scripts/check_vllm_compat.py."))
        else:
            out.append(Check(FAIL, "vLLM", f"{installed}: patch targets differ from the reviewed ones: "
                                           + "; ".join(f"{r.target} {r.status}" for r in bad) + ".",
                             "install the reviewed release (docs/vllm-compat.md).") if bad else
                       Check(OK, "vLLM", f"{installed} (supported {patches.supported_range()}; every patch "
                                         "target as reviewed)."))
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip()
    if forced not in ("", "0"):
        out.append(Check(FAIL, "model runner", f"VLLM_USE_V2_MODEL_RUNNER={forced} forces Model Runner V2, which "
                                               "has no custom_class proposers: method 'saguaro' is refused.",
                         "unset VLLM_USE_V2_MODEL_RUNNER, or set it to 0."))
    else:
        out.append(Check(OK, "model runner", "V1 for Saguaro (vLLM falls back from V2 for custom_class "
                                             "proposers by itself)."))
    return out


def check_torch(machine: Machine) -> list[Check]:
    import torch

    if machine.cpu_platform:
        where = "vLLM's CPU platform"
        if machine.gpus:
            return [Check(WARN, "torch", f"{torch.__version__} on {where}, but {len(machine.gpus)} GPU(s) are "
                                         "visible and unused.", "install the GPU build: pip install "
                                                                "'saguaro-vllm[gpu]'.")]
        return [Check(OK, "torch", f"{torch.__version__} on {where} (no CUDA).")]
    if not machine.cuda_build:
        return [Check(FAIL, "torch", f"{torch.__version__} has no CUDA, but vLLM's platform is a GPU one.",
                      "install the torch build vLLM's wheel asks for (pip install 'saguaro-vllm[gpu]').")]
    return [Check(OK, "torch", f"{torch.__version__}, CUDA {machine.cuda_build}.")]


def check_gpus(machine: Machine) -> list[Check]:
    if machine.cpu_platform:
        return [Check(OK, "GPUs", "none needed (CPU serving).")]
    if not machine.gpus:
        return [Check(FAIL, "GPUs", "no CUDA device visible.", "check CUDA_VISIBLE_DEVICES and the driver "
                                                               "(nvidia-smi).")]
    names = ", ".join(f"cuda:{i} {n}" for i, n in enumerate(machine.gpus))
    return [Check(OK, "GPUs", f"{len(machine.gpus)} visible: {names}.")]


def check_ops(machine: Machine) -> list[Check]:
    from saguaro_vllm.ops import loader

    status = loader.status()
    if status.policy == "reference":
        state = Check(WARN, "ops", "SAGUARO_OPS=reference: every op runs its plain-torch reference (slow).",
                      "unset SAGUARO_OPS.")
    elif not status.loaded:
        state = Check(WARN if status.policy == "auto" else FAIL, "ops",
                      f"not built or not loadable ({(status.error or '').splitlines()[-1:] or 'no error'}); the "
                      "plain-torch references run instead (slow).",
                      "install a C++ compiler and ninja (pip install ninja), then rerun doctor.")
    else:
        state = Check(OK, "ops", f"loaded from {status.library}" + (" (with CUDA kernels)." if status.with_cuda
                                                                    else " (CPU kernels)."))
    out = [state]
    for dev in ["cpu"] + ([] if machine.cpu_platform or not machine.gpus else ["cuda"]):
        active = loader.active(dev)
        out.append(Check(OK, f"ops on {dev}", ", ".join(f"{op} {impl}" for op, impl in active.items()) + "."))
    return out


@dataclasses.dataclass
class _Target:
    """What the front-end checks read of the target model (the fields of vLLM's ModelConfig they use)."""

    model: str
    vocab: int
    max_model_len: int
    dtype: str = "bfloat16"

    def get_vocab_size(self) -> int:
        return self.vocab


def _target(model: str) -> tuple[_Target, list[str]]:
    path = pathlib.Path(os.path.expanduser(model))
    if not path.is_dir():
        from huggingface_hub import hf_hub_download

        path = pathlib.Path(hf_hub_download(model, "config.json")).parent
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return (_Target(str(path), int(text["vocab_size"]), int(text.get("max_position_embeddings", 2048)),
                    str(text.get("torch_dtype", text.get("dtype", "bfloat16")))),
            list(cfg.get("architectures") or []))


def check_config(path: str, model: str | None, machine: Machine, tp: int, pp: int,
                 max_num_seqs: int | None) -> list[Check]:
    from saguaro_vllm.drafter.kv_cache import kv_bytes_per_block
    from saguaro_vllm.drafter.model.loader import DTYPES, read_model_info
    from saguaro_vllm.frontend import resolve
    from saguaro_vllm.frontend.config import SaguaroConfigError, load_speculative_config_arg, \
        parse_speculative_config
    from saguaro_vllm.shared.proposal_buffers import SHM_DIR, gib, ring_bytes, ring_dir, ring_rows

    try:
        cfg, _ = parse_speculative_config(load_speculative_config_arg(path))
    except (SaguaroConfigError, ValueError) as err:
        return [Check(FAIL, "config", str(err), "correct the field named.")]
    out = [Check(OK, "config", f"{path}: mode {cfg.saguaro.mode}, K={cfg.num_speculative_tokens}.")]
    # Placement: the drafter's device (or cores) as the front end chooses it.
    try:
        device = resolve.resolve_device(cfg, machine.cpu_platform, tp, pp, gpu_count=len(machine.gpus))
    except SaguaroConfigError as err:
        return out + [Check(FAIL, "placement", str(err))]
    if device == "cpu":
        try:
            placement = resolve.resolve_cpu_placement(cfg, tp * pp if machine.cpu_platform else 1)
        except SaguaroConfigError as err:
            out.append(Check(FAIL, "placement", str(err)))
        else:
            ranks = " | ".join(",".join(map(str, r)) for r in placement.ranks) if machine.cpu_platform else "GPUs"
            out.append(Check(WARN if placement.shared else OK, "placement",
                             f"drafter on CPU cores {placement.draft}; target ranks on {ranks}"
                             + (f"; cores {placement.shared} shared (share_cores)." if placement.shared else "."),
                             "give the drafter cores of its own (saguaro.draft_cores / target_cores)."
                             if placement.shared else ""))
    else:
        used = list(range(tp * pp))
        out.append(Check(OK, "placement", f"target on cuda:{used[0]}..cuda:{used[-1]}, drafter on {device}"
                                          + (" (shared with the target)." if int(device[5:]) in used else ".")))
    out.append(_peer_check(device, tp * pp, machine))
    # The draft against the target.
    try:
        draft_dir = resolve.resolve_draft_path(cfg.model, None, cfg.revision)
    except (SaguaroConfigError, OSError, ValueError) as err:
        return out + [Check(FAIL, "draft", str(err), "give a local draft directory or a reachable hub id.")]
    info = read_model_info(draft_dir)
    if model is None:
        out.append(Check(WARN, "draft", f"{draft_dir}: {info.architecture}, vocabulary {info.vocab_size}; no "
                                        "target MODEL given, so not compared.", "pass the target: saguaro-vllm "
                                                                                "doctor --speculative-config FILE MODEL."))
        target = None
    else:
        try:
            target, archs = _target(model)
            checked = resolve.check_draft(draft_dir, target)
        except SaguaroConfigError as err:
            out.append(Check(FAIL, "draft", str(err)))
            target = None
        except (OSError, ValueError, KeyError) as err:
            out.append(Check(FAIL, "target", f"{model}: cannot read its config.json ({err}).",
                             "pass a local model directory or a reachable hub id."))
            target = None
        else:
            out.append(Check(OK, "draft", f"{checked['architecture']}, vocabulary {checked['vocab_size']}: the "
                                          f"target's ({', '.join(archs) or 'architecture unknown'}, "
                                          f"{target.vocab}), same tokenizer."))
    # The drafter's KV cache.
    kv = resolve.resolve_kv_cache_gb(cfg, device, tp, pp)
    dtype = DTYPES.get(cfg.saguaro.dtype, DTYPES["float32"]) if cfg.saguaro.dtype != "auto" else DTYPES["bfloat16"]
    per_block = kv_bytes_per_block(info.num_layers, cfg.saguaro.block_size, info.num_kv_heads, info.head_size,
                                   dtype)
    longest = min(target.max_model_len if target else 2**31, cfg.max_model_len or 2**31)
    if kv == "auto":
        out.append(Check(OK, "KV memory", f"sized by the drafter from {device}'s free memory after loading."))
    else:
        import psutil

        tokens = int(kv * 2**30) // per_block * cfg.saguaro.block_size
        free = psutil.virtual_memory().available
        if device == "cpu" and kv * 2**30 > free:
            out.append(Check(FAIL, "KV memory", f"saguaro.kv_cache_gb={kv} GiB, but {gib(free)} of memory is "
                                                "available.", "lower saguaro.kv_cache_gb."))
        elif tokens < min(longest, 2**30):
            out.append(Check(WARN, "KV memory", f"{kv} GiB holds {tokens} draft tokens, fewer than one "
                                                f"max-length context ({longest}).",
                             f"raise saguaro.kv_cache_gb to {per_block * -(-longest // cfg.saguaro.block_size) / 2**30:.3g}."))
        else:
            out.append(Check(OK, "KV memory", f"{kv} GiB on {device}: {tokens} draft tokens."))
    # The proposal ring (sampled rows' q) against /dev/shm.
    rows = ring_rows(cfg.saguaro.max_sampled_rows, max_num_seqs if max_num_seqs is not None else 2**31)
    if rows == 0:
        out.append(Check(OK, "/dev/shm", "no proposal ring (saguaro.max_sampled_rows 0)."))
    else:
        size = ring_bytes(rows, cfg.num_speculative_tokens, info.vocab_size)
        where, free = ring_dir(size)
        shm = free.get(SHM_DIR)
        need = f"the ring's worst case is {gib(size)} ({rows} rows x K={cfg.num_speculative_tokens} x vocabulary " \
               f"{info.vocab_size})"
        fix = (f"give the container more shared memory (docker run --shm-size={-(-size // 2**30) + 1}g or "
               "--ipc=host), or lower saguaro.max_sampled_rows / --max-num-seqs.")
        if where == SHM_DIR:
            out.append(Check(OK, "/dev/shm", f"{need}; {gib(shm)} free."))
        elif where is not None:
            out.append(Check(WARN, "/dev/shm", f"{need}; /dev/shm has "
                                               f"{'no writable directory' if shm is None else gib(shm) + ' free'}, "
                                               f"so it goes to {where} (disk-backed).", fix))
        else:
            out.append(Check(FAIL, "/dev/shm", f"{need}; no directory can hold it.", fix))
    return out


def _peer_check(device: str, used: int, machine: Machine) -> Check:
    if not device.startswith("cuda"):
        return Check(OK, "peer access", "not needed (the drafter runs on the CPU).")
    draft = int(device.split(":")[1])
    missing = [t for t in range(used) if t != draft
               and not (machine.peer_access(t, draft) and machine.peer_access(draft, t))]
    if not missing:
        return Check(OK, "peer access", f"{device} and the target's GPUs reach each other (proposal ring on the "
                                        "target's GPU).")
    return Check(WARN, "peer access", f"no peer access between {device} and cuda:{missing}: sampled rows' "
                                      "proposal probabilities go through host memory (one copy per step).",
                 "place the drafter on a GPU with NVLink/P2P to the target's, or share one of the target's GPUs.")


def run_doctor(config: str | None, model: str | None, tp: int = 1, pp: int = 1, max_num_seqs: int | None = None,
               machine: Machine | None = None) -> list[Check]:
    machine = machine or Machine.detect()
    checks = check_vllm() + check_torch(machine) + check_gpus(machine) + check_ops(machine)
    if config:
        checks += check_config(config, model, machine, tp, pp, max_num_seqs)
    else:
        checks.append(Check(WARN, "config", "no --speculative-config given: placement, KV memory, /dev/shm and "
                                            "the draft were not checked.",
                            "saguaro-vllm doctor --speculative-config FILE MODEL."))
    return checks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="the target model (local directory or hub id) the draft must match")
    p.add_argument("--speculative-config", dest="config", help="the Saguaro speculative config: a JSON file or "
                   "inline JSON, as given to vllm serve")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="the target's (default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="the target's (default 1)")
    p.add_argument("--max-num-seqs", type=int, help="the engine's, which bounds the proposal ring (default: the "
                   "ring's cap)")


def run(args: argparse.Namespace) -> int:
    checks = run_doctor(args.config, args.model, args.tensor_parallel_size, args.pipeline_parallel_size,
                        args.max_num_seqs)
    for c in checks:
        print(c.line())
    failed = sum(c.status == FAIL for c in checks)
    print(f"{len(checks)} checks: {failed} failed, {sum(c.status == WARN for c in checks)} warnings")
    return 1 if failed else 0
