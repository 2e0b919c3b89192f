"""Every advantage estimator and every actor loss_agg_mode, end to end (Ray, Megatron TP=2 actor+ref with vLLM in its
processes, a critic), in one driver that builds the worker groups once (tests/e2e_estimator_runs.py): ReMax learns
the reverse task for 10 steps, then gae, grpo, rloo, reinforce_plus_plus and reinforce_plus_plus_baseline run 2 steps
each on the same warm workers. The checks recompute from what each step saved, by hand (not with hybridflow.algorithms,
the code under test): the advantages of each estimator from its rewards, values and groups; ReMax's baselines from
the greedy samples, re-scored; each reported pg_loss from the advantages under the run's loss_agg_mode (every update
is on-policy, one mini-batch, so the ratio is 1 and the PPO loss is the aggregated -A).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
from test_e2e_trainer import REPO, REQUIRED, _rows, _run

LEARN_STEPS = 10
CRITIC_ONLY = ("timing_s/values", "timing_s/update_critic", "critic/values/mean", "critic/vf_loss",
               "perf/padding_fraction/values", "perf/padding_fraction/update_critic")


@pytest.fixture(scope="module")
def runs(warm_assets, tmp_path_factory) -> Path:
    """The driver's output: <estimator>/{run,samples,adv_step_<N>.pt} and summary.json (e2e_estimator_runs.py)."""
    out = tmp_path_factory.mktemp("estimators")
    cmd = [sys.executable, str(REPO / "tests" / "e2e_estimator_runs.py"), "--out", str(out / "runs"),
           "--config", str(REPO / "configs" / "grpo_tiny_cpu.yaml"), "--learn-steps", str(LEARN_STEPS),
           f"actor_rollout_ref.model.path={warm_assets['model']}", f"data.train_files=[{warm_assets['train']}]",
           f"data.val_files=[{warm_assets['test']}]", "trainer.logger=[console,jsonl]", "trainer.ray.timeout_s=300",
           "trainer.ray.object_store_memory=268435456",
           # one mini-batch per step and one epoch: every update is on-policy (the pg_loss check needs ratio 1)
           "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
           "critic.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size_per_gpu=64",
           "actor_rollout_ref.actor.optim.lr=1e-3",  # ReMax's climb shows within 10 steps (measured: +0.05-0.08)
           "actor_rollout_ref.rollout.val_kwargs.n=16"]  # 16 held-out prompts x 16 samples at temperature 1
    t = time.perf_counter()
    _run(cmd, out / "log")
    print(f"\nthe estimator runs' driver took {time.perf_counter() - t:.1f} s")
    return out / "runs"


def _load(path: Path) -> dict:
    import torch

    return torch.load(path)


def _config(run: Path):
    from hybridflow.config.load import load_config

    return load_config(str(run / "config.yaml"), [])


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _reverse_score(response: str, prompt: str) -> float:
    """The reverse task scored by hand: the answer (up to a newline) against the prompt's string reversed, position
    by position, over the longer of the two."""
    truth = re.search(r"reverse: (\S+?)</s>", prompt).group(1)[::-1]
    answer = response.split("\n")[0].strip()
    longest = max(len(answer), len(truth))
    return 1.0 if longest == 0 else sum(a == t for a, t in zip(answer, truth)) / longest


def _valid(mask_row) -> list[int]:
    return [t for t, m in enumerate(mask_row.tolist()) if m]


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def _whiten(rows: list[list[float]]) -> list[list[float]]:
    """(x - mean) / sqrt(unbiased var + 1e-8) over every value of every row."""
    flat = [x for r in rows for x in r]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in r] for r in rows]


def _expected(estimator: str, d: dict, alg) -> list[list[float]]:
    """Each row's advantages on its valid tokens, recomputed by hand."""
    mask, r = d["response_mask"], d["token_level_rewards"]
    valid = [_valid(m) for m in mask]
    rewards = [[float(r[i, t]) for t in v] for i, v in enumerate(valid)]
    scores = [sum(x) for x in rewards]
    groups: dict[str, list[int]] = {}
    for i, u in enumerate(d["uid"]):
        groups.setdefault(u, []).append(i)

    def to_go(xs: list[float], gamma: float) -> list[float]:
        out, run = [], 0.0
        for x in reversed(xs):
            run = x + gamma * run
            out.append(run)
        return out[::-1]

    if estimator == "gae":
        values = [[float(d["values"][i, t]) for t in v] for i, v in enumerate(valid)]
        raw = []
        for rs, vs in zip(rewards, values, strict=True):
            adv, nxt_a, nxt_v = [], 0.0, 0.0
            for x, v in zip(reversed(rs), reversed(vs), strict=True):
                nxt_a = x + alg.gamma * nxt_v - v + alg.gamma * alg.lam * nxt_a
                nxt_v = v
                adv.append(nxt_a)
            raw.append(adv[::-1])
        returns = [[a + v for a, v in zip(ra, vs, strict=True)] for ra, vs in zip(raw, values, strict=True)]
        for i, v in enumerate(valid):  # the critic's targets: the raw advantages plus the values
            assert all(_close(float(d["returns"][i, t]), g, 1e-4) for t, g in zip(v, returns[i], strict=True))
        return _whiten(raw)
    if estimator == "reinforce_plus_plus":
        return _whiten([to_go(rs, alg.gamma) for rs in rewards])
    if estimator == "remax":  # undiscounted returns-to-go minus the prompt's greedy score
        base = d["reward_baselines"]
        return [[g - float(base[i]) for g in to_go(rs, 1.0)] for i, rs in enumerate(rewards)]
    per_row = [0.0] * len(scores)
    for rows in groups.values():
        s = [scores[i] for i in rows]
        mean = sum(s) / len(s)
        for i in rows:
            if estimator == "grpo":
                std = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1))
                per_row[i] = (scores[i] - mean) / (std + 1e-6) if alg.norm_adv_by_std_in_grpo else scores[i] - mean
            elif estimator == "rloo":  # leave one out: the mean of the others
                per_row[i] = scores[i] - (sum(s) - scores[i]) / (len(s) - 1)
            else:  # reinforce_plus_plus_baseline: the group's mean out, then whitened over the batch's tokens
                per_row[i] = scores[i] - mean
    tiled = [[per_row[i]] * len(v) for i, v in enumerate(valid)]
    return _whiten(tiled) if estimator == "reinforce_plus_plus_baseline" else tiled


def _agg(adv: list[list[float]], mode: str, horizon: int) -> float:
    """-A aggregated by hand as the worker reports it: token-sum's metric is the token mean (engine.micro_agg_mode)."""
    rows = [[-a for a in r] for r in adv if r]
    tokens = [a for r in rows for a in r]
    if mode in ("token-mean", "token-sum"):
        return sum(tokens) / len(tokens)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    total = sum(sum(r) for r in rows) / len(rows)
    return total / horizon if mode == "seq-mean-token-sum-norm" else total


@pytest.mark.slow
def test_every_estimator_runs_two_steps_with_advantages_of_its_own_shape_and_loss_agg_mode(runs):
    import torch

    summary = json.loads((runs / "summary.json").read_text())
    print(f"estimator runs: session start {summary['start_s']:.1f} s, total {summary['total_s']:.1f} s, "
          + ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in summary["runs"].items()))
    modes = {v["loss_agg_mode"] for v in summary["runs"].values()}
    from hybridflow.algorithms import ADV_ESTIMATORS, LOSS_AGG_MODES

    assert set(summary["runs"]) == set(ADV_ESTIMATORS) and modes == set(LOSS_AGG_MODES)
    grad_norms = {}
    for estimator, info in summary["runs"].items():
        run = runs / estimator / "run"
        cfg = _config(run)
        rows = [r for r in _rows(run) if "actor/pg_loss" in r]
        steps = LEARN_STEPS if estimator == "remax" else 2
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), estimator
        uses_critic = estimator == "gae"
        for r in rows:
            assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), (estimator, r["step"])
            required = [k for k in REQUIRED if uses_critic or k not in CRITIC_ONLY]
            missing = [k for k in required if k not in r]
            assert not missing, (estimator, missing)
            assert ("critic/vf_loss" in r) == uses_critic  # the critic group stays unused but for gae
            d = _load(runs / estimator / f"adv_step_{r['step']}.pt")
            mask, adv = d["response_mask"].bool(), d["advantages"]
            assert torch.isfinite(adv).all() and (adv[~mask] == 0).all(), estimator  # nothing outside the mask
            expected = _expected(estimator, d, cfg.algorithm)
            for i, v in enumerate(_valid(m) for m in d["response_mask"]):
                got = [float(adv[i, t]) for t in v]
                assert all(_close(g, e, 1e-4) for g, e in zip(got, expected[i], strict=True)), (estimator, i)
            if estimator in ("grpo", "rloo"):  # zero-mean within each prompt's group
                per_row = {u: [] for u in d["uid"]}
                for i, u in enumerate(d["uid"]):
                    per_row[u].append(float(adv[i][mask[i]][0]) if mask[i].any() else 0.0)
                assert all(abs(sum(g)) < 1e-4 for g in per_row.values()), estimator
            if uses_critic:
                assert d["values"][mask].abs().max() > 0 and adv[mask].abs().max() > 0
            mode = info["loss_agg_mode"]
            want = _agg(expected, mode, mask.shape[1])
            assert r["actor/pg_loss"] == pytest.approx(want, rel=1e-4, abs=1e-6), (estimator, mode, r["step"])
            grad_norms.setdefault(mode, []).append(r["actor/grad_norm"])
    # token-sum's update is the token mean scaled by the batch's valid tokens (~700 here): so is its gradient
    others = max(g for m, gs in grad_norms.items() if m != "token-sum" for g in gs)
    assert min(grad_norms["token-sum"]) > 50 * others, grad_norms


@pytest.mark.slow
def test_remax_learns_and_its_advantages_are_the_returns_minus_the_greedy_samples_scores(runs):
    run = runs / "remax" / "run"
    rows = _rows(run)
    key = next(k for k in rows[0] if k.startswith("val-core/") and "/mean@" in k)
    before, after = rows[0][key], rows[-1][key]
    assert [rows[0]["step"], rows[-1]["step"]] == [0, LEARN_STEPS]
    print(f"ReMax {LEARN_STEPS} steps: held-out {key} {before:.3f} -> {after:.3f}; training score "
          + " ".join(f"{r['critic/score/mean']:.3f}" for r in rows if "critic/score/mean" in r))
    assert after > before + 0.025, (before, after)
    train = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert sum(train[-3:]) / 3 > sum(train[:3]) / 3
    n = _config(run).actor_rollout_ref.rollout.n
    for step in (1, LEARN_STEPS):
        samples = _jsonl(runs / "remax" / "samples" / f"step_{step}.jsonl")
        greedy = {g["uid"]: g for g in _jsonl(runs / "remax" / "samples" / f"baseline_step_{step}.jsonl")}
        assert len(samples) == n * len(greedy)
        for g in greedy.values():  # the greedy response, scored by hand, is the baseline
            assert _close(g["score"], _reverse_score(g["response"], g["prompt"]))
        for s in samples:
            g = greedy[s["uid"]]
            assert g["prompt_ids"] == s["prompt_ids"]
            assert _close(s["score"], _reverse_score(s["response"], s["prompt"]))
            assert _close(s["reward_baseline"], g["score"])
            assert _close(s["advantage_mean"], s["score"] - g["score"])  # every valid token: return - baseline
        assert all(sum(s["uid"] == u for s in samples) == n for u in greedy)  # shared by the prompt's n samples
        d = _load(runs / "remax" / f"adv_step_{step}.pt")
        base = {u: float(b) for u, b in zip(d["uid"], d["reward_baselines"], strict=True)}
        assert all(_close(base[u], greedy[u]["score"]) for u in greedy)
        row = next(r for r in rows if r.get("step") == step and "perf/total_num_tokens" in r)
        # the greedy tokens are not trained on: the step's tokens are its samples' own
        assert row["perf/total_num_tokens"] == sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
        assert row["timing_s/gen_baseline"] > 0 and row["timing_s/gen_max"] == row["timing_s/gen_baseline"]
