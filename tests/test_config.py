"""Bad Saguaro configs fail in the front end, before any engine process starts, with one message that names
the field and the fix: through vLLM's own `EngineArgs.create_engine_config` (plugin patches applied) and
through the `vllm serve` command line. vLLM's own speculative keys are passed through or refused, each
with its reason."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import pathlib
import subprocess
import time

import pytest

from saguaro_vllm.frontend.config import ASYNC_ONLY, SaguaroConfigError, SaguaroOptions, load_speculative_config_arg, \
    parse_speculative_config
from saguaro_vllm.frontend.vllm_spec_keys import NEW_IN_0_33, PASSED_THROUGH, REFUSED, SAGUARO_FIELDS

TARGET_MAX_LEN = 256


def _on_this_build(spec):
    """`spec` as these tests mean it: on a CUDA build of vLLM a drafter without a `device` runs on the CPU, so
    that the front-end checks here do not depend on how many GPUs the machine has (`auto` would need a free
    GPU); on the CPU build (where `auto` is the CPU anyway) `spec` is unchanged."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or not isinstance(spec, dict) or not isinstance(spec.get("saguaro", {}), dict):
        return spec
    opts = spec.get("saguaro", {})
    return spec if "device" in opts else {**spec, "saguaro": {**opts, "device": "cpu"}}


@pytest.fixture(scope="module")
def engine_config():
    """Run vLLM's real front-end config path (plugin patches applied) and return its result or error."""
    from vllm.engine.arg_utils import EngineArgs

    def create(target: str, spec, **engine_kwargs) -> object:
        args = EngineArgs(model=target, speculative_config=_on_this_build(spec), enforce_eager=True,
                          max_model_len=TARGET_MAX_LEN, dtype="float32", **engine_kwargs)
        return args.create_engine_config()

    return create


def _assert_no_engine_started():
    assert not multiprocessing.active_children(), "an engine process was started"


def _full(draft: str, spec: dict) -> dict:
    """The base config (K=3) with `spec`'s keys on top; its "saguaro" object merged into the base's."""
    spec = dict(spec)
    full = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3}
    if "saguaro" in spec:
        full["saguaro"] = spec.pop("saguaro")
    return {**full, **spec}


def test_valid_config_resolves(tiny_pair, engine_config):
    target, draft = tiny_pair
    cfg = engine_config(target, {"method": "saguaro", "model": draft, "num_speculative_tokens": 3,
                                 "saguaro": {"mode": "sync"}})
    spec = cfg.speculative_config
    assert spec.method == "custom_class" and spec.num_speculative_tokens == 3
    resolved = cfg.additional_config["saguaro"]
    assert resolved["draft_path"] == str(pathlib.Path(draft).resolve())
    assert resolved["device"] == "cpu" and resolved["draft_cores"]
    _assert_no_engine_started()


def test_dashed_keys_accepted_at_every_level(tiny_pair, engine_config):
    """`fanout-budget` means `fanout_budget` in the nested object too, as `num-speculative-tokens` does at the
    top level (vLLM's command line spells keys with dashes)."""
    target, draft = tiny_pair
    cfg = engine_config(target, {"method": "saguaro", "model": draft, "num-speculative-tokens": 2,
                                 "saguaro": {"mode": "async", "fanout-budget": 4, "kv-cache-gb": 0.25}})
    opts = cfg.additional_config["saguaro"]["saguaro"]
    assert (cfg.speculative_config.num_speculative_tokens, opts["fanout_budget"], opts["kv_cache_gb"]) == (2, 4, 0.25)


def test_sampling_scale_auto_reaches_the_drafter_options(tiny_pair, engine_config):
    target, draft = tiny_pair
    cfg = engine_config(target, _full(draft, {"saguaro": {"mode": "async", "sampling_scale": "auto",
                                                          "sampling_scale_tokens": "fanout+1"}}))
    opts = cfg.additional_config["saguaro"]["saguaro"]
    assert (opts["sampling_scale"], opts["sampling_scale_tokens"]) == ("auto", "fanout+1")


def test_vllm_keys_passed_through(tiny_pair, engine_config):
    target, draft = tiny_pair
    cfg = engine_config(target, _full(draft, {"rejection_sample_method": "standard", "draft_tensor_parallel_size": 1,
                                              "max_model_len": 200}))
    assert cfg.speculative_config.rejection_sample_method == "standard"
    assert cfg.speculative_config.draft_tensor_parallel_size == 1
    assert cfg.additional_config["saguaro"]["max_model_len"] == 200  # honoured by the drafter


# (the config's keys over the base {"method": "saguaro", "model": DRAFT, "num_speculative_tokens": 3},
#  what the one error line starts with, a piece of the fix it must name)
BAD = [
    # wrong types (strict: no silent coercion)
    ({"num_speculative_tokens": "5"}, "speculative_config.num_speculative_tokens:", "must be an integer"),
    ({"num_speculative_tokens": 4.0}, "speculative_config.num_speculative_tokens:", "must be an integer"),
    ({"saguaro": {"kv_cache_gb": "1"}}, "speculative_config.saguaro.kv_cache_gb:", "must be a number"),
    ({"saguaro": {"mode": "async", "finish_predraft": "yes"}}, "speculative_config.saguaro.finish_predraft:",
     "must be true or false"),
    ({"saguaro": ["mode", "async"]}, "speculative_config.saguaro:", "must be a JSON object"),
    ({"saguaro": {"mode": "async", "fanout": [1, "a", 1, 1]}}, "speculative_config.saguaro.fanout[1]:",
     "must be an integer"),
    # unknown keys, dashes
    ({"saguaro": {"fan_out": 3}}, "speculative_config.saguaro.fan_out: unknown key", "allowed keys here: mode"),
    ({"unknown_top": 1}, "speculative_config.unknown_top: unknown key", "allowed keys here: method"),
    ({"saguaro": {"mode": "async", "fanout-budget": 2, "fanout_budget": 3}},
     "speculative_config.saguaro.fanout_budget: given twice", "keep one"),
    ({"saguaro": {"mode": "ssd"}}, "speculative_config.saguaro.mode:", "must be 'sync' or 'async'"),
    # impossible fan-outs
    ({"saguaro": {"mode": "async", "fanout": [1, 1]}}, "speculative_config.saguaro.fanout needs K+1 = 4 numbers",
     "give 4 numbers"),
    ({"saguaro": {"mode": "async", "fanout": [2, -1, 1, 1]}}, "speculative_config.saguaro.fanout:",
     "non-negative numbers summing to 1..256"),
    ({"saguaro": {"mode": "async", "miss_fanout": [0, 0, 0, 0]}}, "speculative_config.saguaro.miss_fanout:",
     "summing to 1..256"),
    ({"saguaro": {"mode": "async", "fanout_budget": 0}}, "speculative_config.saguaro.fanout_budget:",
     "between 1 and 256"),
    ({"saguaro": {"mode": "async", "fanout": [1, 1, 1, 1], "fanout_budget": 4}},
     "speculative_config.saguaro.fanout_budget: has no effect when saguaro.fanout is set", "remove"),
    ({"saguaro": {"mode": "async", "backup": "jit", "miss_fanout": [1, 1, 1, 1]}},
     "speculative_config.saguaro.miss_fanout:", "set backup to 'auto' or 'ngram'"),
    ({"saguaro": {"mode": "async", "sampling_scale": 1.5}}, "speculative_config.saguaro.sampling_scale:",
     "must lie in [0, 1]"),
    ({"saguaro": {"mode": "async", "sampling_scale": "half"}}, "speculative_config.saguaro.sampling_scale:",
     'or "auto"'),
    ({"saguaro": {"mode": "async", "sampling_scale_tokens": "fanout+1"}},
     "speculative_config.saguaro.sampling_scale_tokens:", "set sampling_scale below 1"),
    ({"saguaro": {"mode": "async", "depth": "deep"}}, "speculative_config.saguaro.depth:", "'fixed' or 'auto'"),
    ({"saguaro": {"mode": "sync", "depth": "auto"}}, "speculative_config.saguaro.depth: only used with mode",
     "async"),
    # K
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens:", "between 1 and 32"),
    ({"num_speculative_tokens": 99}, "speculative_config.num_speculative_tokens:", "between 1 and 32"),
    # the draft
    ({"model": "/nonexistent/draft"}, "speculative_config.model: draft model '/nonexistent/draft' not found",
     "local Hugging Face model directory"),
    ({"model": None}, "speculative_config.model:", "must be a string"),
    ({"revision": "main"}, "speculative_config.revision:", "remove revision, or give a hub id as model"),
    # devices, cores, memory
    pytest.param({"saguaro": {"device": "cuda:3"}}, "speculative_config.saguaro.device:", "use 'cpu' (or 'auto')",
                 marks=pytest.mark.cpu_build_only),
    ({"saguaro": {"device": "tpu"}}, "speculative_config.saguaro.device:", "'cuda:N'"),
    ({"saguaro": {"draft_cores": [999]}}, "speculative_config.saguaro.draft_cores:", "available"),
    ({"saguaro": {"draft_cores": [0], "target_cores": [0]}}, "speculative_config.saguaro.draft_cores:",
     "disjoint"),
    ({"saguaro": {"kv_cache_gb": 1e-9}}, "speculative_config.saguaro.kv_cache_gb:", "holds no KV block"),
    ({"saguaro": {"kv_cache_gb": 0}}, "speculative_config.saguaro.kv_cache_gb:", 'or "auto"'),
    ({"saguaro": {"kv_cache_gb": "half"}}, "speculative_config.saguaro.kv_cache_gb:", "must be a number of GiB"),
    ({"saguaro": {"block_size": 7}}, "speculative_config.saguaro.block_size:", "one of 8, 16, 32, 64, 128"),
    ({"saguaro": {"max_sampled_rows": -1}}, "speculative_config.saguaro.max_sampled_rows:", 'or "auto"'),
    ({"saguaro": {"max_sampled_rows": "64"}}, "speculative_config.saguaro.max_sampled_rows:", "integer >= 0"),
    # async-only options with mode sync
    ({"saguaro": {"mode": "sync", "fanout_budget": 2}},
     "speculative_config.saguaro.fanout_budget: only used with mode 'async'",
     "set saguaro.mode to 'async', or remove fanout_budget"),
    ({"saguaro": {"mode": "sync", "backup": "ngram"}}, "speculative_config.saguaro.backup: only used with mode "
     "'async'", "or remove backup"),
    # vLLM's own keys: refused with their reason, or passed through with the values that work
    ({"draft_tensor_parallel_size": 2}, "speculative_config.draft_tensor_parallel_size: only 1 works",
     "saguaro.device"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 3]]},
     "speculative_config.num_speculative_tokens_per_batch_size: vLLM's key is not supported", "remove it"),
    ({"rejection_sample_method": "synthetic"}, "speculative_config.rejection_sample_method: only 'standard'",
     "outputs change"),
    ({"quantization": "fp8"}, "speculative_config.quantization: vLLM's key is not supported",
     "saguaro.linear to 'int8'"),
    ({"prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max:", "saguaro.backup 'ngram'"),
    ({"max_model_len": 1000}, "speculative_config.max_model_len: 1000 is more than the target's", "at most 256"),
]


@pytest.mark.parametrize(("spec", "field", "fix"), BAD, ids=[
    f"{i}-{(b.values if hasattr(b, 'values') else b)[1].split(':')[0][19:]}" for i, b in enumerate(BAD)])
def test_bad_config_one_message_naming_field_and_fix(tiny_pair, engine_config, spec, field, fix):
    target, draft = tiny_pair
    with pytest.raises(SaguaroConfigError) as err:
        engine_config(target, _full(draft, spec))
    lines = [line.strip() for line in str(err.value).splitlines() if line.strip().startswith("speculative_config.")]
    assert len(lines) == 1, str(err.value)
    assert lines[0].startswith(field), lines[0]
    assert fix in lines[0], lines[0]
    _assert_no_engine_started()


def test_vocab_mismatch_is_refused(tmp_path, tiny_pair, engine_config):
    from tiny_models import _save_llama

    target, _ = tiny_pair
    other = tmp_path / "other-vocab"
    other.mkdir()
    _save_llama(other, None, vocab=77, seed=3)
    with pytest.raises(SaguaroConfigError, match=r"speculative_config.model: the draft's vocabulary \(77.*use a draft"):
        engine_config(target, {"method": "saguaro", "model": str(other), "num_speculative_tokens": 2})
    _assert_no_engine_started()


def test_every_vllm_speculative_key_has_a_decision():
    """A vLLM upgrade that adds a speculative key fails here until the key is passed through or refused."""
    from vllm.config import SpeculativeConfig

    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    decided = set(PASSED_THROUGH) | set(REFUSED) | set(SAGUARO_FIELDS)
    assert names - decided == set()
    assert set(REFUSED) - names <= set(NEW_IN_0_33), "refusing keys no supported vLLM has"


def test_async_only_options_say_so():
    for name in ASYNC_ONLY:
        assert "`async` only" in SaguaroOptions.model_fields[name].description, name


def test_vllm_serve_refuses_bad_config_before_any_engine(tiny_pair):
    """The command line: a quick non-zero exit, the message on stderr, and no engine core ever started
    (one case: each `vllm serve` start-up costs ~35 s of imports on 2 busy cores)."""
    from saguaro_vllm.tools.server_process import vllm_command

    target, draft = tiny_pair
    spec = {"saguaro": {"mode": "sync", "finish-predraft": True}}
    needle = "speculative_config.saguaro.finish_predraft: only used with mode 'async' (SSD), but mode is 'sync'"
    t0 = time.monotonic()
    proc = subprocess.run([*vllm_command(), "serve", target, "--speculative-config", json.dumps(_full(draft, spec)),
                           "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--port", "0"],
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "EngineCore" not in out and "Initializing a V1 LLM engine" not in out, out[-3000:]
    assert time.monotonic() - t0 < 120


def test_speculative_config_file_path(tmp_path, tiny_pair, engine_config):
    target, draft = tiny_pair
    path = tmp_path / "saguaro.json"
    path.write_text(json.dumps({"method": "saguaro", "model": draft, "num_speculative_tokens": 4}))
    cfg = engine_config(target, str(path))
    assert cfg.speculative_config.num_speculative_tokens == 4
    assert load_speculative_config_arg(str(path))["method"] == "saguaro"


def test_cli_parser_accepts_path_and_json(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    path = tmp_path / "s.json"
    path.write_text('{"method": "saguaro", "model": "d", "num_speculative_tokens": 2}')
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--speculative-config", str(path)]).speculative_config["model"] == "d"
    inline = parser.parse_args(["--speculative-config", '{"method": "ngram"}']).speculative_config
    assert inline == {"method": "ngram"}


def test_arg_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a JSON object nor an existing JSON file"):
        load_speculative_config_arg("missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_speculative_config_arg(str(bad))


def test_parse_defaults():
    cfg = parse_speculative_config({"method": "saguaro", "model": "x", "num-speculative-tokens": 5})[0]
    assert cfg.saguaro.mode == "async" and cfg.saguaro.block_size == 16


# ---- the proposal ring's shared memory, checked in the front end ---------------------------------------
def _space(monkeypatch, shm: int | None, tmp: int | None):
    """The ring's space check sees `shm` bytes free in /dev/shm and `tmp` in the temp dir (None: none)."""
    import tempfile

    from saguaro_vllm.shared import proposal_buffers

    free = {"/dev/shm": shm, tempfile.gettempdir(): tmp}
    monkeypatch.setattr(proposal_buffers, "free_bytes", lambda d: free.get(d))


def _ring_cfg(**opts):
    return parse_speculative_config({"method": "saguaro", "model": "x", "num_speculative_tokens": 5,
                                     "saguaro": opts})[0]


def test_ring_that_fits_nowhere_is_refused_naming_size_space_and_fixes(monkeypatch):
    from saguaro_vllm.frontend.resolve import resolve_proposal_ring

    _space(monkeypatch, 64 * 2**20, 32 * 2**20)  # Docker's default /dev/shm, a small temp dir
    with pytest.raises(SaguaroConfigError) as err:
        resolve_proposal_ring(_ring_cfg(), 128256, max_num_seqs=1024)
    msg = str(err.value)
    assert msg.startswith("speculative_config.saguaro.max_sampled_rows: the proposal ring")
    assert "1.22 GiB (2 slots x 256 rows x K=5 x vocab 128256 x 4 B)" in msg  # 256 rows (auto), not 1024
    assert "/dev/shm: 64.0 MiB free" in msg and "32.0 MiB free" in msg
    assert "docker run --shm-size=3g" in msg and "max_sampled_rows to 13" in msg
    _space(monkeypatch, 2**20, None)
    with pytest.raises(SaguaroConfigError, match="set speculative_config.saguaro.max_sampled_rows to 0"):
        resolve_proposal_ring(_ring_cfg(), 128256, max_num_seqs=1024)


def test_ring_check_uses_the_ring_that_will_be_built(monkeypatch, caplog):
    import tempfile

    from saguaro_vllm.frontend.resolve import resolve_proposal_ring

    _space(monkeypatch, 64 * 2**20, 32 * 2**20)
    assert resolve_proposal_ring(_ring_cfg(max_sampled_rows=12), 128256, 1024) == {
        "dir": "/dev/shm", "rows": 12, "bytes": 4096 + 2 * 12 * 5 * 128256 * 4}
    assert resolve_proposal_ring(_ring_cfg(), 128256, 8)["rows"] == 8  # max_num_seqs 8: 8 rows
    assert resolve_proposal_ring(_ring_cfg(max_sampled_rows=0), 128256, 1024) == {"dir": None, "rows": 0,
                                                                                 "bytes": 0}  # no ring
    _space(monkeypatch, 64 * 2**20, 10 * 2**30)  # /dev/shm too small, the temp dir not: there, with a warning
    with caplog.at_level("WARNING", logger="vllm.saguaro"):
        ring = resolve_proposal_ring(_ring_cfg(), 128256, None)
    assert ring["dir"] == tempfile.gettempdir() and ring["rows"] == 256
    assert "--shm-size=3g" in caplog.text


def test_engine_args_refuse_a_ring_that_does_not_fit(tiny_pair, monkeypatch):
    """Through vLLM's own front end: refused before any engine process starts; with vLLM's max_num_seqs
    left unset the check assumes its largest default, and the chosen directory reaches the workers."""
    from vllm.engine.arg_utils import EngineArgs

    target, draft = tiny_pair
    vocab = json.loads((pathlib.Path(draft) / "config.json").read_text())["vocab_size"]
    spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3, "saguaro": {"mode": "sync"}}

    def create(**kw):
        return EngineArgs(model=target, speculative_config=_on_this_build(dict(spec)), enforce_eager=True,
                          max_model_len=TARGET_MAX_LEN, dtype="float32", **kw).create_engine_config()

    _space(monkeypatch, 4096 + 2 * 8 * 3 * vocab * 4, None)  # room for 8 rows exactly
    with pytest.raises(SaguaroConfigError, match=r"x 256 rows x K=3 .*/dev/shm: .* free.*--shm-size"):
        create()
    _assert_no_engine_started()
    cfg = create(max_num_seqs=8)
    assert cfg.additional_config["saguaro"]["proposal_ring_dir"] == "/dev/shm"
    assert cfg.scheduler_config.max_num_seqs == 8


def test_forced_model_runner_v2_is_refused_before_any_engine(tiny_pair, engine_config, monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER=1 skips vLLM's own fallback to V1 for custom_class proposers; Saguaro refuses
    it in the front end, with the reason and the fix. Other methods are left to vLLM."""
    target, draft = tiny_pair
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(SaguaroConfigError, match=r"VLLM_USE_V2_MODEL_RUNNER=1 forces Model Runner V2.*Unset "
                                                 r"VLLM_USE_V2_MODEL_RUNNER .* or set it to 0"):
        engine_config(target, _full(draft, {}))
    _assert_no_engine_started()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert engine_config(target, _full(draft, {})).speculative_config.method == "custom_class"
