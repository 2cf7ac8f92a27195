"""`vllm serve TARGET --speculative-config path.json` with the OpenAI client: completions and chat,
streaming and not, give the target's own greedy output, and speculation happened (server /metrics)."""
from __future__ import annotations

import json
import re

import pytest

from engine_runs import Job, run_engine
from saguaro_vllm.server_process import VLLMServer

pytestmark = pytest.mark.engine

PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "import os\nimport sys\nprint("]
CHAT = [{"role": "user", "content": "for i in range(10):"}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def chat_prompt(tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    return tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def reference(tiny_pair, chat_prompt):
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return run_engine(tiny_pair[0], [Job("greedy", [*PROMPTS, chat_prompt], params)]) ["greedy"].texts


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    cfg = tmp / "saguaro.json"
    cfg.write_text(json.dumps({"method": "saguaro", "model": tiny_pair[1], "num_speculative_tokens": 4,
                               "saguaro": {"mode": "sync"}}))
    with VLLMServer(tiny_pair[0], ["--speculative-config", str(cfg), "--dtype", "float32",
                                   "--max-model-len", "512", "--enforce-eager", "--served-model-name", "tiny"],
                    log_path=str(tmp / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


EXTRA = {"ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_greedy_target(client, reference, stream):
    for prompt, expected in zip(PROMPTS, reference):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=stream, extra_body=EXTRA)
        text = "".join(c.choices[0].text for c in resp) if stream else resp.choices[0].text
        assert text == expected


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_greedy_target(client, reference, stream):
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          stream=stream, extra_body=EXTRA)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in resp if c.choices)
    else:
        text = resp.choices[0].message.content
    assert text == reference[-1]


def test_server_metrics_show_speculation(client, server):
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    text = server.metrics_text()

    def value(name):
        m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    assert value("vllm:spec_decode_num_drafts_total") > 0
    assert value("vllm:spec_decode_num_accepted_tokens_total") > 0
