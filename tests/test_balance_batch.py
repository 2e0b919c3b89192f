"""trainer.balance_batch: every DP rank gets about the same tokens, and nothing but the row order changes.

References are independent of the partitioner: imbalance computed by hand on small cases, and the advantage
estimators run on the original order (the permutation is undone before comparing).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms import compute_advantage
from hybridflow.algorithms.seqlen_balance import (
    balance_batch,
    balance_parts,
    balance_permutation,
    balanced_partitions,
    imbalance,
)
from hybridflow.protocol import DataProto


def _long_tail(n: int, seed: int = 0) -> list[int]:
    """Prompt 8-16 tokens + a lognormal response clipped to 8..128: a few long answers, many short ones."""
    rng = np.random.default_rng(seed)
    resp = np.clip(np.round(rng.lognormal(mean=3.2, sigma=0.8, size=n)), 8, 128).astype(int)
    return (rng.integers(8, 17, size=n) + resp).tolist()


def test_hand_checkable_case():
    lengths = [10, 1, 9, 2, 8, 3]  # in order: shards (10,1,9)=20 and (2,8,3)=13
    assert imbalance(lengths, 2) == pytest.approx(20 / 16.5)
    parts = balanced_partitions(lengths, 2)
    assert sorted(len(p) for p in parts) == [3, 3]
    # 33 tokens cannot split 16/17 with three rows a side: every triple sums to <= 15 or >= 18
    assert sorted(sum(lengths[i] for i in p) for p in parts) == [15, 18]
    perm = balance_permutation(lengths, 2)
    assert imbalance([lengths[i] for i in perm], 2) == pytest.approx(18 / 16.5)


@pytest.mark.parametrize("seed", range(6))
def test_small_batches_reach_the_brute_force_optimum_or_near_it(seed):
    """Against every split of 8 rows into two groups of four (an exhaustive reference)."""
    import itertools

    lengths = _long_tail(8, seed=seed)
    total = sum(lengths)
    best = min(max(sum(lengths[i] for i in c), total - sum(lengths[i] for i in c))
               for c in itertools.combinations(range(8), 4))
    got = max(sum(lengths[i] for i in p) for p in balanced_partitions(lengths, 2))
    assert best <= got <= best + max(lengths) * 0.05 + 1, (lengths, best, got)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_long_tailed_batch_is_balanced_to_within_ten_percent(k):
    lengths = _long_tail(64)
    perm = balance_permutation(lengths, k)
    assert sorted(perm) == list(range(64))  # a permutation, nothing dropped or repeated
    before, after = imbalance(lengths, k), imbalance([lengths[i] for i in perm], k)
    print(f"\nk={k}: min {min(lengths)} max {max(lengths)} tokens; imbalance {before:.3f} -> {after:.4f}")
    assert after <= 1.1
    assert after <= before
    assert all(len(p) == 64 // k for p in balanced_partitions(lengths, k))


def test_bad_partition_requests_name_the_problem():
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        balanced_partitions([1, 2, 3, 4], 3)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        balanced_partitions([1, 2], 0)


def test_parts_serve_both_dp_sizes_when_they_can():
    assert balance_parts(64, 2, 4) == 4
    assert balance_parts(64, 4, None) == 4
    assert balance_parts(6, 2, 4) == 2  # 6 rows do not split into lcm(2,4)=4: the actor's DP decides


def _batch(lengths: list[int], n_per_group: int = 4) -> DataProto:
    b, width = len(lengths), max(lengths)
    resp_len = 8
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    g = torch.Generator().manual_seed(1)
    rewards = torch.zeros(b, resp_len)
    rewards[:, -1] = torch.rand(b, generator=g)
    return DataProto.from_dict(
        tensors={"attention_mask": mask, "token_level_rewards": rewards,
                 "response_mask": torch.ones(b, resp_len), "values": torch.randn(b, resp_len, generator=g),
                 "row": torch.arange(b)},
        non_tensors={"uid": np.array([f"p{i // n_per_group}" for i in range(b)], dtype=object)})


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_advantages_are_unchanged_by_the_reorder_up_to_row_order(estimator):
    lengths = _long_tail(32, seed=3)
    batch = _batch(lengths)

    def adv(d: DataProto):
        return compute_advantage(estimator, d.batch["token_level_rewards"], d.batch["response_mask"],
                                 values=d.batch["values"], index=d.non_tensor_batch["uid"], gamma=1.0, lam=0.95)[0]

    reference = adv(batch)
    metrics = balance_batch(batch, parts=4, report_dp=4)
    order = batch.batch["row"].tolist()
    assert sorted(order) == list(range(32)) and order != list(range(32))  # it really moved rows
    # every column travelled with its row (uid groups intact, masks with their rows)
    assert [int(x) for x in batch.batch["attention_mask"].sum(-1)] == [lengths[i] for i in order]
    assert list(batch.non_tensor_batch["uid"]) == [f"p{i // 4}" for i in order]
    # equal up to float summation order (GRPO's group statistics, GAE's batch whitening)
    torch.testing.assert_close(adv(batch), reference[order], rtol=1e-6, atol=1e-6)
    assert metrics["perf/dp_token_imbalance_before"] == pytest.approx(imbalance(lengths, 4))
    after = imbalance([lengths[i] for i in order], 4)
    assert metrics["perf/dp_token_imbalance"] == pytest.approx(after) and after <= 1.1


def test_with_balancing_off_the_imbalance_is_still_measured_and_nothing_moves():
    from hybridflow.algorithms.seqlen_balance import measure_imbalance

    lengths = [30, 2, 2, 2, 10, 10, 10, 10]  # by hand: shards of 4 rows hold 36 and 40 tokens, mean 38
    batch = _batch(lengths)
    assert measure_imbalance(batch, 2) == {"perf/dp_token_imbalance": pytest.approx(40 / 38)}
    assert batch.batch["row"].tolist() == list(range(8))
    assert measure_imbalance(_batch(lengths[:7]), 2) == {}  # does not split into 2 equal shards: not reported


def test_the_ablation_table_shows_the_imbalance_before_balancing_beside_it():
    from launch.benchmark.long_tail import imbalance_cell

    assert imbalance_cell({"dp_token_imbalance": 1.3521}) == "1.352"
    assert imbalance_cell({"dp_token_imbalance": 1.0, "dp_token_imbalance_before": 1.3521}) == "1.000 (1.352 before)"
    assert imbalance_cell({"dp_token_imbalance": None}) == "-"
