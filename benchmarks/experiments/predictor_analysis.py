"""Outcome prediction at T > 0 (issue 27 item 6): where missed outcomes fall, what the predictor could catch,
and the hit rate of the product's policy at a fixed fan-out budget under a cost model.

    # 1. traces: per temperature, P(a=j), the bonus token's rank among each depth's candidates, the draft's
    #    own probability mass of the top F candidates against the hit frequency, and the hit rate of fan-outs
    .venv/bin/python benchmarks/experiments/predictor_analysis.py traces TRACE_DIR/async-b1-t1
    # 2. replay: the product's SSDReplay (RoundPlanner, OutcomeStats, ScaleChoice) under a cost model with
    #    `fanout_budget` fixed; a row hits when its recorded outcome is among the branches the policy planned
    .venv/bin/python benchmarks/experiments/predictor_analysis.py replay TRACE_DIR... --budget 24 \\
        --cost-model benchmarks/cost_models/h100-70b-tp4-1b.json
    # live: record an async trace of the demo pair (raw models, batch 1, 2 held-out prompts x 256 tokens) with
    #    the fan-out budget fixed and `finish_predraft` (every planned branch exists at lookup: the hit rate is
    #    the predictor's, not the timing's); `--fanout 5,5,4,3,3,4` fixes the list instead (the geometric
    #    shape at budget 24, α ≈ 0.7: the policy before OutcomeStats)
    .venv/bin/python benchmarks/experiments/predictor_analysis.py record --temperature 0.7 --trace-dir TRACE_DIR \\
        [--scale 0.5]
    # 3. offline: the demo pair's target and draft distributions (p, q) along text the target samples at T;
    #    exact expectations (no sampling noise beyond the contexts) of acceptance, residual coverage by the
    #    top-F candidates, and per fan-out and Saguaro C the hit rate and tokens per round
    .venv/bin/python benchmarks/experiments/predictor_analysis.py offline --temperatures 0.7,1.0 --prompts 24 \\
        --tokens 128

Rounds in `offline` start at every position of the sampled text; depth j of a round is the position j
later (target samples stand in for accepted drafts, whose distribution min(p, q')/beta differs a little).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections import Counter
from pathlib import Path

K = 5
W = 64


# ------------------------------------------------------------------------------------------------ traces
def _trace_file(path: str) -> Path:
    p = Path(path)
    return p if p.is_file() else sorted(p.glob("trace-*.jsonl.gz"), key=lambda f: f.stat().st_mtime)[-1]


def _rounds(path: str) -> tuple[dict, list[dict]]:
    """(header, neural K-draft rounds: a, rank, t, temp, scale and the pre-draft's candidates `pre`)."""
    lines = [json.loads(x) for x in gzip.open(_trace_file(path), "rt")]
    header, rounds, pending = lines[0], [], {}
    for s in lines[1:]:
        if s.get("kind") != "step":
            continue
        for r in s["rows"]:
            if r.get("a", -1) >= 0 and not r.get("fast") and r.get("k") == header.get("k", K):
                rounds.append({"a": r["a"], "rank": r.get("rank", -1), "t": r.get("t"), "temp": r.get("temp"),
                               "scale": r.get("scale"), "pre": pending.get(r["id"])})
        for rid, pre in (s.get("pre") or {}).get("rows", {}).items():
            pending[rid] = pre
    return header, rounds


def geometric(budget: int, alpha: float, k: int = K, r: float = 1.0) -> list[int]:
    from saguaro_vllm.drafter.predictor import allocate_fanout
    return allocate_fanout(budget, alpha, k, r)


def analyse_trace(path: str, budgets=(6, 12, 24, 32)) -> dict:
    from saguaro_vllm.drafter.predictor import OutcomeStats
    header, rounds = _rounds(path)
    k = header.get("k", K)
    n = len(rounds)
    ranked = [x for x in rounds if x["rank"] >= 0]
    acc = sum(x["a"] for x in rounds)
    alpha = acc / max(1, sum(x["a"] + (x["a"] < k) for x in rounds))
    out = {"trace": str(_trace_file(path)), "temperatures": sorted({x["temp"] for x in rounds}),
           "scales": dict(Counter(str(x["scale"]) for x in rounds)), "rounds": n, "alpha": round(alpha, 4),
           "P(a=j)": [round(sum(x["a"] == j for x in rounds) / n, 4) for j in range(k + 1)],
           "P(a=j) geometric": [round(v, 4) for v in ((1 - alpha) * alpha ** j for j in range(k))] + [
               round(alpha ** k, 4)],
           "rank_by_depth": {}, "hit_rate": {}}
    for j in range(k + 1):
        sub = [x for x in ranked if x["a"] == j]
        if not sub:
            continue
        row = {"n": len(sub), "ranks": sorted(x["rank"] for x in sub),
               "P(rank<F)": {F: round(sum(x["rank"] < F for x in sub) / len(sub), 3) for F in (1, 4, 8, 16, 24, 64)}}
        with_pre = [x for x in sub if x["pre"]]
        if with_pre:  # the draft's own (T=1) probability mass of its top F candidates: calibration
            row["draft_mass_topF"] = {F: round(sum(sum(x["pre"]["p"][j][:F]) for x in with_pre) / len(with_pre), 3)
                                      for F in (1, 4, 8, 16, 24, 64)}
        out["rank_by_depth"][str(j)] = row
    for b in budgets:
        geo = geometric(b, alpha, k)
        online = OutcomeStats()
        hits_online = 0
        for x in ranked:  # the new allocation, online: fan-out from the statistics of the rounds before
            fan = online.allocate(b, k, alpha)
            hits_online += x["rank"] < fan[x["a"]]
            online.observe(x["a"], k, x["rank"])
        per_round = 0
        pa = out["P(a=j)"]
        for x in ranked:  # per-round allocation by P(a=j) x the round's own draft probability (in-sample P(a))
            if not x["pre"]:
                continue
            scores = sorted(((pa[j] * x["pre"]["p"][j][r], j) for j in range(k + 1)
                             for r in range(len(x["pre"]["p"][j]))), reverse=True)[:b]
            fan = [sum(1 for _, jj in scores if jj == j) for j in range(k + 1)]
            per_round += x["t"] in x["pre"]["cand"][x["a"]][: fan[x["a"]]]
        m = len(ranked)
        hits_geometric = sum(x["rank"] < geo[x["a"]] for x in ranked) / m
        out["hit_rate"][str(b)] = {"geometric": {"fan": geo, "hit": round(hits_geometric, 4)},
                                   "outcome_stats_online": round(hits_online / m, 4),
                                   "per_round_draft_probs": round(per_round / m, 4),
                                   "ceiling_any_fan": round(sum(x["rank"] < b for x in ranked) / m, 4)}
    return out


# ------------------------------------------------------------------------------------------------ replay
def replay(path: str, cost_model: str, budget: int, seed: int = 0, allocation: str = "outcome-stats") -> dict:
    """`allocation` "geometric": the planner never gets calibrated statistics, so every fan-out keeps the
    geometric shape of `allocate_fanout` (the policy before OutcomeStats; the pooled ranks are still fed)."""
    from saguaro_vllm.drafter.trace import read_trace
    from saguaro_vllm.projection.clocks import ModelClock
    from saguaro_vllm.projection.cost_model import CostModel
    from saguaro_vllm.projection.replay import SSDReplay
    header, steps = read_trace(_trace_file(path))
    opts = dict(header.get("options") or {})
    opts["fanout_budget"] = budget
    opts.pop("fanout", None)
    header = {**header, "options": opts}
    clock = ModelClock(CostModel.load(cost_model), finish_predraft=bool(opts.get("finish_predraft")), seed=seed)
    rp = SSDReplay(header, steps, clock, seed)
    if allocation == "geometric":
        from saguaro_vllm.drafter.predictor import MAX_RANK
        rp.planner.observe_rank = lambda temperature, accepted, k, rank: rp.planner.ranks.observe(min(rank, MAX_RANK))
    r = rp.run()
    temps = sorted({x.get("temp", 0.0) for s in steps for x in s["rows"]})
    return {"allocation": allocation, "trace": str(_trace_file(path)), "temperatures": temps,
            "sampling_scale": opts.get("sampling_scale"), "budget": budget, "cost_model": cost_model,
            "lookups": sum(r.lookups_by_depth.values()), "hit_rate": round(r.hit_rate or 0.0, 4),
            "hit_rate_by_depth": {str(j): [r.hits_by_depth[j], r.lookups_by_depth[j]]
                                  for j in sorted(r.lookups_by_depth)},
            "tokens_per_s": round(r.tokens / r.seconds, 2) if r.seconds else None,
            "final_fanout_per_temperature_bucket": {str(b): s.allocate(budget, K, rp.predictor.neural.alpha)
                                                    for b, s in rp.planner.outcomes.items()},
            "scales": {str(c): n for c, n in r.scales.items()}}


def record(temperature: float, out: str, scale: str = "1.0", fanout: str | None = None, budget: int = 24,
           prompts: int = 2, tokens: int = 256, models: str = "raw") -> dict:
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for run
    from run import engine_specs, run_one

    from saguaro_vllm.demo import ensure_demo_pair
    pair = ensure_demo_pair()
    target, draft = (pair.target, pair.draft) if models == "raw" else (pair.target_cost, pair.draft_cost)
    opts = {"finish_predraft": True, "trace_dir": out, "trace_max_mb": 64,
            "sampling_scale": scale if scale == "auto" else float(scale)}
    if fanout:
        opts["fanout"] = [int(x) for x in fanout.split(",")]
    else:
        opts["fanout_budget"] = budget
    spec = engine_specs(str(draft), [], K, opts, [0], [1])["saguaro-async"]
    t0 = time.time()
    res = run_one(str(target), spec, pair.heldout_prompts(prompts + 8)[8: 8 + prompts], 1, temperature, tokens,
                  None, 1200)
    return {"temperature": temperature, "options": opts, "models": models, "wall_s": time.time() - t0,
            **{k: res.get(k) for k in ("decode_tok_s_per_seq", "hit_rate", "mean_acceptance_length")}}


# ------------------------------------------------------------------------------------------------ offline
def sample_distributions(temperature: float, prompts: int, tokens: int, seed: int = 0):
    """(P, Q) [prompts, tokens, vocab]: target and draft distributions at T along text the target samples."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from saguaro_vllm.demo import ensure_demo_pair
    pair = ensure_demo_pair()
    tok = AutoTokenizer.from_pretrained(pair.target)
    tgt = AutoModelForCausalLM.from_pretrained(pair.target, torch_dtype=torch.float32).eval()
    drf = AutoModelForCausalLM.from_pretrained(pair.draft, torch_dtype=torch.float32).eval()
    ps, qs = [], []
    with torch.no_grad():
        for n, text in enumerate(pair.heldout_prompts(prompts)):
            ids = tok(text, return_tensors="pt").input_ids[:, -200:]
            gen = torch.Generator().manual_seed(seed * 100003 + n)
            seq, past, x = ids, None, ids
            for _ in range(tokens):
                o = tgt(x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                nxt = torch.multinomial(torch.softmax(o.logits[0, -1].float() / temperature, -1), 1, generator=gen)
                seq, x = torch.cat([seq, nxt[None]], 1), nxt[None]
            s = ids.shape[1] - 1
            ps.append(torch.softmax(tgt(seq).logits[0, s:s + tokens].float() / temperature, -1))
            qs.append(torch.softmax(drf(seq).logits[0, s:s + tokens].float() / temperature, -1))
    return torch.stack(ps), torch.stack(qs)


class Outcomes:
    """Exact per-position quantities of (P, Q) for a Saguaro C scaling the top F of q (candidates: q's order).
    beta: acceptance of a draft from q'; cov[f]: P(rejected and the bonus among the top f candidates, the
    drafted token excluded); cov_all[f]: P(bonus among the top f | all accepted) (the bonus follows p)."""

    def __init__(self, P, Q):
        self.P, self.Q, self._cache = P, Q, {}
        order = Q.argsort(-1, descending=True)
        self.qs, self.ps = Q.gather(-1, order), P.gather(-1, order)

    def tables(self, c: float, f_scale: int):
        import torch
        key = (c, f_scale if c < 1 else 0)
        if key in self._cache:
            return self._cache[key]
        qp = self.qs.clone()
        if key[1] > 0:
            qp[..., : key[1]] *= c
            qp = qp / qp.sum(-1, keepdim=True)
        beta = torch.minimum(self.ps, qp).sum(-1)
        res, rej = (self.ps - qp).clamp(min=0), (qp - self.ps).clamp(min=0)
        zero = torch.zeros_like(res[..., :1])
        cum = torch.cat([zero, res[..., : W + 1].cumsum(-1)], -1)
        rejcum = torch.cat([zero, rej[..., : W + 1].cumsum(-1)], -1)
        f = torch.arange(W + 1)
        # a rejected drafted token inside the top f has no residual; the (f+1)-th candidate takes its place
        cov = cum[..., f] + rejcum[..., f] * res[..., f] / rej.sum(-1, keepdim=True).clamp(min=1e-12)
        cov_all = torch.cat([zero, self.ps[..., :W].cumsum(-1)], -1)
        self._cache[key] = (beta, cov, cov_all)
        return self._cache[key]

    def rounds(self, fan: list[int], c: float) -> dict:
        """Mean hit rate, tokens per round and P(a=j) of K-draft rounds with fan-out `fan` and C."""
        import torch
        n, length = self.P.shape[:2]
        starts = length - K
        surv = torch.ones(n, starts)
        hit = torch.zeros(n, starts)
        tokens = torch.zeros(n, starts)
        pa, hd = [], []
        for j in range(K):
            beta, cov, _ = self.tables(c, fan[j])
            b, cv = beta[:, j: j + starts], cov[:, j: j + starts, fan[j]]
            hit += surv * cv
            tokens += surv * (1 - b) * (j + 1)
            pa.append((surv * (1 - b)).mean().item())
            hd.append((surv * cv).mean().item())
            surv = surv * b
        _, _, cov_all = self.tables(1.0, 0)
        cv = cov_all[:, K: K + starts, fan[K]]
        hit += surv * cv
        tokens += surv * (K + 1)
        pa.append(surv.mean().item())
        hd.append((surv * cv).mean().item())
        return {"hit": hit.mean().item(), "tokens": tokens.mean().item(), "P(a=j)": pa, "hit_by_depth": hd}

    def best_fan(self, budget: int, c: float) -> list[int]:
        """Greedy: each branch to the depth whose next branch adds the most modelled hits (C's F follows)."""
        fan = [0] * (K + 1)
        for _ in range(budget):
            best = max(range(K + 1), key=lambda j: self.rounds([f + (i == j) for i, f in enumerate(fan)], c)["hit"])
            fan[best] += 1
        return fan

    def per_round(self, budget: int, pa: list[float]) -> float:
        """Hit rate (C=1) when each round spends its budget on its own best (depth, token) outcomes, scored
        P(a=j) x q_j(token): the draft's probabilities of that round (not in the product)."""
        import torch
        beta, cov, cov_all = self.tables(1.0, 0)
        n, length = beta.shape
        w = torch.tensor(pa)[:, None]
        hits = []
        for i in range(n):
            for s in range(length - K):
                top = (w * self.qs[i, s: s + K + 1, :W]).flatten().topk(budget).indices // W
                f = torch.bincount(top, minlength=K + 1).tolist()
                surv, h = 1.0, 0.0
                for j in range(K):
                    h += surv * cov[i, s + j, f[j]].item()
                    surv *= beta[i, s + j].item()
                hits.append(h + surv * cov_all[i, s + K, f[K]].item())
        return sum(hits) / len(hits)

    def coverage(self, fs=(1, 2, 4, 8, 16, 24, 32, 64)) -> dict:
        beta, cov, cov_all = self.tables(1.0, 0)
        z = (1 - beta).clamp(min=1e-9)
        return {"acceptance": round(beta.mean().item(), 4),
                "residual_share_in_topF": {F: round((cov[..., F].sum() / z.sum()).item(), 4) for F in fs},
                "target_mass_in_topF": {F: round(cov_all[..., F].mean().item(), 4) for F in fs}}


def analyse_offline(temperature: float, prompts: int, tokens: int, budget: int, verify_s: float, miss_s: float,
                    scales=(1.0, 0.75, 0.5, 0.25, 0.1)) -> dict:
    P, Q = sample_distributions(temperature, prompts, tokens)
    m = Outcomes(P, Q)
    cov = m.coverage()
    res = {"temperature": temperature, "positions": int(P.shape[0] * P.shape[1]), **cov, "policies": []}

    def row(name, fan, c):
        r = m.rounds(fan, c)
        res["policies"].append({"policy": name, "C": c, "fan": fan, "hit": round(r["hit"], 4),
                                "tokens_per_round": round(r["tokens"], 4),
                                "P(a=j)": [round(x, 4) for x in r["P(a=j)"]],
                                # a round: verification + (miss) a just-in-time draft
                                "tokens_per_s_model": round(r["tokens"] / (verify_s + (1 - r["hit"]) * miss_s), 2)})
    geo = geometric(budget, cov["acceptance"])
    row("geometric (before)", geo, 1.0)
    res["per_round_draft_probs_C1_hit"] = round(m.per_round(budget, res["policies"][0]["P(a=j)"]), 4)
    for c in scales:
        row("best static fan-out", m.best_fan(budget, c), c)
        if c < 1:
            row("geometric", geo, c)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("traces")
    t.add_argument("traces", nargs="+")
    r = sub.add_parser("replay")
    r.add_argument("traces", nargs="+")
    r.add_argument("--cost-model", default="benchmarks/cost_models/h100-70b-tp4-1b.json")
    r.add_argument("--budget", type=int, default=24)
    r.add_argument("--allocation", choices=["outcome-stats", "geometric", "both"], default="both")
    rec = sub.add_parser("record")
    rec.add_argument("--temperature", type=float, required=True)
    rec.add_argument("--trace-dir", required=True)
    rec.add_argument("--scale", default="1.0")
    rec.add_argument("--fanout")
    rec.add_argument("--budget", type=int, default=24)
    rec.add_argument("--prompts", type=int, default=2)
    rec.add_argument("--tokens", type=int, default=256)
    rec.add_argument("--models", choices=["raw", "cost"], default="raw")
    o = sub.add_parser("offline")
    o.add_argument("--temperatures", default="0.7,1.0")
    o.add_argument("--prompts", type=int, default=24)
    o.add_argument("--tokens", type=int, default=128)
    o.add_argument("--budget", type=int, default=24)
    o.add_argument("--verify-s", type=float, default=1 / 54, help="verification (default: H100 70B TP4, batch 1)")
    o.add_argument("--miss-s", type=float, default=0.0057, help="what a just-in-time miss adds (default: 1B "
                   "draft, K=5 forwards of benchmarks/cost_models/h100-70b-tp4-1b.json plus host time)")
    for x in (t, r, o, rec):
        x.add_argument("--out", help="write the JSON here")
    a = p.parse_args(argv)
    if a.cmd == "traces":
        out = [analyse_trace(x) for x in a.traces]
    elif a.cmd == "record":
        out = [record(a.temperature, a.trace_dir, a.scale, a.fanout, a.budget, a.prompts, a.tokens, a.models)]
    elif a.cmd == "replay":
        kinds = ["geometric", "outcome-stats"] if a.allocation == "both" else [a.allocation]
        out = [replay(x, a.cost_model, a.budget, allocation=kind) for x in a.traces for kind in kinds]
    else:
        import torch
        torch.set_num_threads(1)
        out = [analyse_offline(float(x), a.prompts, a.tokens, a.budget, a.verify_s, a.miss_s)
               for x in a.temperatures.split(",")]
    args = sys.argv[1:] if argv is None else argv
    doc = {"command": "python benchmarks/experiments/predictor_analysis.py " + " ".join(args), "results": out}
    text = json.dumps(doc, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text if len(text) < 20000 else text[:20000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
