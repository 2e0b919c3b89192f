"""Token-budget micro-batches (verl's use_dynamic_bsz) and per-micro-batch trimming.

Pure packing logic first (hybridflow/data/token_budget.py). Then one torchrun launch per world size
(tests/mcore_scripts/dynbsz_checks.py, TP1 on 1 process, DP2 and PP2 on 2, gloo, fp32) shared by every check:
the gradients of one update with token-budget micro-batches equal those of the same mini-batch in one
micro-batch (within 1e-6 relative, every loss_agg_mode; the DP2 run is compared with the 1-process run),
forward-only results come back in the original row order, and a trimmed forward equals an untrimmed one.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.data.token_budget import (
    TokenBudgetError,
    fixed_micro_batches,
    inverse_permutation,
    micro_batches_needed,
    pack_by_token_budget,
    padding_fraction,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from dynbsz_checks import CRITIC_MODES, MODES  # noqa: E402
from train_common import make_rl_batch, run_torchrun  # noqa: E402

BUDGET = 18  # the batch's rows hold 5..14 valid tokens: several micro-batches, unequal counts over DP2


# ---------------------------------------------------------------- packing (pure)

def test_packing_respects_the_budget_and_keeps_every_row_once():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(max(lengths), 120)
        groups = pack_by_token_budget(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(g and sum(lengths[i] for i in g) <= budget for g in groups)
        # first fit leaves at most one micro-batch half empty or less
        assert len(groups) <= 2 * sum(lengths) / budget + 1
        assert micro_batches_needed(lengths, budget) == len(groups)
        more = rng.randint(len(groups), len(lengths))
        forced = pack_by_token_budget(lengths, budget, min_micro_batches=more)
        assert len(forced) == more and sorted(i for g in forced for i in g) == list(range(len(lengths)))
        assert all(g and sum(lengths[i] for i in g) <= budget for g in forced)


def test_packing_by_hand():
    # FFD: 9 | 7+3 | 6+4 | 5 (budget 10); rows ascending in a group, groups by their first row
    assert pack_by_token_budget([5, 9, 3, 7, 4, 6], 10) == [[0], [1], [2, 3], [4, 5]]
    assert pack_by_token_budget([2, 2, 2], 10) == [[0, 1, 2]]
    assert pack_by_token_budget([2, 2, 2], 10, min_micro_batches=3) == [[0], [1], [2]]
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


def test_inverse_permutation_restores_the_order():
    order = [3, 0, 2, 1]
    inv = inverse_permutation(order)
    assert [order[i] for i in inv] == [0, 1, 2, 3]
    rows = torch.arange(4)[torch.tensor(order)]  # rows as the micro-batches ran
    assert rows[torch.tensor(inv)].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not a permutation"):
        inverse_permutation([0, 0, 1])


def test_packing_refuses_what_cannot_fit():
    with pytest.raises(TokenBudgetError, match=r"row 1 has 12 valid tokens, more than the token budget 10"):
        pack_by_token_budget([3, 12, 4], 10)
    with pytest.raises(TokenBudgetError, match="positive int"):
        pack_by_token_budget([3], 0)
    with pytest.raises(TokenBudgetError, match="3 non-empty micro-batches out of 2 rows"):
        pack_by_token_budget([3, 4], 10, min_micro_batches=3)
    assert padding_fraction(3, 4) == 0.25 and padding_fraction(0, 0) == 0.0


# ---------------------------------------------------------------- megatron, 1 and 2 processes

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("dynbsz")
    model = save_tiny_model(root / "llama", preset="tiny", arch="llama")
    results = {}
    for name, nproc, pp in ((1, 1, 1), (2, 2, 1), ("pp2", 2, 2)):
        path = root / f"{name}.pt"
        run_torchrun("dynbsz_checks.py", nproc, ["--model", str(model), "--out", str(path),
                                                 "--budget", str(BUDGET), "--pp", str(pp)], timeout=300)
        results[name] = torch.load(path)
    return results


def _rel(a: dict, b: dict) -> float:
    """max over parameters of |a - b|_max / |b|_max."""
    assert set(a) == set(b) and a
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


def _lengths():
    mask = make_rl_batch(100, batch=8, prompt_len=6, response_len=8)["attention_mask"]
    return mask.sum(-1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_update_gradients_do_not_depend_on_the_micro_batches(runs, mode):
    single, dp2 = runs[1], runs[2]
    one = single["actor_grads"][f"{mode}/one"]
    assert max(float(g.abs().max()) for g in one.values()) > 0
    assert _rel(single["actor_grads"][f"{mode}/dynamic"], one) < 1e-6  # TP1: token budget vs one micro-batch
    assert _rel(dp2["actor_grads"][f"{mode}/dynamic"], one) < 1e-6  # DP2 token budget vs 1 process, 1 micro
    assert _rel(dp2["actor_grads"][f"{mode}/one"], one) < 1e-6
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac"):
        want = single["actor_metrics"][f"{mode}/one"][key]
        for got in (single["actor_metrics"][f"{mode}/dynamic"][key], dp2["actor_metrics"][f"{mode}/dynamic"][key]):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-9), key
    # the dynamic updates really ran several micro-batches of different shapes, within the budget
    shapes = single["actor_metrics"][f"{mode}/dynamic"]["shapes"][0]
    assert len(shapes) >= 4 and len({tuple(s) for s in shapes}) > 1
    assert single["actor_metrics"][f"{mode}/one"]["shapes"] == [[[8, max(_lengths())]]]


@pytest.mark.slow
def test_the_two_ranks_run_the_same_number_of_micro_batches(runs):
    """Rank 1's rows (5, 5, 13, 10 tokens) need 2 micro-batches of 18, rank 0's (10, 8, 8, 14) need 3: the
    count is the max over DP, made by splitting a micro-batch, never by an empty one."""
    lengths = _lengths()
    assert micro_batches_needed(lengths[:4], BUDGET) == 3 and micro_batches_needed(lengths[4:], BUDGET) == 2
    ranks = runs[2]["shapes_per_rank"]
    dynamic = [key for key in ranks[0] if key.endswith("/dynamic")]
    assert len(dynamic) == len(MODES)
    for key in dynamic:
        counts = [len(r[key][0]) for r in ranks]
        assert counts == [3, 3], (key, counts)
        assert all(rows >= 1 for r in ranks for rows, _ in r[key][0])


@pytest.mark.slow
@pytest.mark.parametrize("mode", CRITIC_MODES)
def test_critic_gradients_do_not_depend_on_the_micro_batches(runs, mode):
    single, dp2 = runs[1], runs[2]
    one = single["critic_grads"][f"{mode}/one"]
    assert _rel(single["critic_grads"][f"{mode}/dynamic"], one) < 1e-6
    assert _rel(dp2["critic_grads"][f"{mode}/dynamic"], one) < 1e-6
    m = single["actor_metrics"]
    assert m[f"critic/{mode}/dynamic"]["critic/vf_loss"] == pytest.approx(m[f"critic/{mode}/one"]["critic/vf_loss"],
                                                                          rel=1e-6)


@pytest.mark.slow
def test_forward_results_come_back_in_the_original_order(runs):
    for nproc in (1, 2):
        f = runs[nproc]["forward"]
        for key in ("old_log_probs", "entropys", "ref_log_prob"):
            torch.testing.assert_close(f["dynamic"][key], f["fixed"][key], rtol=0, atol=1e-6)
        torch.testing.assert_close(f["values"]["dynamic"], f["values"]["fixed"], rtol=0, atol=1e-6)
    # the token-budget pass grouped rows out of order (FFD takes the longest first), so order mattered
    shapes = runs[1]["padding"]["dynamic"]["shapes"][0]
    assert len(shapes) == micro_batches_needed(_lengths(), BUDGET) == 5


@pytest.mark.slow
def test_trimmed_micro_batches_equal_untrimmed_and_report_less_padding(runs):
    lengths = _lengths()
    p = runs[1]["padding"]
    f = runs[1]["forward"]
    for key in ("old_log_probs", "entropys", "ref_log_prob"):  # padding is behind every valid token
        torch.testing.assert_close(f["fixed"][key], f["untrimmed"][key], rtol=0, atol=1e-6)
    # by hand: fixed 4-row micro-batches, each at its own longest row vs all at the batch's longest row
    width = lambda rows: max(lengths[i] for i in rows)
    trimmed = 1 - sum(lengths) / (4 * width(range(4)) + 4 * width(range(4, 8)))
    untrimmed = 1 - sum(lengths) / (8 * max(lengths))
    assert p["fixed"]["old_log_prob"] == pytest.approx(trimmed) and p["fixed"]["ref"] == pytest.approx(trimmed)
    assert p["untrimmed"]["old_log_prob"] == pytest.approx(untrimmed)
    assert p["dynamic"]["old_log_prob"] < p["fixed"]["old_log_prob"] < p["untrimmed"]["old_log_prob"]
    # DP2: each rank forwards the full batch, so the fraction over both ranks is the same
    assert runs[2]["padding"]["fixed"]["old_log_prob"] == pytest.approx(trimmed)
    m = runs[1]["actor_metrics"]["token-mean/dynamic"]
    assert 0 <= m["perf/padding_fraction/update_actor"] < runs[1]["actor_metrics"]["token-mean/one"][
        "perf/padding_fraction/update_actor"]


@pytest.mark.slow
def test_pipeline_parallel_runs_micro_batches_of_different_shapes(runs):
    """PP2: token-budget micro-batches differ in rows and width, so megatron's variable_seq_lengths sends each
    shape between the stages; forward results, the update's loss metrics and stage 0's gradients (rank 0
    saves its own stage: embedding, layer 0) match the 1-process run."""
    single, pp2 = runs[1], runs["pp2"]
    shapes = pp2["padding"]["dynamic"]["shapes"][0]
    assert len({tuple(s) for s in shapes}) > 2
    for key in ("old_log_probs", "ref_log_prob"):
        torch.testing.assert_close(pp2["forward"]["dynamic"][key], single["forward"]["fixed"][key], rtol=0, atol=1e-6)
    torch.testing.assert_close(pp2["forward"]["values"]["dynamic"], single["forward"]["values"]["fixed"],
                               rtol=0, atol=1e-6)
    for mode in MODES:
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
            assert pp2["actor_metrics"][f"{mode}/dynamic"][key] == pytest.approx(
                single["actor_metrics"][f"{mode}/one"][key], rel=1e-6, abs=1e-9), (mode, key)
        stage0 = pp2["actor_grads"][f"{mode}/dynamic"]
        assert any("layers.0." in k for k in stage0) and not any("output_layer" in k for k in stage0)
        # fp32 over a different reduction order across two stages: 1e-5 here (TP1 / DP2 above hold 1e-6)
        assert _rel(stage0, {k: single["actor_grads"][f"{mode}/one"][k] for k in stage0}) < 1e-5
