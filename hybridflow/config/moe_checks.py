"""Checks of the MoE keys that span roles (routing replay), run by preflight before Ray starts; each error names
its key. The expert mesh (ep, etp) is checked with the other mesh rules in hybridflow/parallel/dims.py and the
router options in megatron_workers/model_builder.check_moe_options."""

from __future__ import annotations

from hybridflow.algorithms.choices import require_choice
from hybridflow.parallel.dims import moe_num_experts

REPLAY_MODES = ("disabled", "R3")
REPLAY = "actor_rollout_ref.actor.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def validate_moe(cfg, actor_hf: dict) -> None:
    a = cfg.actor_rollout_ref
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
        raise ValueError(f"{REPLAY}=R3 needs actor_rollout_ref.rollout.name=hf: the vLLM rollout does not hand back "
                         f"the experts it routed each token to here (docs/moe.md); got {a.rollout.name}")
    if a.rollout.mode != "sync":
        raise ValueError(f"{REPLAY}=R3 needs actor_rollout_ref.rollout.mode=sync (got {a.rollout.mode})")
    o = a.actor.megatron.override_transformer_config
    if o.recompute_granularity is not None:
        raise ValueError(f"{REPLAY}=R3 with actor_rollout_ref.actor.megatron.override_transformer_config."
                         f"recompute_granularity={o.recompute_granularity}: a recomputed forward would route by "
                         "itself; turn recompute off for routing replay")
