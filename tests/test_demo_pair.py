"""Tests of the demo-pair builder: a tiny build is loadable, cost matching is exact, bad input is explained.

One tiny build (a 45-file slice of the stdlib, a few training steps, small cost-matched scales) is shared by
the module; evaluation sizes are shrunk with monkeypatch so the whole file runs in about a minute.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from saguaro_vllm.tools import cli
from saguaro_vllm.demo import build, pipeline
from saguaro_vllm.demo.corpus import Corpus, CorpusError
from saguaro_vllm.demo.model import ModelShape
from saguaro_vllm.demo.storage import DemoPairError, read_marker

transformers = pytest.importorskip("transformers")

TINY = {"minutes": 0.1, "seed": 3, "target_scale": "4M", "draft_scale": "2M"}
SHRINK = {"AGREEMENT_PROMPTS": 8, "CONTINUATION": 32, "HELDOUT_EVAL_TOKENS": 4096, "HELDOUT_PROMPTS": 16}


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> Path:
    """A small corpus with the stdlib's own relative paths, so the file-level split is the real one."""
    full = Corpus.load()
    root = tmp_path_factory.mktemp("corpus")
    train = [f for f in full.train if 8_000 < (full.root / f).stat().st_size < 40_000][:40]
    heldout = [f for f in full.heldout if (full.root / f).stat().st_size > 5_000][:5]
    for rel in train + heldout:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(full.root / rel, root / rel)
    return root


@pytest.fixture(scope="module")
def shrink():
    with pytest.MonkeyPatch.context() as mp:
        for name, value in SHRINK.items():
            mp.setattr(pipeline, name, value)
        yield


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_corpus, shrink) -> build.DemoPair:
    out = tmp_path_factory.mktemp("pairs") / "tiny"
    return build.ensure_demo_pair(out, corpus=tiny_corpus, **TINY)


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt_ids(pair, n=4, length=24) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(pair.target)
    return torch.tensor([tok(t)["input_ids"][:length] for t in pair.heldout_prompts(n)])


def test_build_writes_loadable_hf_models(pair):
    assert read_marker(pair.root)[0] is not None
    stats = json.loads((pair.root / "stats.json").read_text())
    for key in ("target", "draft", "agreement", "sampled_acceptance", "cost_matched"):
        assert key in stats
    assert 0.0 <= stats["agreement"]["per_token"] <= 1.0
    assert stats["distill"]["recipe"] == "soft" and stats["distill"]["temperatures"] == [1.0, 0.0]
    assert stats["distill"]["hard_weight"] == 1.0
    for temp in ("0.7", "1.0"):
        assert 0.0 < stats["sampled_acceptance"][temp]["per_token"] < 1.0
    for path in (pair.target, pair.draft, pair.target_cost, pair.draft_cost):
        model = _load(path)
        assert model.config.head_dim == 64 and model.config.tie_word_embeddings
        tok = transformers.AutoTokenizer.from_pretrained(path)
        text = pair.heldout_prompts(1)[0]
        assert tok.decode(tok(text)["input_ids"]) == text
        assert tok.eos_token == "<|endoftext|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "sort a list"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "# user: sort a list\n# assistant:\n"
    heldout = json.loads((pair.root / "heldout.json").read_text())
    assert heldout["files"] and len(pair.heldout_prompts()) == SHRINK["HELDOUT_PROMPTS"]


@pytest.mark.parametrize("name", ["target", "draft"])
def test_cost_matched_model_equals_trained(pair, name):
    small, big = _load(getattr(pair, name)), _load(getattr(pair, f"{name}_cost"))
    assert sum(p.numel() for p in big.parameters()) > 2 * sum(p.numel() for p in small.parameters())
    ids = _prompt_ids(pair)
    with torch.no_grad():
        torch.testing.assert_close(big(input_ids=ids).logits, small(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        kw = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(small.generate(ids, **kw), big.generate(ids, **kw))


def test_padding_is_exact_for_gqa_and_extra_layers():
    """Random (untrained) weights, GQA 4:2, padded in every dimension: same logits as the original."""
    from saguaro_vllm.demo.cost_match import pad_state_dict

    real, big = ModelShape(128, 2, 4, 2, 200), ModelShape(384, 5, 6, 3, 640)
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(real.hf_config(300, 128, 0)).eval()
    for p in small.parameters():  # norms start at 1.0; make them informative
        p.data.add_(0.1 * torch.randn_like(p))
    padded = transformers.LlamaForCausalLM(big.hf_config(300, 128, 0, rms_norm_eps=1e-5 * 128 / 384)).eval()
    missing, unexpected = padded.load_state_dict(pad_state_dict(small.state_dict(), real, big), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ids = torch.randint(0, 300, (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(padded(input_ids=ids).logits, small(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_cache_is_reused(pair, tiny_corpus, shrink):
    weights = pair.target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    messages = []
    t0 = time.time()
    again = build.ensure_demo_pair(pair.root, corpus=tiny_corpus, log=messages.append, **TINY)
    assert time.time() - t0 < 5
    assert again.root == pair.root and weights.stat().st_mtime_ns == mtime
    assert any("using cached" in m for m in messages)


def test_corrupt_cache_is_rebuilt_deterministically(pair, tiny_corpus, shrink, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(pair.root, copy)
    weights = copy / "draft" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(100)
    marker, why = read_marker(copy)
    assert marker is None and str(weights) in why
    messages = []
    rebuilt = build.ensure_demo_pair(copy, corpus=tiny_corpus, log=messages.append, cost_matched=False,
                                     **{k: v for k, v in TINY.items() if "scale" not in k})
    assert any("rebuilding" in m and str(weights) in m for m in messages)
    assert read_marker(copy)[0] is not None and rebuilt.target_cost is None
    assert not list(tmp_path.glob(".copy.tmp-*")), "temporary build directories must not be left behind"
    for name in ("target", "draft"):  # same seed, same settings: bit-identical weights
        assert (copy / name / "model.safetensors").read_bytes() == (pair.root / name / "model.safetensors").read_bytes()


def test_bad_out_is_explained(tmp_path, tiny_corpus):
    fast = {"corpus": tiny_corpus, "minutes": 0.05}  # should a check regress, fail fast rather than train
    with pytest.raises(DemoPairError, match=r"does not exist; create it first"):
        build.ensure_demo_pair(tmp_path / "no" / "such" / "dir", **fast)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DemoPairError, match="is not a directory"):
        build.ensure_demo_pair(tmp_path / "file", **fast)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DemoPairError, match="refusing to overwrite"):
        build.ensure_demo_pair(tmp_path / "mine", **fast)
    with pytest.raises(DemoPairError, match="cannot write to /sys"):
        build.ensure_demo_pair("/sys/saguaro-demo", **fast)
    with pytest.raises(DemoPairError, match="is below the trained model"):  # before any training
        build.ensure_demo_pair(tmp_path / "new", **fast, target_scale="1M")
    with pytest.raises(DemoPairError, match="cannot hold the trained"):
        narrow = "hidden=128,layers=2,heads=2,intermediate=512"
        build.ensure_demo_pair(tmp_path / "new", **fast, target_scale=narrow)
    with pytest.raises(DemoPairError, match="bad parameter count"):
        build.ensure_demo_pair(tmp_path / "new", **fast, draft_scale="lots")
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "missing" / "out"
    assert cli.main(["make-demo-pair", "--out", str(bad), "--no-cost-matched"]) == 2
    err = capsys.readouterr().err
    assert str(bad.parent) in err and "mkdir -p" in err
    args = ["--out", str(tmp_path / "x"), "--corpus", str(tmp_path / "nope"), "--minutes", "0.05", "--no-cost-matched"]
    assert cli.main(["make-demo-pair", *args]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nope") in err and "--corpus" in err
    assert not (tmp_path / "x").exists(), "a failed build must not leave an output directory"
    assert cli.main(["make-demo-pair", "--minutes", "0"]) == 2
    assert "--minutes must be positive" in capsys.readouterr().err


def test_unreadable_corpus_file_is_named(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.py").symlink_to(root / "missing.py")  # listed but unreadable
    with pytest.raises(CorpusError, match="usable .py files"):
        Corpus.load(root)
    corpus = Corpus(root, ("a.py",), ("a.py",))
    with pytest.raises(CorpusError, match=str(root / "a.py")):
        corpus.read("a.py")


def test_agreement_of_a_model_with_itself_is_perfect(pair):
    from saguaro_vllm.demo.distill import measure_agreement, measure_sampled_acceptance, reference_continuations

    target, draft = _load(pair.target), _load(pair.draft)
    seqs = reference_continuations(target, _prompt_ids(pair, n=2, length=16), 20)
    agree = measure_agreement(target, seqs, 16, k=5)
    assert agree.per_token == 1.0 and agree.mean_accept_len == 6.0
    sampled = reference_continuations(target, _prompt_ids(pair, n=2, length=16), 20, temperature=1.0, seed=1)
    assert not torch.equal(sampled, seqs)  # sampled, not greedy
    same = measure_sampled_acceptance(target, target, sampled, 16, 1.0)
    assert same.per_token == pytest.approx(1.0, abs=1e-5) and same.tokens == 2 * 20
    other = measure_sampled_acceptance(target, draft, sampled, 16, 1.0)
    assert 0.0 < other.per_token < 0.999


def test_sampled_acceptance_is_the_rejection_sampler_rate():
    """sum_v min(p, q) is what rejection sampling accepts: checked by simulating it on random models."""
    from saguaro_vllm.demo.distill import measure_sampled_acceptance

    torch.manual_seed(0)
    shape = ModelShape(64, 1, 1, 1, 96)
    p_model, q_model = (transformers.LlamaForCausalLM(shape.hf_config(40, 64, 0)).eval() for _ in range(2))
    for m in (p_model, q_model):
        for w in m.parameters():
            w.data.add_(0.5 * torch.randn_like(w))
    seqs = torch.randint(0, 40, (2, 12))
    a = measure_sampled_acceptance(p_model, q_model, seqs, 8, temperature=0.7)
    with torch.no_grad():
        p = torch.softmax(p_model(input_ids=seqs).logits[:, 7:-1] / 0.7, -1)
        q = torch.softmax(q_model(input_ids=seqs).logits[:, 7:-1] / 0.7, -1)
    gen = torch.Generator().manual_seed(1)
    n = 20000
    draws = torch.multinomial(q.reshape(-1, 40), n, replacement=True, generator=gen)  # (positions, n)
    ratio = (p.reshape(-1, 40).gather(1, draws) / q.reshape(-1, 40).gather(1, draws)).clamp(max=1)
    simulated = (torch.rand(ratio.shape, generator=gen) < ratio).float().mean().item()
    assert a.tokens == 8 and 0.05 < a.per_token < 0.95
    assert simulated == pytest.approx(a.per_token, abs=0.01)  # 8 x 20000 draws: stderr ~0.001


def test_soft_label_loss_is_zero_only_for_the_teacher(pair):
    from saguaro_vllm.demo.distill import SoftLabelLoss

    target, draft = _load(pair.target), _load(pair.draft)
    loss = SoftLabelLoss(target)
    ids = _prompt_ids(pair, n=2, length=16)
    none = torch.zeros(2, dtype=torch.bool)
    assert loss(target, (ids, none)).item() == pytest.approx(0.0, abs=1e-5)
    assert loss(draft, (ids, none)).item() > 0.01
    # the hard term: cross-entropy of the greedy row's tokens after the prompt, weighted by its share
    hybrid = SoftLabelLoss(target, prompt_len=8, hard_weight=1.0)
    greedy = torch.tensor([True, False])
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(target(input_ids=ids[:1]).logits[0, 7:-1], ids[0, 8:])
    assert hybrid(target, (ids, greedy)).item() == pytest.approx(0.5 * ce.item(), rel=1e-4)


def test_hard_recipe_stays_reproducible(tmp_path, tiny_corpus, shrink):
    """The v1 recipe (greedy hard labels) behind `distill="hard"`: its own cache key and stats."""
    fast = {k: v for k, v in TINY.items() if "scale" not in k}
    hard = build.ensure_demo_pair(tmp_path / "hard", corpus=tiny_corpus, cost_matched=False, distill="hard",
                                  **fast)
    assert hard.stats["distill"]["recipe"] == "hard" and hard.stats["distill"]["temperatures"] == [0.0]
    assert hard.stats["draft"]["train_loss_kind"] == "cross-entropy"
    soft_key = build.BuildSettings(fast["minutes"], fast["seed"], corpus=str(tiny_corpus)).key()
    hard_key = build.BuildSettings(fast["minutes"], fast["seed"], corpus=str(tiny_corpus), distill="hard").key()
    assert soft_key != hard_key and read_marker(hard.root)[0]["key"] == hard_key
    with pytest.raises(DemoPairError, match="--distill must be one of soft, hard"):
        build.BuildSettings(distill="kl")


@pytest.mark.engine
def test_vllm_generates_from_target(pair, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm = pytest.importorskip("vllm")
    llm = vllm.LLM(model=str(pair.target), enforce_eager=True, max_model_len=256, dtype="float32")
    try:
        out = llm.generate([pair.heldout_prompts(1)[0]], vllm.SamplingParams(temperature=0.0, max_tokens=16))
        chat = llm.chat([{"role": "user", "content": "print hello"}], vllm.SamplingParams(max_tokens=8))
    finally:  # stop the engine processes now, not at interpreter exit after pytest closed its streams
        llm.llm_engine.engine_core.shutdown()
    assert len(out[0].outputs[0].token_ids) == 16 and out[0].outputs[0].text
    assert chat[0].prompt.endswith("# assistant:\n") and chat[0].outputs[0].token_ids
