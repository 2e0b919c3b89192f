"""Megatron scale knobs at config time: virtual pipeline layout, activation recompute, transformer_impl,
verl's enable_gradient_checkpointing. Every bad value fails in validate() (before Ray), naming the key.
No processes: the multi-process behaviour is in tests/test_mcore_vpp.py and tests/test_mcore_recompute.py."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.load import ConfigError, load_config
from hybridflow.parallel.dims import LayoutError, ModelShape, ParallelDims, check_recompute

A = "actor_rollout_ref.actor.megatron"
OTC = f"{A}.override_transformer_config"
FOUR_LAYERS = ModelShape(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                         vocab_size=100)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    from test_data import write_verl_gsm8k

    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("knobs")
    write_verl_gsm8k(root / "train.parquet")
    model = save_tiny_model(root / "llama4", preset="tiny4l", arch="llama")  # 4 layers
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files=[{root / 'train.parquet'}]"]


def _validated(local, *overrides):
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [*local, *overrides])
    validate(cfg)
    return cfg


def test_chunk_layer_offsets_interleave_the_stages():
    dims = ParallelDims(pp=2, vpp=2).validate(model=FOUR_LAYERS)
    assert dims.layers_per_chunk(4) == 1
    assert dims.chunk_layer_offsets(4, 0) == [0, 2] and dims.chunk_layer_offsets(4, 1) == [1, 3]
    assert ParallelDims(pp=2).chunk_layer_offsets(4, 1) == [2]


def test_a_valid_vpp_and_recompute_config_passes(local):
    cfg = _validated(local, f"{A}.pipeline_model_parallel_size=2", f"{A}.virtual_pipeline_model_parallel_size=2",
                     f"{OTC}.recompute_granularity=full", f"{OTC}.recompute_method=block",
                     f"{OTC}.recompute_num_layers=1")
    # the colocated ref follows the actor's layout, VPP included
    assert cfg.actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size == 2
    _validated(local, f"{OTC}.recompute_granularity=selective", f"{A}.transformer_impl=local")


def test_enable_gradient_checkpointing_means_full_recompute_unless_the_override_says_otherwise(local):
    o = _validated(local, "actor_rollout_ref.model.enable_gradient_checkpointing=true") \
        .actor_rollout_ref.actor.megatron.override_transformer_config
    assert (o.recompute_granularity, o.recompute_method, o.recompute_num_layers) == ("full", "uniform", 1)
    o = _validated(local, "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                   f"{OTC}.recompute_granularity=selective").actor_rollout_ref.actor.megatron.override_transformer_config
    assert (o.recompute_granularity, o.recompute_method, o.recompute_num_layers) == ("selective", None, None)


def test_the_planner_reads_recompute_and_vpp_from_the_config():
    from launch.plan.job import Options, options_from_config

    cfg = load_config(None, [f"{OTC}.recompute_granularity=selective", f"{A}.virtual_pipeline_model_parallel_size=2"])
    assert options_from_config(cfg, Options()) == Options(recompute="selective", vpp=2)
    assert options_from_config(cfg, Options(recompute="full", vpp=4)) == Options(recompute="full", vpp=4)  # flags win
    cfg = load_config(None, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    assert options_from_config(cfg, Options()).recompute == "full"


# ---------------------------------------------------------------- bad input

@pytest.mark.bad_input
@pytest.mark.parametrize("overrides, match", [
    ([f"{A}.pipeline_model_parallel_size=2", f"{A}.virtual_pipeline_model_parallel_size=3"],
     rf"{A}: virtual_pipeline_model_parallel_size=3 does not divide the layers per pipeline stage "
     r"\(4 layers / pp=2 = 2\)"),
    ([f"{A}.virtual_pipeline_model_parallel_size=2"],
     rf"{A}: virtual_pipeline_model_parallel_size=2 interleaves pipeline stages: it needs "
     r"pipeline_model_parallel_size >= 2 \(got 1\)"),
    ([f"{A}.pipeline_model_parallel_size=2", f"{OTC}.recompute_granularity=full", f"{OTC}.recompute_method=uniform",
      f"{OTC}.recompute_num_layers=3"],
     rf"{OTC}.recompute_num_layers=3 is larger than the layers per pipeline stage: 4 layers / pp=2 = 2"),
    ([f"{A}.pipeline_model_parallel_size=2", f"{A}.virtual_pipeline_model_parallel_size=2",
      f"{OTC}.recompute_granularity=full", f"{OTC}.recompute_method=block", f"{OTC}.recompute_num_layers=2"],
     rf"{OTC}.recompute_num_layers=2 is larger than the layers per pipeline stage chunk: 4 layers / pp=2 x vpp=2"),
    ([f"{OTC}.recompute_granularity=partial"],
     rf"{OTC}.recompute_granularity='partial'; choose one of full, selective"),
    ([f"{OTC}.recompute_granularity=full", f"{OTC}.recompute_method=every", f"{OTC}.recompute_num_layers=1"],
     rf"{OTC}.recompute_method='every'; choose one of uniform, block"),
    ([f"{OTC}.recompute_granularity=full"], rf"{OTC}.recompute_granularity=full needs {OTC}.recompute_method"),
    ([f"{OTC}.recompute_granularity=selective", f"{OTC}.recompute_num_layers=1"],
     rf"{OTC}.recompute_num_layers=1 with recompute_granularity=selective"),
    ([f"{OTC}.recompute_method=uniform"], rf"{OTC}.recompute_method is set but {OTC}.recompute_granularity is null"),
    (["critic.megatron.override_transformer_config.recompute_granularity=fine"],
     r"critic.megatron.override_transformer_config.recompute_granularity='fine'"),
    ([f"{A}.transformer_impl=te"], rf"{A}.transformer_impl='te'; choose one of auto, local, transformer_engine"),
    ([f"{OTC}.attention_backend=fast"], rf"{OTC}.attention_backend='fast'; choose one of auto, unfused, flash, fused"),
    ([f"{OTC}.attention_backend=unfused", f"{A}.transformer_impl=transformer_engine"],
     rf"{OTC}.attention_backend=unfused picks the local spec's attention; with {A}.transformer_impl="
     r"transformer_engine only auto is accepted"),
])
def test_bad_knobs_fail_before_ray_naming_the_key(local, overrides, match):
    with pytest.raises(ValueError, match=match):
        _validated(local, *overrides)


@pytest.mark.bad_input
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_transformer_engine_without_cuda_is_refused_on_a_local_run(local):
    with pytest.raises(ValueError, match=rf"{A}.transformer_impl=transformer_engine but Transformer Engine is not "
                                         r"usable here \(no CUDA device\)"):
        _validated(local, f"{A}.transformer_impl=transformer_engine")


@pytest.mark.bad_input
def test_a_misspelt_transformer_config_field_names_the_nearest_one():
    with pytest.raises(ConfigError, match=r"unknown Megatron TransformerConfig field 'recompute_granularty' in "
                                          rf"'{OTC}.recompute_granularty'; did you mean 'recompute_granularity'\?"):
        load_config(None, [f"+{OTC}.recompute_granularty=full"])


@pytest.mark.bad_input
def test_check_recompute_alone_names_its_key():
    with pytest.raises(LayoutError, match=r"k.recompute_num_layers=0 must be >= 1"):
        check_recompute("k", "full", "uniform", 0)
