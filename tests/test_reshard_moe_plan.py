"""Experts through the resharding plan (pure): Megatron EP x ETP x TP (x PP) -> vLLM TP.

The parameters are those of the tiny qwen3_moe (hybridflow.models.tiny: 2 layers, hidden 64, 4 heads of
32 with 2 kv heads, 8 experts of FFN 64, vocab 103, fp32), given per rank the way Megatron holds them:
local shapes, global names (an expert's name carries its global index e = ep_rank * E/ep + j) and
Megatron's TP attributes. Specs come from megatron_specs.param_specs on every rank, merged as
HybridEngine gathers them.

The lower bound is computed here from plain index sets, without the planner: a rank holds the rows of
its TP slice of every dense parameter of its stage and the rows of its expert-TP slice of the experts of
its own EP rank (e // (E/ep)) on its stage, nothing of the other EP ranks' experts; as a vLLM TP rank it
needs its t_g slice of every parameter, every expert included (vLLM TP splits each expert's FFN like a
dense MLP). The bound is |needed rows not held| x row bytes, summed; the plan must reach it exactly.
"""

from __future__ import annotations

import re

import pytest
import torch

from hybridflow.parallel.dims import GenerationDims, LayoutError, ParallelDims
from hybridflow.resharding.megatron_specs import merge_rank_specs, param_specs
from hybridflow.resharding.planner import ParamSpec, plan_resharding

pytestmark = pytest.mark.moe

H, HEADS, KV, HD, E, F, VOCAB, LAYERS = 64, 4, 2, 32, 8, 64, 103, 2
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def megatron_rows(length: int, stride: int, parts: int, index: int) -> set[int]:
    block = length // stride
    piece = block // parts
    return {b * block + index * piece + k for b in range(stride) for k in range(piece)}


def _param(shape, split_dim=None, stride=1):
    p = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
    if split_dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, split_dim, stride
    return p


def padded_vocab(tp: int) -> int:
    unit = 128 * tp  # megatron's make_vocab_size_divisible_by x tp
    return -(-VOCAB // unit) * unit


def rank_params(dims: ParallelDims, rank: int) -> list[tuple[str, torch.nn.Parameter]]:
    """What Megatron holds on `rank`: its stage's layers at local shapes, under global names."""
    c, ec = dims.coords(rank), dims.expert_coords(rank)
    t, etp = dims.tp, dims.expert_tp
    per_stage = LAYERS // dims.pp
    out = []
    if c["pp"] == 0:
        out.append(("embedding.word_embeddings.weight", _param((padded_vocab(t) // t, H), 0)))
    for i in range(c["pp"] * per_stage, (c["pp"] + 1) * per_stage):
        n = f"decoder.layers.{i}."
        out += [
            (n + "input_layernorm.weight", _param((H,))),
            (n + "self_attention.linear_qkv.weight", _param(((HEADS + 2 * KV) * HD // t, H), 0)),
            (n + "self_attention.linear_proj.weight", _param((H, HEADS * HD // t), 1)),
            (n + "self_attention.q_layernorm.weight", _param((HD,))),
            (n + "self_attention.k_layernorm.weight", _param((HD,))),
            (n + "pre_mlp_layernorm.weight", _param((H,))),
            (n + "mlp.router.weight", _param((E, H))),
        ]
        for j in range(E // dims.ep):
            e = ec["ep"] * (E // dims.ep) + j
            out += [(n + f"mlp.experts.local_experts.{e}.linear_fc1.weight", _param((2 * F // etp, H), 0, 2)),
                    (n + f"mlp.experts.local_experts.{e}.linear_fc2.weight", _param((H, F // etp), 1))]
    if c["pp"] == dims.pp - 1:
        out += [("decoder.final_layernorm.weight", _param((H,))),
                ("output_layer.weight", _param((padded_vocab(t) // t, H), 0))]
    return out


def gathered_specs(dims: ParallelDims) -> list[ParamSpec]:
    from megatron_workers.hf_mapping import is_expert

    per_rank = []
    for r in range(dims.world_size):
        specs, _ = param_specs(rank_params(dims, r), tp=dims.tp, pp_stage=dims.coords(r)["pp"], vocab_size=VOCAB,
                               gen_vocab_pad_multiple=64, is_expert=is_expert, expert_tp=dims.expert_tp,
                               ep_rank=dims.expert_coords(r)["ep"])
        per_rank.append(specs)
    return merge_rank_specs(per_rank)


def held(dims: ParallelDims, rank: int, spec: ParamSpec) -> set[int]:
    c, ec = dims.coords(rank), dims.expert_coords(rank)
    if c["pp"] != spec.pp_stage:
        return set()
    m = _EXPERT.search(spec.name)
    if m:
        if int(m.group(1)) // (E // dims.ep) != ec["ep"]:
            return set()  # another EP rank's expert
        return megatron_rows(spec.length, spec.partition_stride, dims.expert_tp, ec["etp"])
    if not spec.tensor_parallel:
        return set(range(spec.length))
    return megatron_rows(spec.length, spec.partition_stride, dims.tp, c["tp"])


def needed(t_g: int, j: int, spec: ParamSpec) -> set[int]:
    if not spec.tensor_parallel:
        return set(range(spec.length))
    if spec.valid_size is not None:  # vLLM: pad the real vocab to 64, split evenly, real rows only
        per = -(-spec.valid_size // 64) * 64 // t_g
        return set(range(j * per, min((j + 1) * per, spec.valid_size)))
    return megatron_rows(spec.length, spec.partition_stride, t_g, j)


LAYOUTS = {
    "tp1-ep2-dp2->tg1": (ParallelDims(dp=2, ep=2), 1),
    "tp1-ep2-dp2->tg2": (ParallelDims(dp=2, ep=2), 2),
    "tp2sp-etp1-ep2-dp2->tg2": (ParallelDims(tp=2, sp=True, dp=2, ep=2, etp=1), 2),
    "tp2sp-ep1->tg1": (ParallelDims(tp=2, sp=True), 1),
    "tp1-pp2-ep2-dp2->tg2": (ParallelDims(pp=2, dp=2, ep=2), 2),
    "tp2sp-etp2-ep2-dp2->tg4": (ParallelDims(tp=2, sp=True, dp=2, ep=2), 4),
    "tp1-ep4-dp4->tg2": (ParallelDims(dp=4, ep=4), 2),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_planned_bytes_equal_the_brute_force_bound(case):
    dims, t_g = LAYOUTS[case]
    specs = gathered_specs(dims)
    plan = plan_resharding(dims, GenerationDims(tp=t_g), specs)
    assert sum(1 for s in specs if s.ep_owner is not None) == 2 * E * LAYERS  # every expert, from its owners
    # the generation groups partition the world; each rank's vLLM TP rank is its index in its group
    assert sorted(r for g in plan.gen_tp_groups for r in g) == list(range(dims.world_size))
    gen_tp = {r: j for g in plan.gen_tp_groups for j, r in enumerate(g)}

    by_name: dict[str, list] = {}
    for tr in plan.transfers:
        by_name.setdefault(tr.name, []).append(tr)
    recv = [0] * dims.world_size
    bound = [0] * dims.world_size
    for spec in specs:
        have = {r: held(dims, r, spec) for r in range(dims.world_size)}
        got: dict[int, set[int]] = {r: set() for r in range(dims.world_size)}
        for tr in by_name.get(spec.name, []):
            rows = {i for a, b in tr.intervals for i in range(a, b)}
            assert rows <= have[tr.src], f"{spec.name}: rank {tr.src} sends rows it does not hold"
            assert not rows & (have[tr.dst] | got[tr.dst]), f"{spec.name}: rank {tr.dst} gets rows twice"
            assert tr.nbytes == len(rows) * spec.row_bytes
            got[tr.dst] |= rows
            recv[tr.dst] += tr.nbytes
        for r in range(dims.world_size):
            need = needed(t_g, gen_tp[r], spec)
            assert got[r] <= need, f"{spec.name}: rank {r} receives rows outside its vLLM shard"
            assert need <= have[r] | got[r], f"{spec.name}: rank {r} misses rows"
            bound[r] += len(need - have[r]) * spec.row_bytes
    assert recv == bound == [plan.recv_bytes(r) for r in range(dims.world_size)]
    assert bound == [plan.expected_recv_bytes(r) for r in range(dims.world_size)]


def test_expert_bytes_by_hand():
    """EP2 on 2 ranks (4 experts each, 2 layers, fc1 2*64x64 + fc2 64x64 fp32 = 48 KiB per expert).

    t_g=1: each rank receives the other EP rank's 4 experts whole (4*2*48 KiB) and nothing dense.
    t_g=2: each vLLM rank needs half of every expert; its own 4 experts' halves it holds, the other 4's
    halves it receives (4*2*24 KiB).
    """
    expert = (2 * F * H + H * F) * 4
    for t_g, per_rank in ((1, 4 * LAYERS * expert), (2, 4 * LAYERS * expert // 2)):
        dims = ParallelDims(dp=2, ep=2)
        plan = plan_resharding(dims, GenerationDims(tp=t_g), gathered_specs(dims))
        experts_recv = [sum(tr.nbytes for tr in plan.transfers if tr.dst == r and _EXPERT.search(tr.name))
                        for r in range(2)]
        assert experts_recv == [per_rank] * 2
        # rank 0 receives experts 4..7 only from rank 1, which holds them
        assert {int(_EXPERT.search(tr.name).group(1)) for tr in plan.transfers
                if tr.dst == 0 and _EXPERT.search(tr.name)} == {4, 5, 6, 7}
        if t_g == 1:  # dense parameters: both ranks hold them whole, nothing moves
            assert all(_EXPERT.search(tr.name) for tr in plan.transfers)


def test_expert_specs_carry_owner_and_etp_scaled_shape():
    dims = ParallelDims(tp=2, sp=True, dp=2, ep=2, etp=1)
    specs = {s.name: s for s in gathered_specs(dims)}
    fc1 = specs["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert (fc1.full_shape, fc1.partition_stride, fc1.ep_owner) == ((2 * F, H), 2, 1)
    fc2 = specs["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"]
    assert (fc2.full_shape, fc2.partition_dim, fc2.ep_owner) == ((H, F), 1, 0)
    assert specs["decoder.layers.0.mlp.router.weight"].ep_owner is None  # replicated on every rank
    assert specs["decoder.layers.0.self_attention.linear_proj.weight"].full_shape == (H, HEADS * HD)
    plan = plan_resharding(dims, GenerationDims(tp=2), list(specs.values()))
    # expert order etp-ep-edp: with etp 1 the EP rank varies fastest, ranks 0,2 are EP rank 0 and ranks 1,3
    # EP rank 1 (each holds experts 4..7 whole), although ranks 0,1 form a TP group
    assert [plan.holds(r, fc1) for r in range(4)] == [(), ((0, 128),), (), ((0, 128),)]


@pytest.mark.parametrize("spec,message", [
    (ParamSpec("x", (8, 2), 4, True, 0, 1, 0, ep_owner=2), "ep_owner=2 outside expert parallel size 2"),
    (ParamSpec("x", (6, 2), 4, True, 0, 2, 0, ep_owner=0), "partition_stride*etp = 2*2"),
])
def test_bad_expert_specs_fail_with_the_numbers(spec, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        plan_resharding(ParallelDims(tp=2, sp=True, dp=2, ep=2, etp=2), GenerationDims(tp=1), [spec])


def test_vllm_side_refuses_what_the_plan_does_not_cover():
    """An engine that splits experts otherwise than 1/t_g (vLLM DP flattens expert TP across replicas, or EP), and the
    GPU direct copy for MoE, are refused with the reason instead of loading the wrong slices."""
    from types import SimpleNamespace

    from hybridflow.resharding.vllm_layout import check_vllm_expert_split, load_into_vllm

    def engine(tp_size, use_ep=False):
        layer = torch.nn.Module()
        layer.w13_weight = torch.nn.Parameter(torch.zeros(1, device="meta"))
        layer.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_size=tp_size, use_ep=use_ep))
        model = torch.nn.Module()
        model.experts = layer
        return model

    check_vllm_expert_split(engine(2), t_g=2)
    with pytest.raises(NotImplementedError, match="splits its experts over 4 ranks .* rollout tp=2"):
        check_vllm_expert_split(engine(4), t_g=2)
    with pytest.raises(NotImplementedError, match=r"expert parallel: True"):
        check_vllm_expert_split(engine(1, use_ep=True), t_g=2)

    dims = ParallelDims(dp=2, ep=2)
    plan = plan_resharding(dims, GenerationDims(tp=2), gathered_specs(dims))
    converter = SimpleNamespace(plan=plan, t_g=2)
    runner = SimpleNamespace(reload_weights=None, model_runner=SimpleNamespace(get_model=lambda: engine(2)))
    with pytest.raises(NotImplementedError, match="MoE experts are not supported by the direct-copy path"):
        load_into_vllm(runner, iter(()), "cuda", converter=converter)
