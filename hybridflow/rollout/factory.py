"""Picks the rollout engine named in the config, with HF transformers where vLLM is missing."""

from __future__ import annotations

import importlib.util
import logging

from hybridflow.config.schema import RolloutConfig
from hybridflow.rollout.base import Rollout

logger = logging.getLogger(__name__)

ENGINES = ("vllm", "hf")


def build_rollout(model_path: str, config: RolloutConfig, **engine_kwargs) -> Rollout:
    """`config.name` "vllm" (VLLMRollout, falls back to HF with a warning when vLLM is not
    installed) or "hf" (HFRollout). engine_kwargs go to the engine's constructor."""
    if config.name not in ENGINES:
        raise ValueError(f"rollout.name={config.name!r} is not one of {ENGINES}")
    if config.name == "vllm" and importlib.util.find_spec("vllm") is not None:
        from hybridflow.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout(model_path, config, **engine_kwargs)
    if config.name == "vllm":
        logger.warning("rollout.name=vllm but vLLM is not installed; using the HF transformers rollout")
    if config.tensor_model_parallel_size != 1:
        logger.warning("the HF rollout has no tensor parallelism: rollout.tensor_model_parallel_size=%d is ignored, "
                       "every rank generates its own slice", config.tensor_model_parallel_size)
    from hybridflow.rollout.hf_rollout import HFRollout

    return HFRollout(model_path, config, **engine_kwargs)
