"""Cross-pool weight-sync plan (hybridflow/resharding/cross_pool_plan.py): hand-computed cases, properties over random
layouts (checked on plain row sets, not the planner's interval arithmetic), and errors that name the problem."""

from __future__ import annotations

import random

import pytest

from hybridflow.parallel.dims import LayoutError, ModelShape, ParallelDims
from hybridflow.resharding.cross_pool_plan import Message, RolloutLayout, plan_cross_pool
from hybridflow.resharding.planner import ParamSpec, plan_resharding

F32 = 4


def specs_small(stage: int = 0, prefix: str = "decoder.layers.0.") -> list[ParamSpec]:
    """qkv (8, 4) rows split; fc1 (8, 4) [gate; up] stride 2; proj (4, 8) split on dim 1; a norm; (vocab below)."""
    return [
        ParamSpec(prefix + "self_attention.linear_qkv.weight", (8, 4), F32, True, 0, 1, stage),
        ParamSpec(prefix + "mlp.linear_fc1.weight", (8, 4), F32, True, 0, 2, stage),
        ParamSpec(prefix + "self_attention.linear_proj.weight", (4, 8), F32, True, 1, 1, stage),
        ParamSpec(prefix + "input_layernorm.weight", (4,), F32, False, 0, 1, stage),
    ]


VOCAB = ParamSpec("output_layer.weight", (128, 4), F32, True, 0, 1, 0, valid_size=100, gen_pad_multiple=64)


def msgs(plan, name_part: str, dst: int | None = None) -> list[tuple[int, int, int, int]]:
    """(src, dst, start, stop) of the messages of the parameter whose name contains name_part."""
    return [(m.src, m.dst, m.start, m.stop) for m in plan.messages
            if name_part in m.name and (dst is None or m.dst == dst)]


# ---- hand-computed ---------------------------------------------------------------------------------------------


def test_t2_to_tg1_one_rollout_rank_reads_both_training_slices():
    plan = plan_cross_pool(ParallelDims(tp=2), RolloutLayout(ranks=1, tp=1), [*specs_small(), VOCAB])
    assert msgs(plan, "linear_qkv") == [(0, 0, 0, 4), (1, 0, 4, 8)]
    # fc1 at t=2: tp0 holds gate rows 0-2 and up rows 4-6, tp1 gate 2-4 and up 6-8
    assert msgs(plan, "linear_fc1") == [(0, 0, 0, 2), (0, 0, 4, 6), (1, 0, 2, 4), (1, 0, 6, 8)]
    assert msgs(plan, "linear_proj") == [(0, 0, 0, 4), (1, 0, 4, 8)]  # columns, on dim 1
    assert msgs(plan, "layernorm") == [(1, 0, 0, 4)]  # replicated: TP rank (spec index 3 + rollout rank 0) % 2
    # Megatron pads the vocab to 128 (64 rows per TP rank); only the 100 real rows travel
    assert msgs(plan, "output_layer") == [(0, 0, 0, 64), (1, 0, 64, 100)]
    real = (32 + 32 + 32 + 4 + 100 * 4) * F32
    assert plan.expected_recv_bytes(0) == plan.recv_bytes(0) == plan.model_bytes == real
    assert (plan.send_bytes(0), plan.send_bytes(1)) == ((16 + 16 + 16 + 256) * F32, (16 + 16 + 16 + 4 + 144) * F32)
    assert plan.world_size == 3 and plan.sync_rank(0) == 2
    assert [m.tag for m in plan.messages] == list(range(len(plan.messages)))


def test_t1_to_tg2_each_rollout_rank_gets_its_half_and_vllm_vocab_split():
    plan = plan_cross_pool(ParallelDims(tp=1), RolloutLayout(ranks=2, tp=2), [*specs_small(), VOCAB])
    assert msgs(plan, "linear_qkv") == [(0, 0, 0, 4), (0, 1, 4, 8)]
    assert msgs(plan, "linear_fc1") == [(0, 0, 0, 2), (0, 0, 4, 6), (0, 1, 2, 4), (0, 1, 6, 8)]
    assert msgs(plan, "linear_proj") == [(0, 0, 0, 4), (0, 1, 4, 8)]
    assert msgs(plan, "layernorm") == [(0, 0, 0, 4), (0, 1, 0, 4)]  # every TP rank needs the whole norm
    # vLLM pads 100 to 128 and splits 64/64: rank 1 gets the real rows 64..100 only
    assert msgs(plan, "output_layer") == [(0, 0, 0, 64), (0, 1, 64, 100)]
    matrices = (32 + 32 + 32) * F32
    assert plan.expected_recv_bytes(0) == matrices // 2 + 4 * F32 + 64 * 4 * F32
    assert plan.expected_recv_bytes(1) == matrices // 2 + 4 * F32 + 36 * 4 * F32
    # a replica receives the model once, plus one norm per extra TP rank (replicated parameters)
    assert plan.recv_bytes(0) + plan.recv_bytes(1) == plan.model_bytes + 4 * F32


def test_t2p2d2_to_tg2_each_stage_and_replica_sends_its_own():
    """t=2, p=2, d=2 (8 training ranks) -> 4 rollout ranks in 2 replicas of t_g=2: t = t_g, so rollout (q, j) reads
    TP slice j of its stage from training replica q: rank j + 2q + 4*stage."""
    specs = specs_small(0) + specs_small(1, "decoder.layers.1.")
    plan = plan_cross_pool(ParallelDims(tp=2, pp=2, dp=2), RolloutLayout(ranks=4, tp=2), specs)
    assert msgs(plan, "layers.0.self_attention.linear_qkv") == [(0, 0, 0, 4), (1, 1, 4, 8), (2, 2, 0, 4),
                                                                (3, 3, 4, 8)]
    assert msgs(plan, "layers.1.self_attention.linear_qkv") == [(4, 0, 0, 4), (5, 1, 4, 8), (6, 2, 0, 4),
                                                                (7, 3, 4, 8)]
    assert msgs(plan, "layers.1.mlp.linear_fc1", dst=3) == [(7, 3, 2, 4), (7, 3, 6, 8)]
    # replicated norm of stage 1 (spec index 7): TP rank (7 + r) % 2 of replica r // 2
    assert msgs(plan, "layers.1.input_layernorm") == [(5, 0, 0, 4), (4, 1, 0, 4), (7, 2, 0, 4), (6, 3, 0, 4)]
    sent = [plan.send_bytes(r) for r in range(8)]
    assert min(sent) > 0 and max(sent) - min(sent) <= 4 * F32  # every training rank sends; one norm apart at most


def test_t4_to_tg2_a_rollout_rank_reads_two_training_slices():
    spec = ParamSpec("decoder.layers.0.self_attention.linear_qkv.weight", (16, 4), F32, True, 0, 1, 0)
    plan = plan_cross_pool(ParallelDims(tp=4), RolloutLayout(ranks=2, tp=2), [spec])
    assert msgs(plan, "qkv") == [(0, 0, 0, 4), (1, 0, 4, 8), (2, 1, 8, 12), (3, 1, 12, 16)]


def test_more_rollout_replicas_than_training_replicas_wrap_and_cp_counts_as_a_replica():
    spec = ParamSpec("decoder.layers.0.mlp.linear_fc2.weight", (4, 8), F32, True, 1, 1, 0)
    # d=2: replicas 0,1,2 read from dp 0,1,0
    plan = plan_cross_pool(ParallelDims(tp=1, dp=2), RolloutLayout(ranks=3, tp=1), [spec])
    assert msgs(plan, "fc2") == [(0, 0, 0, 8), (1, 1, 0, 8), (0, 2, 0, 8)]
    # cp=2, dp=1: the cp ranks hold the same weights; replica 1 reads from cp rank 1 (world rank 1)
    plan = plan_cross_pool(ParallelDims(tp=1, cp=2), RolloutLayout(ranks=2, tp=1), [spec])
    assert msgs(plan, "fc2") == [(0, 0, 0, 8), (1, 1, 0, 8)]
    assert plan.source_replica(1) == 1


def test_buckets_bound_the_largest_receive_and_the_rollout_pad_replaces_the_trainers():
    specs = [*specs_small(), VOCAB]
    plan = plan_cross_pool(ParallelDims(tp=2), RolloutLayout(ranks=2, tp=2), specs, bucket_bytes=64)
    # per rollout rank: qkv 64, fc1 64, proj 64, norm 16, vocab 1024 / 576 bytes
    assert plan.buckets == ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))
    assert plan_cross_pool(ParallelDims(tp=2), RolloutLayout(ranks=2, tp=2), specs, bucket_bytes=144).buckets == (
        (0, 2), (2, 4), (4, 5))
    for b in range(len(plan.buckets)):
        names = {s.name for s in plan.specs[slice(*plan.buckets[b])]}
        assert {m.name for m in plan.bucket_messages(b)} == names
    # the trainer builds specs with pad 1; the rollout side says 64: 100 -> 128 split 64/64, not 50/50
    trainer_specs = [*specs_small(), ParamSpec("output_layer.weight", (128, 4), F32, True, 0, 1, 0, valid_size=100)]
    plan = plan_cross_pool(ParallelDims(tp=2), RolloutLayout(2, 2), trainer_specs, gen_vocab_pad_multiple=64)
    assert msgs(plan, "output_layer") == [(0, 0, 0, 64), (1, 1, 64, 100)]


# ---- properties over random layouts ------------------------------------------------------------------------------


def rows_of(layout) -> list[int]:
    return [i for a, b in layout for i in range(a, b)]


def random_specs(rng: random.Random, t: int, t_g: int, p: int) -> list[ParamSpec]:
    lcm = t * t_g
    specs = []
    for stage in range(p):
        for k in range(rng.randint(1, 4)):
            kind = rng.choice(["rows", "cols", "fc1", "norm", "scalar"])
            n = f"decoder.layers.{stage}.{k}.{kind}"
            if kind == "rows":
                specs.append(ParamSpec(n, (lcm * rng.randint(1, 3), 3), F32, True, 0, 1, stage))
            elif kind == "cols":
                specs.append(ParamSpec(n, (2, lcm * rng.randint(1, 3)), 2, True, 1, 1, stage))
            elif kind == "fc1":
                specs.append(ParamSpec(n, (2 * lcm * rng.randint(1, 2), 3), F32, True, 0, 2, stage))
            elif kind == "norm":
                specs.append(ParamSpec(n, (5,), F32, False, 0, 1, stage))
            else:
                specs.append(ParamSpec(n, (), F32, False, 0, 1, stage))
    valid = rng.randint(1, 128 * t)
    specs.append(ParamSpec("output_layer.weight", (-(-valid // (128 * t)) * 128 * t, 3), F32, True, 0, 1, p - 1,
                           valid_size=valid, gen_pad_multiple=64 * t_g))
    return specs


@pytest.mark.parametrize("seed", range(40))
def test_every_rollout_rank_receives_exactly_its_shard_from_holders(seed):
    rng = random.Random(seed)
    t, p, d, cp = rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.choice([1, 2])
    t_g, replicas = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 5])
    train, rollout = ParallelDims(tp=t, pp=p, dp=d, cp=cp), RolloutLayout(ranks=t_g * replicas, tp=t_g)
    specs = random_specs(rng, t, t_g, p)
    plan = plan_cross_pool(train, rollout, specs, bucket_bytes=rng.choice([1, 200, 10**9]))
    for r in range(rollout.ranks):
        q, j = rollout.coords(r)
        for spec in specs:
            got: list[int] = []
            for m in plan.messages:
                if m.dst != r or m.name != spec.name:
                    continue
                c = train.coords(m.src)
                assert c["pp"] == spec.pp_stage, m  # its own stage sends
                assert c["cp"] + cp * c["dp"] == q % (cp * d), m  # from the replica's source replica
                held = set(rows_of(spec.train_layout(c["tp"], t)))
                assert set(range(m.start, m.stop)) <= held, m  # the sender holds what it sends
                assert m.nbytes == (m.stop - m.start) * spec.row_bytes
                got += range(m.start, m.stop)
            need = rows_of(spec.gen_layout(j, t_g))
            assert sorted(got) == sorted(need), (r, spec.name)  # every needed row once, nothing else
        assert plan.recv_bytes(r) == plan.expected_recv_bytes(r)
    # each replica receives the model once per TP rank for replicated parameters, once for split ones
    for q in range(rollout.replicas):
        tp_once = sum((s.valid_size or s.length) * s.row_bytes for s in specs if s.tensor_parallel)
        replicated = sum(s.nbytes for s in specs if not s.tensor_parallel)
        assert sum(plan.recv_bytes(q * t_g + j) for j in range(t_g)) == tp_once + t_g * replicated
    assert sum(plan.send_bytes(s) for s in range(train.world_size)) == sum(plan.recv_bytes(r)
                                                                           for r in range(rollout.ranks))
    # buckets: contiguous, cover every spec once, tags unique
    assert plan.buckets[0][0] == 0 and plan.buckets[-1][1] == len(specs)
    assert all(a[1] == b[0] for a, b in zip(plan.buckets, plan.buckets[1:]))
    assert [m.tag for m in plan.messages] == list(range(len(plan.messages)))


def test_split_matrices_arrive_as_exactly_m_over_tg():
    """Without the vocab and the replicated parameters every rollout rank receives M/t_g exactly."""
    specs = specs_small(0) + specs_small(1, "decoder.layers.1.")
    split = [s for s in specs if s.tensor_parallel]
    for t, p, t_g in ((2, 1, 1), (1, 1, 2), (2, 2, 2), (4, 2, 2), (1, 2, 4)):
        plan = plan_cross_pool(ParallelDims(tp=t, pp=p), RolloutLayout(ranks=t_g, tp=t_g),
                               [s for s in split if s.pp_stage < p])
        for r in range(t_g):
            assert plan.recv_bytes(r) * t_g == plan.model_bytes, (t, p, t_g)


def test_duck_types_as_a_reshard_plan_for_the_vllm_converter():
    """VllmShardConverter reads placements[rank].gen_tp, gen.tp, spec() and needs(); cross-pool rank r must
    convert as the colocated plan's rank with the same generation TP rank."""
    from hybridflow.parallel.dims import GenerationDims

    specs = [*specs_small(), VOCAB]
    cross = plan_cross_pool(ParallelDims(tp=2), RolloutLayout(ranks=2, tp=2), specs)
    colo = plan_resharding(ParallelDims(tp=1, dp=2), GenerationDims(tp=2), specs)
    for r in range(2):
        assert cross.placements[r].gen_tp == colo.placements[r].gen_tp == r
        assert cross.gen == colo.gen
        for s in specs:
            assert cross.needs(r, s) == colo.needs(r, s)


# ---- errors ---------------------------------------------------------------------------------------------------


def test_errors_name_the_problem():
    specs = specs_small()
    with pytest.raises(LayoutError, match="does not divide the rollout pool's 3 ranks"):
        plan_cross_pool(ParallelDims(), RolloutLayout(ranks=3, tp=2), specs)
    model = ModelShape(num_layers=1, hidden_size=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=4, vocab_size=100)
    with pytest.raises(LayoutError, match="rollout tp=4 does not divide num_key_value_heads=2"):
        plan_cross_pool(ParallelDims(), RolloutLayout(ranks=4, tp=4), specs, model=model)
    with pytest.raises(LayoutError, match="not divisible by partition_stride\\*rollout_tp = 2\\*8"):
        plan_cross_pool(ParallelDims(), RolloutLayout(ranks=8, tp=8), specs)
    with pytest.raises(LayoutError, match="repeated"):
        plan_cross_pool(ParallelDims(), RolloutLayout(1), specs + specs[:1])
    with pytest.raises(LayoutError, match="bucket_bytes=0"):
        plan_cross_pool(ParallelDims(), RolloutLayout(1), specs, bucket_bytes=0)
    with pytest.raises(LayoutError, match="pp_stage=1 outside pipeline size 1"):
        plan_cross_pool(ParallelDims(), RolloutLayout(1), specs_small(1))
    with pytest.raises(LayoutError, match="rollout rank 2 outside"):
        RolloutLayout(ranks=2).coords(2)
    assert isinstance(plan_cross_pool(ParallelDims(), RolloutLayout(1), specs).messages[0], Message)
