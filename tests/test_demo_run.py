"""`make demo`'s comparison, without servers: the table it prints from two engines' phases, the prompts it
sends and the example it shows."""
from __future__ import annotations

from saguaro_vllm.tools.demo_run import Phase, comparison_lines, demo_prompts, shown_example, speculation_figures


def _phase(t, tokens, seconds, texts, **metrics):
    return Phase(t, texts=texts, tokens=tokens, decode_s=seconds, metrics=metrics)


def test_comparison_shows_speedup_hit_rate_and_greedy_equality():
    plain = [_phase(0.0, 126, 18.0, ["a", "b"]), _phase(0.7, 126, 18.0, ["c", "d"])]
    saguaro = [
        _phase(0.0, 126, 6.0, ["a", "b"], **{"vllm:spec_decode_num_drafts_total": 30,
               "vllm:spec_decode_num_draft_tokens_total": 150, "vllm:spec_decode_num_accepted_tokens_total": 96,
               "vllm:saguaro_cache_lookups_total": 28, "vllm:saguaro_cache_hits_total": 21}),
        _phase(0.7, 126, 9.0, ["x", "y"], **{"vllm:spec_decode_num_drafts_total": 50,
               "vllm:spec_decode_num_draft_tokens_total": 250, "vllm:spec_decode_num_accepted_tokens_total": 75}),
    ]
    lines = comparison_lines(plain, saguaro, k=5)
    greedy, sampled = lines[1], lines[2]
    assert "7.00 t/s" in greedy and "21.00 t/s" in greedy and "3.00x" in greedy
    assert "0.750" in greedy and "4.20" in greedy and "0.640" in greedy and "identical" in greedy
    assert "2.00x" in sampled and "sampled" in sampled and "2.50" in sampled
    assert sampled.split()[6] == "-"  # no lookups counted: no hit rate
    plain[0].texts = ["a", "other"]
    assert "DIFFERENT" in comparison_lines(plain, saguaro, k=5)[1]


def test_speculation_figures_of_an_idle_phase_are_empty():
    f = speculation_figures({})
    assert f["hit_rate"] is None and f["acceptance_rate"] is None and f["mean_acceptance_length"] is None


def test_demo_prompts_end_mid_line():
    """The demo's prompts, cut from the held-out files as the demo pair's build cuts them (no training needed):
    each is its snippet without the trailing newline, so the models' first token carries the next line's
    indentation rather than following a lone newline (which they answered with blank lines)."""
    from saguaro_vllm.demo.corpus import Corpus, snippets
    from saguaro_vllm.demo.pipeline import HELDOUT_PROMPT_CHARS

    heldout = list(snippets(Corpus.load().texts("heldout"), 8, HELDOUT_PROMPT_CHARS, seed=0))
    assert all(p.endswith("\n") for p in heldout)
    for snippet, prompt in zip(heldout, demo_prompts(heldout), strict=True):
        assert prompt and not prompt[-1].isspace()
        assert snippet.startswith(prompt) and not snippet[len(prompt):].strip()


def test_shown_example_skips_blank_answers_and_trims_blank_lines():
    prompts = ["    def a(self):", "    def b(self):"]
    text = shown_example(prompts, ["\n\n  \n\n", "\n   \n        return self.b\n\n    def c(self):\n  \n"])
    assert text == ("--- prompt (end) ---\n    def b(self):\n--- Saguaro's greedy answer ---\n"
                    "        return self.b\n\n    def c(self):")
    assert shown_example(prompts, ["x = 1", "y"], tail_chars=5) == (
        "--- prompt (end) ---\nelf):\n--- Saguaro's greedy answer ---\nx = 1")
    assert "whitespace only" in shown_example(prompts, ["\n\n", " \n"])
