"""Megatron's own config fields (verl's override_transformer_config / override_optimizer_config): any field of
megatron-core's TransformerConfig / OptimizerConfig by name, refused where one of our keys owns it, and the CUDA-only
ones left at their portable values without CUDA (hybridflow/config/megatron_checks.py)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from hybridflow.config import megatron_checks as mc
from hybridflow.config.load import ConfigError, is_valid_key, load_config

T = "actor_rollout_ref.actor.megatron.override_transformer_config"
O = "actor_rollout_ref.actor.optim.override_optimizer_config"  # noqa: E741


def test_field_names_read_from_the_source_are_the_dataclasses_fields():
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert mc.field_names(mc.TRANSFORMER) == {f.name for f in dataclasses.fields(TransformerConfig)}
    assert mc.field_names(mc.OPTIMIZER) == {f.name for f in dataclasses.fields(OptimizerConfig)}
    for table in (mc.OWNED, mc.NOT_SUPPORTED, mc.CUDA_ONLY):  # every field the tables name exists
        for which, fields in table.items():
            assert set(fields) <= mc.field_names(which), set(fields) - mc.field_names(which)


def test_any_field_passes_through_by_name_and_owned_ones_name_our_key():
    cfg = load_config(None, [f"+{T}.apply_rope_fusion=true", f"+{T}.deallocate_pipeline_outputs=true",
                             f"+{T}.moe_z_loss_coeff=0.001", f"{T}.recompute_granularity=full",
                             f"+{O}.optimizer_cpu_offload=true", f"+{O}.adam_eps=1e-6"])
    o = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert o.other == {"apply_rope_fusion": True, "deallocate_pipeline_outputs": True, "moe_z_loss_coeff": 0.001}
    assert o.recompute_granularity == "full"  # a typed field stays typed
    assert cfg.actor_rollout_ref.actor.optim.override_optimizer_config.other == {"optimizer_cpu_offload": True,
                                                                                   "adam_eps": 1e-6}
    for field, ours in (("tensor_model_parallel_size", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
                        ("sequence_parallel", "actor_rollout_ref.actor.megatron.sequence_parallel"),
                        ("bf16", "actor_rollout_ref.model.dtype")):
        with pytest.raises(ConfigError, match=rf"'{T}.{field}=.*' is refused here.*instead: {ours}"):
            load_config(None, [f"+{T}.{field}=1"])
        assert is_valid_key(ours)
    with pytest.raises(ConfigError, match=rf"'{O}.lr=0.5' is refused.*instead: actor_rollout_ref.actor.optim.lr"):
        load_config(None, [f"+{O}.lr=0.5"])
    # uneven pipeline stages: Megatron's default value is accepted, any other refused
    load_config(None, [f"+{T}.account_for_loss_in_pipeline_split=false"])
    with pytest.raises(ConfigError, match="uneven pipeline stages are not supported yet"):
        load_config(None, [f"+{T}.num_layers_in_last_pipeline_stage=2"])


@pytest.mark.bad_input
def test_a_misspelt_megatron_field_names_the_nearest_one():
    with pytest.raises(ConfigError, match=r"unknown Megatron TransformerConfig field 'moe_permute_fushion' in "
                                          rf"'{T}.moe_permute_fushion'; did you mean 'moe_permute_fusion'"):
        load_config(None, [f"+{T}.moe_permute_fushion=true"])
    with pytest.raises(ConfigError, match=r"unknown Megatron OptimizerConfig field 'optimizer_cpu_ofload'.*"
                                          r"did you mean 'optimizer_cpu_offload'"):
        load_config(None, [f"+{O}.optimizer_cpu_ofload=true"])
    with pytest.raises(ConfigError, match=r"unknown Megatron TransformerConfig field 'not_a_field'"):  # via `other`
        load_config(None, [f"{T}.other.not_a_field=1"])


def test_cuda_only_fields_are_dropped_without_cuda_and_kept_with_it():
    cfg = load_config(None, [f"+{T}.apply_rope_fusion=true", f"+{T}.moe_enable_deepep=true",
                             f"+{T}.gradient_accumulation_fusion=false", f"+{T}.deallocate_pipeline_outputs=true",
                             f"+{T}.moe_z_loss_coeff=0.01"])
    o = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert mc.transformer_fields(o, on_cuda=False) == {"gradient_accumulation_fusion": False,  # off is portable
                                                       "deallocate_pipeline_outputs": True, "moe_z_loss_coeff": 0.01}
    assert mc.transformer_fields(o, on_cuda=True) == o.other
    cfg = load_config(None, [f"+{O}.optimizer_cpu_offload=true", f"+{O}.optimizer_offload_fraction=0.5",
                             f"+{O}.adam_eps=1e-6"])
    section = cfg.actor_rollout_ref.actor.optim.override_optimizer_config
    assert mc.optimizer_fields(section, on_cuda=False) == {"adam_eps": 1e-6}
    assert mc.optimizer_fields(section, on_cuda=True) == section.other


def test_cuda_only_settings_are_logged_once_without_cuda(caplog):
    cfg = load_config(None, [f"+{T}.apply_rope_fusion=true", f"{T}.moe_token_dispatcher_type=flex",
                             f"+{O}.optimizer_cpu_offload=true", f"+{T}.masked_softmax_fusion=false"])
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        named = mc.log_cuda_only(cfg, on_cuda=False)
    assert named == [f"actor_rollout_ref.actor.megatron.override_transformer_config.{s}" for s in
                     ("moe_token_dispatcher_type=flex", "apply_rope_fusion=True")] + [f"{O}.optimizer_cpu_offload=True"]
    lines = [r.getMessage() for r in caplog.records if "need CUDA" in r.getMessage()]
    assert len(lines) == 1 and all(s in lines[0] for s in named)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        mc.log_cuda_only(cfg, on_cuda=True)
    assert not any("need CUDA" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU build")
def test_the_model_builder_passes_the_fields_to_megatron_without_the_cuda_only_ones(tmp_path):
    from hybridflow.models.tiny import save_tiny_config
    from hybridflow.parallel.dims import ParallelDims
    from megatron_workers.model_builder import build_transformer_config

    hf = json.loads((save_tiny_config(tmp_path, preset="tiny", arch="qwen3_moe") / "config.json").read_text())
    cfg = load_config(None, [f"+{T}.apply_rope_fusion=true", f"{T}.moe_token_dispatcher_type=flex",
                             f"{T}.moe_grouped_gemm=true", f"{T}.attention_backend=flash",
                             f"+{T}.deallocate_pipeline_outputs=true", f"+{T}.moe_z_loss_coeff=0.001",
                             f"+{T}.hidden_dropout=0.0"])
    tc = build_transformer_config(hf, ParallelDims(), megatron_cfg=cfg.actor_rollout_ref.actor.megatron)
    assert (tc.deallocate_pipeline_outputs, tc.moe_z_loss_coeff) == (True, 0.001)  # passed through
    # CUDA-only: the builder's portable values
    assert (tc.apply_rope_fusion, tc.moe_token_dispatcher_type, tc.moe_grouped_gemm) == (False, "alltoall", False)
    assert tc.attention_backend.name == "auto"


def test_the_planner_reads_the_optimizer_offload_and_max_num_seqs():
    from launch.plan import Options, make_plan

    recipe = "configs/recipes/qwen3_30b_a3b_grpo_1nodes.yaml"
    base = make_plan(recipe, None, Options(gpu="h200"))
    offload = [f"+{O}.optimizer_cpu_offload=true", f"+{O}.optimizer_offload_fraction=0.75",
               "actor_rollout_ref.rollout.max_num_seqs=64"]
    plan = make_plan(recipe, offload, Options(gpu="h200"))
    assert plan.memory.roles["actor"]["optimizer"] == pytest.approx(0.25 * base.memory.roles["actor"]["optimizer"])
    assert plan.memory.roles["actor"]["params"] == base.memory.roles["actor"]["params"]
    assert plan.job.options.max_num_seqs == 64 and base.job.options.max_num_seqs == 256
