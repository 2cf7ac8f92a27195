"""Bad Saguaro configs fail in the front end, before any engine process starts, naming the field."""
from __future__ import annotations

import json
import multiprocessing
import pathlib

import pytest

from saguaro_vllm.config import SaguaroConfigError, load_speculative_config_arg, parse_saguaro_config


@pytest.fixture(scope="module")
def engine_config():
    """Run vLLM's real front-end config path (plugin patches applied) and return its result or error."""
    from vllm.engine.arg_utils import EngineArgs

    def create(target: str, spec) -> object:
        args = EngineArgs(model=target, speculative_config=spec, enforce_eager=True, max_model_len=256,
                          dtype="float32")
        return args.create_engine_config()

    return create


def _assert_no_engine_started():
    assert not multiprocessing.active_children(), "an engine process was started"


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


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"saguaro": {"fan_out": 3}}, "speculative_config.saguaro.fan_out: unknown key"),
        ({"saguaro": {"fanout": [1, 1]}}, "speculative_config.saguaro.fanout needs K+1 = 4 numbers"),
        ({"saguaro": {"miss_fanout": [0, 0, 0, 0]}}, "speculative_config.saguaro.miss_fanout: Value error"),
        ({"saguaro": {"sampling_scale": 1.5}}, "speculative_config.saguaro.sampling_scale: Value error, must lie"),
        ({"saguaro": {"backup": "random"}}, "speculative_config.saguaro.backup"),
        ({"saguaro": {"fanout_budget": 0}}, "speculative_config.saguaro.fanout_budget"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 99}, "speculative_config.num_speculative_tokens"),
        ({"model": "/nonexistent/draft"}, "speculative_config.model: draft model '/nonexistent/draft' not found"),
        ({"saguaro": {"device": "cuda:0"}}, "speculative_config.saguaro.device"),
        ({"saguaro": {"device": "tpu"}}, "speculative_config.saguaro.device"),
        ({"saguaro": {"mode": "ssd"}}, "speculative_config.saguaro.mode"),
        ({"saguaro": {"draft_cores": [999]}}, "speculative_config.saguaro.draft_cores"),
        ({"unknown_top": 1}, "speculative_config.unknown_top: unknown key"),
    ],
)
def test_bad_config_errors_name_the_field(tiny_pair, engine_config, spec, needle):
    target, draft = tiny_pair
    base = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3}
    saguaro = {**base.get("saguaro", {}), **spec.pop("saguaro", {})}
    full = {**base, **spec, **({"saguaro": saguaro} if saguaro else {})}
    with pytest.raises(SaguaroConfigError) as err:
        engine_config(target, full)
    assert needle in str(err.value)
    _assert_no_engine_started()


def test_vocab_mismatch_is_refused(tmp_path, tiny_pair, engine_config):
    from tiny_models import _save_llama

    target, _ = tiny_pair
    other = tmp_path / "other-vocab"
    other.mkdir()
    _save_llama(other, None, vocab=77, seed=3)
    with pytest.raises(SaguaroConfigError, match=r"speculative_config.model: the draft's vocabulary \(77"):
        engine_config(target, {"method": "saguaro", "model": str(other), "num_speculative_tokens": 2})
    _assert_no_engine_started()


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
    cfg = parse_saguaro_config({"method": "saguaro", "model": "x", "num-speculative-tokens": 5})
    assert cfg.saguaro.mode == "sync" and cfg.saguaro.block_size == 16
