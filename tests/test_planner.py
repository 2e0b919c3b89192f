"""launch.plan against independent references: published parameter counts and Megatron's bytes-per-parameter
table, the real Megatron tensors of a 2-rank gloo run (params, grad buffer, optimizer state: exact), the bytes
autograd saves for backward (activations: within 20%), the recipes' headers, the published figures, bad input."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.config.load import load_config
from launch.plan import Options, PlanInputError, make_plan
from launch.plan import memory as M
from launch.plan.__main__ import main as plan_main
from launch.plan.shapes import KNOWN_CONFIGS, resolve_shape, shape_from_hf_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))


# ---- pure: shapes and bytes per parameter -------------------------------------------------------------------------
@pytest.mark.parametrize("name, published", [
    ("Meta-Llama-3-8B", 8.03e9), ("Meta-Llama-3-70B", 70.55e9), ("Qwen2-7B", 7.62e9), ("Llama-2-7b-hf", 6.74e9),
    ("Llama-2-13b-hf", 13.02e9), ("CodeLlama-34b-hf", 33.74e9), ("Llama-2-70b-hf", 68.98e9)])
def test_known_shapes_give_the_published_parameter_counts(name, published):
    # the model cards' / safetensors index totals (HF hub), an independent check of the table and the count
    shape = shape_from_hf_config(name, KNOWN_CONFIGS[name], "table")
    assert M.total_params(shape) == pytest.approx(published, rel=0.005)
    # TP/PP shards add up to the whole, plus what Megatron adds: vocab padding rows (embedding and output layer)
    # and the norms every TP rank keeps (2 per layer + the final one)
    t, h = math.gcd(8, shape.num_kv_heads), shape.hidden_size
    pad = M.padded_vocab(shape.vocab_size, t) - shape.vocab_size
    shards = sum(M.stage_params(shape, t, 4, s) for s in range(4)) * t
    assert shards - M.total_params(shape) == 2 * pad * h + (t - 1) * (2 * h * shape.num_layers + h)


def test_bytes_per_param_match_megatron_distributed_optimizer_docs():
    # docs.nvidia.com/megatron-core/.../distrib_optimizer.html: bf16 param + fp32 grad 6 + 12/d (18 without);
    # fp32 param + fp32 grad 8 + 8/d (16 without)
    for d in (1, 2, 8):
        assert sum(M.state_bytes(1000, "bf16", True, True, d).values()) == pytest.approx(1000 * (6 + 12 / d))
        assert sum(M.state_bytes(1000, "fp32", True, True, d).values()) == pytest.approx(1000 * (8 + 8 / d))
    assert sum(M.state_bytes(1000, "bf16", True, False, 4).values()) == 18000
    assert sum(M.state_bytes(1000, "fp32", True, False, 4).values()) == 16000
    assert M.state_bytes(1000, "bf16", False, True, 4) == {"params": 2000.0, "grads": 0.0, "optimizer": 0.0}


def test_activation_formulas_follow_korthikanti_structure():
    shape = shape_from_hf_config("Meta-Llama-3-70B", KNOWN_CONFIGS["Meta-Llama-3-70B"], "table")
    s, b, t, e = 2048, 1, 8, 2
    none = M.layer_activations(shape, t, False, s, b, e, "local_unfused", "none")
    sp = M.layer_activations(shape, t, True, s, b, e, "local_unfused", "none")
    # sequence parallel divides exactly the TP-replicated parts (norms, linear inputs) by t
    assert sp["norms"] == pytest.approx(none["norms"] / t) and sp["linear inputs"] == none["linear inputs"] / t
    assert sp["mlp"] == none["mlp"] and sp["attention s^2"] == none["attention s^2"]
    # the unfused s^2 term is elem * a * s^2 * b / t (+ a bool s^2 mask): Korthikanti's 5as^2b without dropout
    assert none["attention s^2"] == e * shape.num_heads * s * s * b / t + s * s
    sel = M.layer_activations(shape, t, False, s, b, e, "local_unfused", "selective")
    assert sel["attention s^2"] == 0 and sel["mlp"] == none["mlp"]
    # the default local attention (fused SDPA) keeps no s^2 term, and selective recompute has nothing to drop
    sdpa = M.layer_activations(shape, t, False, s, b, e, "local", "none")
    assert sdpa["attention s^2"] == 0 and sdpa["mlp"] == none["mlp"]
    assert M.layer_activations(shape, t, False, s, b, e, "local", "selective") == sdpa
    # full recompute keeps 2sbh bytes (bf16) per layer, /t with SP (Korthikanti §5)
    assert M.layer_activations(shape, t, True, s, b, e, "te", "full") == {"layer input (full recompute)":
                                                                       2 * s * b * shape.hidden_size / t}
    # 1F1B: stage 0 holds p micro-batches, the last stage one; interleaved adds (p-1)/v
    assert [M.chunks_in_flight(4, k, 16) for k in range(4)] == [4, 3, 2, 1]
    assert M.chunks_in_flight(4, 0, 2) == 2
    assert M.chunks_in_flight(4, 0, 16, vpp=2) == pytest.approx(4 + 3 / 2)


def test_kv_cache_bytes_per_token():
    shape = shape_from_hf_config("Meta-Llama-3-70B", KNOWN_CONFIGS["Meta-Llama-3-70B"], "table")
    # 2 (K, V) x 80 layers x 8 kv heads x 128 x 2 bytes / t_g; t_g = 16 > kv heads keeps one head per rank
    assert M.kv_bytes_per_token(shape, 8, 2) == 2 * 80 * 1 * 128 * 2
    assert M.kv_bytes_per_token(shape, 1, 2) == 2 * 80 * 8 * 128 * 2 == 327680
    assert M.kv_bytes_per_token(shape, 16, 2) == M.kv_bytes_per_token(shape, 8, 2)


# ---- against real Megatron tensors (2 ranks, gloo) -------------------------------------------------------------
@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from train_common import run_torchrun

    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("plan_measure")
    model = save_tiny_model(root / "llama", preset="tiny4l", arch="llama")
    run_torchrun("plan_measure.py", 2, ["--model", str(model), "--out", str(root / "out"), "--seq", "64",
                                        "--micro", "2"])
    ranks = [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    return resolve_shape("model", str(model)), ranks


@pytest.mark.slow
def test_state_bytes_equal_the_real_megatron_tensors(measured):
    shape, ranks = measured
    for rank in ranks:
        for st in rank["state"]:  # TP=2 (dp 1) and TP=1 (dp 2): fp32 on CPU, distributed optimizer
            n = M.stage_params(shape, st["tp"], 1, 0)
            want = M.state_bytes(n, "fp32", trainable=True, dist_opt=True, dp=st["dp"])
            assert st["params"] == want["params"], st
            assert st["grads"] == want["grads"] == st["grad_buffer"], st
            assert st["optimizer"] == want["optimizer"], st


@pytest.mark.slow
def test_activation_estimate_within_20_percent_of_saved_tensors(measured):
    shape, ranks = measured
    for m in ranks[0]["activations"]:
        profile = M.LOCAL_PROFILES[m["attention"]]
        layers = sum(M.layer_activations(shape, m["tp"], m["sp"], m["seq"], m["micro"], 4, profile,
                                         m["recompute"]).values())
        final_norm = M.head_activations(shape, m["tp"], m["sp"], m["seq"], m["micro"], 4, profile, False)["final norm"]
        predicted = layers * shape.num_layers + final_norm
        assert predicted == pytest.approx(m["bytes"], rel=0.20), m
    by_mode = {(m["tp"], m["sp"], m["recompute"], m["attention"]): m["bytes"] for m in ranks[0]["activations"]}
    # selective recompute drops the unfused attention's s^2 tensors; full keeps only the layer inputs
    assert by_mode[(2, False, "full", "auto")] < by_mode[(2, False, "selective", "unfused")] \
        < by_mode[(2, False, "none", "unfused")]
    # the fused SDPA keeps no s^2 tensor: less than the unfused attention, and no less than its selective recompute
    assert by_mode[(2, False, "none", "auto")] < by_mode[(2, False, "none", "unfused")]
    assert by_mode[(2, False, "selective", "auto")] == pytest.approx(by_mode[(2, False, "none", "auto")], rel=0.05)
    assert by_mode[(2, True, "none", "auto")] < by_mode[(2, False, "none", "auto")] \
        < by_mode[(1, False, "none", "auto")]


# ---- recipes ------------------------------------------------------------------------------------------------------
def _header(path: Path) -> dict:
    text = path.read_text()
    plan = re.search(r"^# plan: python -m launch\.plan (\S+)(.*)$", text, re.M)
    mem = re.search(r"^# expected memory per GPU: ([\d.]+) GiB", text, re.M)
    device = re.search(r"^# expected memory per GPU: .* GiB on (\S+)\)$", text, re.M)
    step = re.search(r"^# expected step time: (\d+) s", text, re.M)
    assert plan and mem and device and step, f"{path.name}: header lines missing"
    flags = plan.group(2).split()
    opts = dict(zip(flags[::2], flags[1::2]))
    return {"config": plan.group(1), "flags": opts, "recompute": opts.get("--recompute", "none"),
            "mem": float(mem.group(1)), "step": float(step.group(1)), "device": device.group(1), "text": text}


def test_there_are_the_asked_recipes():
    names = {p.stem for p in RECIPES}
    assert {"llama3_70b_ppo_8nodes", "llama3_70b_ppo_16nodes", "llama3_70b_ppo_32nodes", "qwen2_7b_ppo_1node",
            "qwen2_7b_grpo_1node", "llama3_8b_grpo_1node", "llama3_8b_grpo_2nodes"} <= names
    script = (REPO / "configs" / "recipes" / "run_recipe.sh").read_text()
    assert "python\" -m hybridflow.trainer.main" in script.replace("$PYTHON", "python") or \
        "-m hybridflow.trainer.main --config" in script
    assert "launch.cluster" in script and "launch.submit" in script


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_validates_fits_and_header_matches_planner(recipe):
    from hybridflow.parallel.dims import ParallelDims
    from launch.plan.devices import get_device

    cfg = load_config(recipe)  # the trainer's loader: unknown keys would fail here
    h = _header(recipe)
    assert h["config"] == f"configs/recipes/{recipe.name}"
    assert "Not in the config schema yet" in h["text"]
    # the recipe names its GPU (plan.gpu), so its plan command needs no --gpu, and planning without one uses it
    assert cfg.plan.gpu and "--gpu" not in h["flags"], recipe.name
    plan = make_plan(recipe, [], Options(recompute=h["recompute"]))
    assert plan.job.device == get_device(cfg.plan.gpu) and plan.job.device.name == h["device"]
    actor = plan.job.roles["actor"]
    m = cfg.actor_rollout_ref.actor.megatron
    # the layout check the trainer runs, on the recipe's model shape
    ParallelDims(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                 dp=plan.job.world // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size),
                 sp=m.sequence_parallel).validate(plan.job.world, actor.shape.model_shape)
    assert plan.memory.fits, recipe.name
    assert plan.memory.peak.total / M.GiB == pytest.approx(h["mem"], abs=0.051)
    assert plan.step_s == pytest.approx(h["step"], abs=0.51)


# ---- against the published figures -------------------------------------------------------------------------------
def test_against_paper_prints_a_table_then_one_json_line(capsys):
    assert plan_main(["--against-paper"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert "rel. error" in out[0]
    values = [c for c in result["cases"] if c["kind"] == "value"]
    published = {c["published"] for c in values}
    # FACTS.md's figures, not ours: verl 1109 / 2467 tokens/GPU/s; the paper's 89.1% and 78.2 s at 70B
    assert {1109.0, 2467.0, 0.891, 78.2} <= published
    assert result["max_rel_error"] == pytest.approx(max(abs(c["rel_error"]) for c in values))
    for c in values:
        assert c["rel_error"] == pytest.approx((c["predicted"] - c["published"]) / c["published"])
    layouts = [c for c in result["cases"] if c["kind"] == "layout"]
    assert len(layouts) == 4 and all(c["paper_layout_fits"] for c in layouts)


# ---- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.bad_input
def test_more_gpus_than_the_cluster_has():
    with pytest.raises(PlanInputError, match=r"actor_rollout_ref.actor.megatron: tp\*pp\*cp = 8\*8\*1 = 64 GPUs, "
                                             r"more than trainer.nnodes\*n_gpus_per_node = 8"):
        make_plan(REPO / "configs/recipes/llama3_70b_ppo_16nodes.yaml", ["trainer.nnodes=1"], Options(gpu="a100"))


@pytest.mark.bad_input
@pytest.mark.parametrize("recipe, overrides, message", [
    ("qwen2_7b_grpo_1node", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=7",
                             "trainer.n_gpus_per_node=7", "actor_rollout_ref.rollout.tensor_model_parallel_size=7"],
     "actor_rollout_ref.actor.megatron: tp=7 does not divide num_key_value_heads=4 (model Qwen2-7B)"),
    ("llama3_8b_grpo_1node", ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3",
                              "trainer.n_gpus_per_node=6"],
     "actor_rollout_ref.actor.megatron: pp=3 does not divide num_hidden_layers=32"),
    ("qwen2_7b_grpo_1node", ["actor_rollout_ref.rollout.tensor_model_parallel_size=8"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size: rollout tp=8 does not divide num_attention_heads=28"),
])
def test_layout_that_does_not_divide_the_model(recipe, overrides, message):
    with pytest.raises(PlanInputError, match=re.escape(message)):
        make_plan(REPO / f"configs/recipes/{recipe}.yaml", overrides, Options())


@pytest.mark.bad_input
def test_layout_that_does_not_divide_heads():
    with pytest.raises(PlanInputError, match=re.escape("tp=3 does not divide num_attention_heads=32")):
        make_plan(REPO / "configs/recipes/llama3_8b_grpo_1node.yaml",
                  ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3", "trainer.n_gpus_per_node=6",
                   "actor_rollout_ref.rollout.tensor_model_parallel_size=3"], Options())


@pytest.mark.bad_input
def test_unknown_model_without_a_path(capsys):
    rc = plan_main([str(REPO / "configs/recipes/llama3_8b_grpo_1node.yaml"),
                    "actor_rollout_ref.model.path=models/Mystery-13B"])
    err = capsys.readouterr().err
    assert rc == 2 and "actor_rollout_ref.model.path='models/Mystery-13B'" in err and "not a known model" in err


@pytest.mark.bad_input
def test_unknown_gpu(capsys):
    rc = plan_main([str(REPO / "configs/recipes/llama3_8b_grpo_1node.yaml"), "--gpu", "v100"])
    err = capsys.readouterr().err
    assert rc == 2 and "--gpu 'v100' is not a known device; known: a100, h100, h200" in err
    rc = plan_main([str(REPO / "configs/recipes/llama3_8b_grpo_1node.yaml"), "plan.gpu=v100"])
    err = capsys.readouterr().err
    assert rc == 2 and "plan.gpu 'v100' is not a known device; known: a100, h100, h200" in err


def test_the_config_names_the_gpu_and_the_flag_wins(capsys):
    """The H200 recipe plans with no flag (it fits 141 GB, not 80), --gpu h100 still plans on an H100 (and does not
    fit), and a config with no plan.gpu plans on the H100."""
    recipe = str(REPO / "configs/recipes/qwen3_30b_a3b_grpo_1nodes.yaml")
    assert plan_main([recipe]) == 0
    assert "of 139.7 GiB (H200-SXM-141GB): fits" in capsys.readouterr().out
    assert plan_main([recipe, "--gpu", "h100"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert make_plan(recipe, ["plan.gpu=null"]).job.device.name == "H100-SXM5-80GB"


def test_no_fit_names_stage_role_component_overflow_and_knob(capsys):
    # the 8-node 70B recipe with nothing offloaded and 16-sequence micro-batches does not fit an A100
    rc = plan_main([str(REPO / "configs/recipes/llama3_70b_ppo_8nodes.yaml"), "--gpu", "a100",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                    "critic.megatron.optimizer_offload=false", "critic.megatron.grad_offload=false",
                    "critic.megatron.param_offload=false"])
    err = capsys.readouterr().err
    assert rc == 1
    m = re.search(r"does not fit: stage update_actor needs ([\d.]+) GiB per GPU on A100-SXM4-80GB \(79\.3 GiB\), "
                  r"over by ([\d.]+) GiB; the largest part is actor activations", err)
    assert m and float(m.group(1)) - 79.3 == pytest.approx(float(m.group(2)), abs=0.11), err
    assert "try: --recompute full" in err and "critic.megatron.optimizer_offload=true" in err


def test_cli_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "launch.plan", "configs/recipes/qwen2_7b_grpo_1node.yaml", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["fits"] and summary["step_s"] == pytest.approx(sum(summary["stages_s"].values()))


def test_old_log_prob_pass_follows_the_trainer_rule():
    from hybridflow.trainer.ppo_trainer import skips_old_log_prob

    recipe = REPO / "configs/recipes/llama3_8b_grpo_1node.yaml"
    on_policy = ["actor_rollout_ref.actor.ppo_mini_batch_size=256"]  # = data.train_batch_size, one epoch
    assert not skips_old_log_prob(load_config(recipe)) and skips_old_log_prob(load_config(recipe, on_policy))
    assert not skips_old_log_prob(load_config(recipe, [*on_policy, "actor_rollout_ref.recompute_old_log_prob=true"]))
    stages = lambda o: [s.name for s in make_plan(recipe, o, Options()).stages]  # noqa: E731
    assert "old_log_prob" in stages([]) and "old_log_prob" not in stages(on_policy)


def test_kv_cache_from_gpu_memory_utilization_when_no_byte_size():
    recipe = REPO / "configs/recipes/llama3_70b_ppo_16nodes.yaml"
    plan = make_plan(recipe, ["actor_rollout_ref.rollout.kv_cache_memory_bytes=null",
                              "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"], Options(gpu="a100"))
    ro = plan.memory.roles["rollout"]
    # vLLM's whole share (weights + runtime + KV) is 0.6 of the device
    assert ro["vLLM weights"] + ro["vLLM runtime"] + ro["KV cache"] == pytest.approx(0.6 * plan.job.device.memory_bytes,
                                                                                     abs=1)
    with pytest.raises(PlanInputError, match="gpu_memory_utilization=0.1 leaves no KV cache"):
        make_plan(recipe, ["actor_rollout_ref.rollout.kv_cache_memory_bytes=null",
                           "actor_rollout_ref.rollout.gpu_memory_utilization=0.1"], Options(gpu="a100"))


def test_docs_recipes_table_matches_the_headers():
    text = (REPO / "docs" / "scale.md").read_text()
    rows = re.findall(r"^\| (\w+) \|.*\| ([\d.]+) GiB \| (\d+) s \|$", text, re.M)
    assert {name for name, _, _ in rows} == {p.stem for p in RECIPES}
    for name, mem, step in rows:
        h = _header(REPO / "configs" / "recipes" / f"{name}.yaml")
        assert (float(mem), float(step)) == (h["mem"], h["step"]), name


def test_shape_from_config_json_wins_and_reward_models_read_as_their_body(tmp_path):
    rm = tmp_path / "my-rm"
    rm.mkdir()
    cfg = {**KNOWN_CONFIGS["Meta-Llama-3-8B"], "num_hidden_layers": 4,
           "architectures": ["LlamaForSequenceClassification"]}
    (rm / "config.json").write_text(json.dumps(cfg))
    shape = resolve_shape("reward_model.model.path", str(rm))
    assert shape.num_layers == 4 and shape.source.endswith("config.json")
    assert resolve_shape("m", "/nowhere/Meta-Llama-3-8B-Instruct").num_layers == 32  # the table, by basename


def test_presets_plan_the_trainers_pools():
    recipe = REPO / "configs/recipes/qwen2_7b_ppo_1node.yaml"
    colo = make_plan(recipe, [], Options())
    alone = make_plan(recipe, ["trainer.placement=standalone"], Options())
    split = make_plan(recipe, ["trainer.placement=split"], Options())
    assert colo.job.total_gpus == 8 and alone.job.total_gpus == 8 * 3  # actor_rollout, ref, critic
    assert split.job.pools == ["actor_ref", "critic_rm"] and split.job.total_gpus == 8 * 2
    for plan in (alone, split):
        for phase in plan.memory.phases:  # a pool's stage only holds its own roles
            pool_roles = {r for r, role in plan.job.roles.items() if role.pool == phase.pool} | {"gpu", "rollout"}
            assert {r for r, _, _ in phase.items} <= pool_roles
    assert alone.memory.peak.total < colo.memory.peak.total + 1
    assert alone.tokens_per_gpu_s == pytest.approx(colo.tokens_per_gpu_s * colo.step_s / alone.step_s / 3)
    with pytest.raises(PlanInputError, match="trainer.resource_pools: the planner models the presets"):
        make_plan(recipe, ["trainer.resource_pools.a=[8]", "trainer.role_pools.actor_rollout=a"], Options())
