"""launch.plan on Mixture-of-Experts models, against hand-computed numbers: expert parameters and their optimizer
state per rank at EP1 and EP8, active against total parameters (FLOPs), the alltoall dispatcher's bytes, the experts
a decode batch touches, the weight-sync volume of experts, and the MoE recipes planning (exit 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.plan import Options, make_plan
from launch.plan import memory as M
from launch.plan import step_time as S
from launch.plan.__main__ import main as plan_main
from launch.plan.shapes import KNOWN_CONFIGS, shape_from_hf_config

pytestmark = pytest.mark.moe

REPO = Path(__file__).resolve().parents[1]
QWEN_4N = REPO / "configs/recipes/qwen3_30b_a3b_grpo_4nodes.yaml"
MOE_RECIPES = ["qwen3_30b_a3b_grpo_1nodes", "qwen3_30b_a3b_grpo_4nodes", "mixtral_8x7b_ppo_4nodes"]


def shape(name):
    return shape_from_hf_config(name, KNOWN_CONFIGS[name], "table")


# Qwen3-30B-A3B by hand (h 2048, 32 heads x 128, 4 KV heads, 128 experts of 768, top-8, vocab 151936, 48 layers)
EXPERT = 3 * 768 * 2048  # one expert's [gate; up] and down: 4,718,592
ATTENTION = 4 * (8 + 2) * 128 * 2048 + 2048 * 32 * 128 + 2 * 2048 + 2 * 128  # qkv, proj, 2 norms, q/k norms
ROUTER = 128 * 2048
EMBEDDING = 151936 * 2048  # 151936 is a multiple of 128: no padding at tp=1
DENSE_RANK = 48 * (ATTENTION + ROUTER) + 2 * EMBEDDING + 2048  # + output layer + final norm (tp=1, pp=1)


def test_known_moe_shapes_give_the_model_cards_totals():
    q = shape("Qwen3-30B-A3B")
    assert (q.num_experts, q.moe_topk, q.ffn_hidden_size, q.qk_norm) == (128, 8, 768, True)
    assert M.total_params(q) == DENSE_RANK + 48 * 128 * EXPERT == 30_532_122_624  # model card: 30.5B
    assert M.active_params(q) == DENSE_RANK + 48 * 8 * EXPERT == 3_353_032_704  # model card: 3.3B activated
    mix = shape("Mixtral-8x7B-v0.1")
    # Mixtral card: 46.7B total, 12.9B active (2 of 8 experts of 3 x 14336 x 4096 per layer)
    assert M.total_params(mix) == pytest.approx(46.7e9, rel=0.002)
    assert M.active_params(mix) == pytest.approx(12.9e9, rel=0.002)
    assert M.total_params(mix) - M.active_params(mix) == 32 * 6 * 3 * 14336 * 4096


def test_flops_count_active_parameters():
    q = shape("Qwen3-30B-A3B")
    assert S.matmul_params(q) == M.active_params(q) - EMBEDDING  # the input embedding is a lookup
    # dense models: active = total, the FLOP count unchanged
    llama = shape("Meta-Llama-3-8B")
    assert M.active_params(llama) == M.total_params(llama)


def test_tied_embeddings_keep_the_output_matmul():
    """Tying shares one matrix between the input lookup and the output layer: the model is V*h smaller, the matmuls
    a token runs through are the same (Qwen3-1.7B is tied; the same config untied is the reference)."""
    from launch.plan.shapes import KNOWN_CONFIGS, shape_from_hf_config

    tied = shape("Qwen3-1.7B")
    untied = shape_from_hf_config("untied", {**KNOWN_CONFIGS["Qwen3-1.7B"], "tie_word_embeddings": False}, "test")
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings
    assert M.total_params(untied) - M.total_params(tied) == 151936 * 2048
    assert S.matmul_params(tied) == S.matmul_params(untied) == M.total_params(untied) - 151936 * 2048
    # a scalar head (critic, reward model) replaces the output matmul either way
    assert S.matmul_params(tied, scalar_head=True) == S.matmul_params(untied, scalar_head=True)


def test_expert_memory_per_rank_ep1_against_ep8():
    """4 nodes x 8 H100, TP1 PP1, dp 32, bf16, distributed optimizer: EP8 keeps 16 of 128 experts per rank (expert-dp
    4), EP1 all 128 (expert-dp 32). Params and grads of the experts shrink 8x; the optimizer state does not move: the
    distributed optimizer shards experts over expert-dp, which is 8x larger at EP1."""
    per_rank = {}
    for ep in (1, 8):
        plan = make_plan(QWEN_4N, [f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
                                   f"actor_rollout_ref.ref.megatron.expert_model_parallel_size={ep}"], Options())
        d = plan.job.roles["actor"].dims
        assert (d.dp, d.ep, d.expert_dp) == (32, ep, 32 // ep)
        per_rank[ep] = plan.memory.roles["actor"]
    experts_ep8 = 48 * 16 * EXPERT  # 3,623,878,656
    experts_ep1 = 48 * 128 * EXPERT  # 28,991,029,248
    assert per_rank[8]["params"] == 2 * (DENSE_RANK + experts_ep8) == 10_329_944_064
    assert per_rank[1]["params"] == 2 * (DENSE_RANK + experts_ep1)
    assert per_rank[8]["grads"] == 4 * (DENSE_RANK + experts_ep8)  # fp32 grad buffer
    # fp32 main params + Adam (12 B): dense over dp 32, experts over expert-dp
    assert per_rank[8]["optimizer"] == pytest.approx(12 * DENSE_RANK / 32 + 12 * experts_ep8 / 4)
    assert per_rank[1]["optimizer"] == pytest.approx(12 * DENSE_RANK / 32 + 12 * experts_ep1 / 32)
    assert per_rank[1]["optimizer"] == pytest.approx(per_rank[8]["optimizer"])


def test_expert_tensor_parallel_splits_each_expert():
    mix = shape("Mixtral-8x7B-v0.1")
    one = 3 * 14336 * 4096
    assert M.layer_expert_params(mix, ep=8, etp=1) == one
    assert M.layer_expert_params(mix, ep=2, etp=4) == 4 * one // 4
    # etp defaults to tp (Megatron): TP4 without an etp splits each of the 8 experts four ways
    assert M.layer_params(mix, 4) - M.layer_params(mix, 4, ep=1, etp=4) == 0
    assert M.layer_params(mix, 4, ep=8, etp=1) - M.layer_params(mix, 4, ep=1, etp=4) == one - 8 * one // 4


def test_alltoall_bytes_for_a_batch():
    q = shape("Qwen3-30B-A3B")
    # one dispatch (or combine): each token's 2048-wide bf16 hidden state to its 8 experts, 7/8 of them off-rank
    assert S.dispatch_bytes_per_token(q, 8, 1, 2) == 8 * 2048 * 2 * 7 / 8 == 28672
    assert S.dispatch_bytes_per_token(q, 1, 1, 2) == 0
    assert S.dispatch_bytes_per_token(q, 4, 2, 2) == 8 * 2048 * 2 * (3 / 4 + 1)  # + the expert-TP gather
    plan = make_plan(QWEN_4N, [], Options())
    actor = plan.job.roles["actor"]
    # 2048 sequences over dp 32 = 64 per rank, 4096 tokens each (every response at the budget), 48 layers,
    # 4 alltoalls per layer in a training step (dispatch, combine, and their backward), over NVLink (EP8 in a node)
    # at 450 GB/s x 0.8
    want = 64 * 4096 * 48 * 4 * 28672 / (450e9 * 0.8)
    assert S.dispatcher_comm_s(plan.job, actor, 4, 4096) == pytest.approx(want)
    update = dict(next(s for s in plan.stages if s.name == "update_actor").parts)
    assert update["EP alltoall"] == pytest.approx(want)
    fwd = dict(next(s for s in plan.stages if s.name == "ref").parts)
    assert fwd["EP alltoall"] == pytest.approx(want / 2)
    # across nodes (EP 16 over 2 nodes of 8) the NIC carries it
    wide = make_plan(QWEN_4N, ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=16",
                               "actor_rollout_ref.ref.megatron.expert_model_parallel_size=16"], Options())
    assert S.alltoall_bytes_s(wide.job, 16) == 50e9 * 0.8


def test_experts_a_decode_batch_touches():
    assert M.expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert M.expected_experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert M.expected_experts_touched(128, 8, 1000) == pytest.approx(128, rel=1e-9)
    assert M.expected_experts_touched(128, 8, 4) <= min(128, 4 * 8)
    q = shape("Qwen3-30B-A3B")
    all_experts = 48 * 128 * EXPERT
    model = S.DecodeModel(1e15, 1e12, S.matmul_params(q) / 2, 2, 1e5, 48, 2048, 2, 1e11, all_experts / 2, 128, 8)
    assert model.weights_read(1) == pytest.approx(S.matmul_params(q) / 2)  # the 8 routed experts only
    assert model.weights_read(1024) == pytest.approx((M.total_params(q) - EMBEDDING) / 2)  # every expert


def test_weight_sync_volume_of_experts():
    """4 nodes, TP1 EP8 -> vLLM TP2: a rank holds the whole dense part (receives nothing of it) and 16 whole experts
    of every layer, of which it keeps half of each (its TP2 slice): it receives X/2 - X/16 of the experts X."""
    plan = make_plan(QWEN_4N, [], Options())
    experts = 48 * 128 * EXPERT * 2
    assert S.transition_recv_bytes(plan.job) == pytest.approx(experts / 2 - experts / 16)


def test_moe_activations_by_hand():
    q = shape("Qwen3-30B-A3B")
    a = M.layer_activations(q, 1, False, 1000, 1, 2, "te", "none")
    assert "mlp" not in a  # no dense MLP, no shared expert
    assert a["moe router"] == 1000 * 128 * 4
    assert a["moe expert rows"] == 1000 * 8 * 2 * (2 * 2048 + 3 * 768)
    # with sequence parallel at TP2 and ETP1 a rank feeds its experts half the tokens
    sp = M.layer_activations(q, 2, True, 1000, 1, 2, "te", "none", etp=1)
    assert sp["moe expert rows"] == a["moe expert rows"] / 2


@pytest.mark.parametrize("recipe", MOE_RECIPES)
def test_moe_recipes_plan(recipe, capsys):
    assert plan_main([str(REPO / "configs/recipes" / f"{recipe}.yaml")]) == 0  # on the recipe's plan.gpu
    out = capsys.readouterr().out
    assert "ep=8" in out and "active)" in out


def test_nemo_rl_moe_case_is_planned_with_its_setting():
    from launch.plan.published import nemo_cases

    case = next(c for c in nemo_cases() if "Qwen3-30B-A3B" in c["case"])
    assert case["published"] == 192.0 and "EP8" in case["setting"] and "gen TP2" in case["setting"]
    assert case["rel_error"] == pytest.approx((case["predicted"] - 192.0) / 192.0)


def test_moe_decode_pays_the_fused_moe_latency_once_per_layer():
    q = shape("Qwen3-30B-A3B")
    model = S.DecodeModel(1e15, 1e12, S.matmul_params(q) / 2, 2, 1e5, 48, 2048, 2, 1e11, 48 * 128 * EXPERT / 2, 128,
                          8)
    for batch in (1, 32, 512):
        with S.efficiency_overrides({"moe_decode_layer_s": 0.0}):
            without = model.step_s(batch, 1000.0 * batch)
        assert model.step_s(batch, 1000.0 * batch) - without == pytest.approx(48 * S.eff("moe_decode_layer_s"))
    dense = S.DecodeModel(1e15, 1e12, 1e9, 2, 1e5, 48, 2048, 2, 1e11)
    with S.efficiency_overrides({"moe_decode_layer_s": 1.0}):  # a dense model has no MoE layer to pay it
        assert dense.step_s(8, 8000) < 1.0


def test_decode_at_batch_one_against_vllm_on_an_a100():
    """The source of moe_decode_layer_s (tenstorrent/tt-inference-server issue #340: vLLM on one A100-80GB, ISL 128,
    OSL 128, concurrency 1, time per output token): the MoE model reproduces the 9.6 ms it was read from, and the
    same harness's dense Qwen3-1.7B, which no entry was read from, comes out within 10% of its 4.6 ms."""
    from launch.plan.devices import get_device

    a100 = get_device("a100")
    context = 128 + 128 / 2  # the mean context over the 128 output tokens
    tpot = {name: S.decode_model(shape(name), a100, 1, 2, 1e11).step_s(1, context)
            for name in ("Qwen3-30B-A3B", "Qwen3-1.7B")}
    assert tpot["Qwen3-30B-A3B"] == pytest.approx(9.6e-3, rel=0.02)
    assert tpot["Qwen3-1.7B"] == pytest.approx(4.6e-3, rel=0.10)


def test_fine_grained_expert_efficiency_is_recomputed_from_megatron_bridge():
    """moe_expert_mfu's source (Megatron-Bridge docs/performance-summary.md, 25.11, DGX-H100: Qwen3-30B-A3B
    pretraining on 16 H100, sequence 4096, EP8, 5,275 tokens/s/GPU, 121 model TFLOP/s/GPU), by hand: our FLOPs per
    token match theirs; the time per token less the rest of the model at train_mfu and the EP8 alltoall on NVLink
    leaves the experts' FLOPs at the table's efficiency."""
    q, peak, seq = shape("Qwen3-30B-A3B"), 989e12, 4096
    experts = 48 * 8 * EXPERT  # k of E per layer
    assert S.fine_expert_params(q) == experts
    rest = 6 * (S.matmul_params(q) - experts) + 3 * 2 * seq * 4096 * 48  # + causal attention fwd+bwd (q width 4096)
    assert rest + 6 * experts == pytest.approx(121e12 / 5275, rel=0.01)
    alltoall = 4 * 48 * 8 * 2048 * 2 * 7 / 8 / (450e9 * S.eff("alltoall"))  # fwd+bwd dispatch+combine, bf16, EP8
    left = 1 / 5275 - rest / (peak * S.eff("train_mfu")) - alltoall
    assert 6 * experts / (peak * left) == pytest.approx(S.eff("moe_expert_mfu"), rel=0.01)


def test_only_fine_grained_experts_run_at_the_expert_efficiency():
    """Mixtral's experts (14336 wide, hidden 4096) are coarse: planned at train_mfu like a dense MLP. Qwen3-30B-A3B's
    (768 wide, hidden 2048) are not: setting moe_expert_mfu to train_mfu gives back the all-dense plan."""
    assert S.fine_expert_params(shape("Mixtral-8x7B-v0.1")) == 0.0
    assert S.fine_expert_params(shape("Meta-Llama-3-8B")) == 0.0
    plan = lambda: make_plan(QWEN_4N, [], Options(gpu="h100"))  # noqa: E731
    train = lambda p: next(s.seconds for s in p.stages if s.name == "update_actor")  # noqa: E731
    slow = train(plan())
    with S.efficiency_overrides({"moe_expert_mfu": S.eff("train_mfu")}):
        fast = train(plan())
    # the experts are 1.81 of 3.04 B matmul parameters: their share of the math slows 0.40/0.077 = 5.2x
    assert slow > 2 * fast
