"""ActorRolloutRefWorker: the policy (actor), its frozen reference copy, and the rollout hook, in one process.

One Ray actor per rank; the worker group runs the same method on every rank
(SPMD). The actor and the reference model share the process and its Megatron
parallel groups, so they must use the same TP/PP/CP layout.

Batch keys (verl's layout): input_ids / attention_mask / position_ids (B, P+R),
responses and response_mask (B, R). Log-probs, entropies and losses are over
the response tokens only, (B, R). Log-probs are computed vocab-parallel from
the TP-sharded logits (logprob.py), never from a gathered vocabulary.

Rollout: the generation engine (vLLM) and the 3D-HybridEngine resharding live in
the same process (megatron_workers/rollout_role.py); `attach_rollout` runs after
the actor is built, and `generate_sequences` reshards the live weights first.
"""

from __future__ import annotations

import logging

import torch

from hybridflow.config.schema import ActorRolloutRefConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import DataProto
from hybridflow.rollout.moe_routing import ROUTED_EXPERTS
from megatron_workers.engine import agg_count, as_config, build_role_engine, init_megatron, mesh_coords, micro_agg_mode
from megatron_workers.offload import Offloader, make_offloader
from megatron_workers.perf import UpdatePerf
from megatron_workers.rollout_role import RolloutRole
from megatron_workers.weight_sync_role import WeightSenderRole

logger = logging.getLogger(__name__)

ROLES = ("actor", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")
MESH = "actor"
# loss_fn metrics that are per-token means in every loss_agg_mode (masked_mean), not aggregated like the loss
TOKEN_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "rollout_logprob_diff",
                 "rollout_corr/rollout_is_mean", "rollout_corr/logprob_diff_mean")


def response_logprobs(logits: torch.Tensor, micro: dict, response_length: int, real_vocab_size: int,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(response token), entropy) per response token, (b, R) each, from packed TP-sharded logits.

    `micro` carries the engine's packing (packed_input_ids / packed_mask / pack_index). Differentiable.
    """
    from megatron_workers.logprob import unpack_next_token, vocab_parallel_logprobs_entropy

    device = logits.device
    ids = micro["packed_input_ids"].to(device)
    logprob, entropy = vocab_parallel_logprobs_entropy(logits[:, :-1], ids[:, 1:], real_vocab_size,
                                                       temperature=temperature)
    mask, index = micro["packed_mask"].to(device), micro["pack_index"].to(device)
    seq_len = micro["attention_mask"].shape[1]
    # unpack_next_token: column k-1 holds the value for original token k; responses are the last R columns.
    logprob = unpack_next_token(logprob, mask, index, seq_len)[:, -response_length:]
    entropy = unpack_next_token(entropy, mask, index, seq_len)[:, -response_length:]
    return logprob, entropy


class ActorRolloutRefWorker(RolloutRole, WeightSenderRole, Worker):
    def __init__(self, config, role: str):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker role {role!r} is not one of {ROLES}")
        self.config: ActorRolloutRefConfig = as_config(config, ActorRolloutRefConfig)
        self.role = role
        self.is_actor = role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref")
        self.is_ref = role in ("ref", "actor_ref", "actor_rollout_ref")
        self.is_rollout = role in ("actor_rollout", "actor_rollout_ref")
        self.actor = None  # MegatronEngine with optimizer
        self.ref = None  # MegatronEngine, forward only
        self.rollout = None  # set by attach_rollout (the rollout/resharding work)
        self.dims = None
        self.actor_offload = None  # Offloader: training state off the device between calls
        self.ref_offload = None

    # ------------------------------------------------------------------ set-up

    def _megatron_cfg(self):
        actor_m, ref_m = self.config.actor.megatron, self.config.ref.megatron
        if self.is_actor and self.is_ref:
            lay = lambda m: (m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                             m.virtual_pipeline_model_parallel_size or 1, m.context_parallel_size)
            a, r = lay(actor_m), lay(ref_m)
            if a != r:
                raise ValueError(f"actor and ref share a process, so their (tp, pp, vpp, cp) must match: "
                                 f"actor {a}, ref {r}")
        return actor_m if self.is_actor else ref_m

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        megatron_cfg = self._megatron_cfg()
        self.dims = init_megatron(megatron_cfg)
        model_cfg = self.config.model
        if self.is_actor:
            self.actor = build_role_engine(model_cfg.path, self.dims, model_cfg.dtype, optim=self.config.actor.optim,
                                           megatron_cfg=megatron_cfg)
            self.actor_offload = make_offloader(self.actor, self.config.actor.megatron)
            self.actor.nonfinite.stage = "update_actor"
        if self.is_ref:
            ref_m = self.config.ref.megatron
            self.ref = build_role_engine(model_cfg.path, self.dims, model_cfg.dtype, megatron_cfg=ref_m)
            self.ref_offload = Offloader(self.ref, params=ref_m.param_offload, grads=False, optimizer=False)
        self.set_mesh_coords(MESH, **mesh_coords())
        if self.is_rollout:
            self.attach_rollout()
        for offloader in (self.actor_offload, self.ref_offload):
            if offloader is not None:
                offloader.offload()

    # ------------------------------------------------------------------ log-probs

    def _replaying(self) -> bool:
        """Routing replay (actor.router_replay.mode=R3): the actor's forwards take the rollout's experts."""
        return self.config.actor.router_replay.mode == "R3"

    def _logprobs(self, engine, data: DataProto, micro_batch_size: int,
                  max_tokens: int | None = None, replay: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        response_length = data.batch["responses"].shape[1]
        temperature = float(data.meta_info.get("temperature", self.config.rollout.temperature))
        batch = {k: data.batch[k] for k in ("input_ids", "attention_mask")}
        if replay:
            batch[ROUTED_EXPERTS] = _routed(data)

        def post(logits, micro):
            lp, ent = response_logprobs(logits, micro, response_length, engine.hf_vocab_size, temperature)
            return {"log_prob": lp.float(), "entropy": ent.float()}

        out = engine.forward_only(batch, micro_batch_size, post, max_tokens=max_tokens)
        return out["log_prob"], out["entropy"]

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=MESH)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """The current policy's log-probs and entropies of the responses: `old_log_probs`, `entropys`."""
        if self.actor is None:
            raise RuntimeError(f"compute_log_prob needs the actor; this worker's role is {self.role!r}")
        r = self.config.rollout
        budget = r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None
        with self.actor_offload.resident():
            log_prob, entropy = self._logprobs(self.actor, data, r.log_prob_micro_batch_size_per_gpu, budget,
                                               replay=self._replaying())
        temperature = data.meta_info.get("temperature", self.config.rollout.temperature)
        # perf/* in meta_info: the driver's step lifts it into the step's metrics (a key per stage, so the
        # union of several stages' outputs into one batch never clashes).
        return DataProto.from_dict({"old_log_probs": log_prob, "entropys": entropy},
                                   meta_info={"temperature": temperature,
                                              "perf/padding_fraction/old_log_prob": self.actor.padding_fraction})

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=MESH)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        if self.ref is None:
            raise RuntimeError(f"compute_ref_log_prob needs the ref model; this worker's role is {self.role!r}")
        r = self.config.ref
        budget = r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None
        with self.ref_offload.resident():
            log_prob, _ = self._logprobs(self.ref, data, r.log_prob_micro_batch_size_per_gpu, budget)
        return DataProto.from_dict({"ref_log_prob": log_prob},
                                   meta_info={"perf/padding_fraction/ref": self.ref.padding_fraction})

    # ------------------------------------------------------------------ training

    def _policy_loss_fn(self, response_length: int, temperature: float, on_policy: bool = False,
                        bypass: bool = False, loss_agg_mode: str | None = None):
        from hybridflow.algorithms import agg_loss, compute_policy_loss, kl_penalty, masked_mean

        cfg = self.config.actor
        low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
        high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
        vocab = self.actor.hf_vocab_size
        # token-sum: token-means scaled back by train_step
        mode, _ = micro_agg_mode(loss_agg_mode if loss_agg_mode is not None else cfg.loss_agg_mode)

        def loss_fn(logits, micro):
            log_prob, entropy = response_logprobs(logits, micro, response_length, vocab, temperature)
            mask = micro["response_mask"].to(log_prob.device)
            get = lambda k: micro[k].to(log_prob.device)
            # On-policy single update: the ratio is taken against this very forward (detached), so the
            # driver skipped the separate old-log-prob pass.
            old = log_prob.detach() if on_policy else get("old_log_probs")
            # rollout correction, decoupled mode: the driver's truncated IS weights pi_old / pi_rollout (detached)
            weights = get("rollout_is_weights") if "rollout_is_weights" in micro else None
            pg = compute_policy_loss(old, log_prob, get("advantages"), mask, clip_ratio_low=low,
                                     clip_ratio_high=high, clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=mode,
                                     loss_scale_factor=cfg.loss_scale_factor, rollout_is_weights=weights)
            entropy_agg = agg_loss(entropy, mask, mode, loss_scale_factor=cfg.loss_scale_factor)
            loss = pg["pg_loss"] - cfg.entropy_coeff * entropy_agg
            metrics = {"pg_loss": pg["pg_loss"], "pg_clipfrac": pg["pg_clipfrac"], "ppo_kl": pg["ppo_kl"],
                       "pg_clipfrac_lower": pg["pg_clipfrac_lower"], "entropy": entropy_agg}
            if on_policy and "old_log_probs" in micro:  # the rollout engine's log-probs: report the mismatch
                diff = (log_prob.detach() - get("old_log_probs")).abs()
                metrics["rollout_logprob_diff"] = (diff * mask).sum() / mask.sum().clamp(min=1)
            if bypass:  # old is the rollout's: the off-policy ratio pi_theta / pi_rollout at this update's weights
                lr = (log_prob.detach() - old).clamp(-20.0, 20.0)
                metrics["rollout_corr/rollout_is_mean"] = masked_mean(lr.exp(), mask)
                metrics["rollout_corr/logprob_diff_mean"] = masked_mean(lr.abs(), mask)
            if cfg.use_kl_loss:
                kl = agg_loss(kl_penalty(log_prob, get("ref_log_prob"), cfg.kl_loss_type), mask, mode,
                              loss_scale_factor=cfg.loss_scale_factor)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["kl_loss"] = kl
            return loss, {k: v.detach() for k, v in metrics.items()}

        return loss_fn

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=MESH)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches of this DP shard; returns meta_info['metrics'] (means over updates).

        meta_info `loss_agg_mode`: the driver's actor.loss_agg_mode for this call (default: this worker's config)."""
        if self.actor is None:
            raise RuntimeError(f"update_actor needs the actor; this worker's role is {self.role!r}")
        cfg = self.config.actor
        on_policy = bool(data.meta_info.get("old_log_prob_from_update", False))
        keys = ["input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages"]
        if on_policy and "old_log_probs" not in data.batch:  # rollout.calculate_log_probs=false: none to compare
            keys.remove("old_log_probs")
        if cfg.use_kl_loss:
            keys.append("ref_log_prob")
        if "rollout_is_weights" in data.batch:  # algorithm.rollout_correction (decoupled): the driver's weights
            keys.append("rollout_is_weights")
        if self._replaying():
            _routed(data)
            keys.append(ROUTED_EXPERTS)
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise KeyError(f"update_actor: batch lacks {missing} (has {sorted(data.batch)})")
        dp_size = self.dims.dp
        rows = cfg.ppo_mini_batch_size * self.config.rollout.n
        if rows % dp_size:
            raise ValueError(f"ppo_mini_batch_size * rollout.n = {rows} is not divisible by the actor DP size "
                             f"{dp_size}")
        mini_batch = rows // dp_size
        response_length = data.batch["responses"].shape[1]
        temperature = float(data.meta_info.get("temperature", self.config.rollout.temperature))
        bypass = bool(data.meta_info.get("rollout_correction_bypass", False))
        agg = str(data.meta_info.get("loss_agg_mode", cfg.loss_agg_mode))
        loss_fn = self._policy_loss_fn(response_length, temperature, on_policy, bypass, loss_agg_mode=agg)
        count_fn = lambda micro: agg_count(micro, agg)
        _, sum_loss = micro_agg_mode(agg)
        selected = data.select(batch_keys=keys)
        budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        seed = int(data.meta_info.get("global_step", 0)) + self.config.actor.megatron.seed
        history: dict[str, list[float]] = {}
        perf = UpdatePerf("actor", self.rank)
        with self.actor_offload.resident():
            for mb in selected.make_iterator(mini_batch, epochs=cfg.ppo_epochs, shuffle=cfg.shuffle, seed=seed):
                metrics = perf.timed(lambda mb=mb: self.actor.train_step(
                    mb.batch, cfg.ppo_micro_batch_size_per_gpu, loss_fn, count_fn, sum_loss=sum_loss,
                    max_tokens=budget, token_metrics=TOKEN_METRICS))
                for k, v in metrics.items():
                    history.setdefault(k, []).append(v)
        skip = ("loss", "update_ok", "padding_fraction")
        out = {(k if k.startswith("rollout_corr/") else f"actor/{k}"): sum(v) / len(v)
               for k, v in history.items() if k not in skip}
        out["perf/padding_fraction/update_actor"] = sum(history["padding_fraction"]) / len(history["padding_fraction"])
        out["actor/nonfinite_skipped"] = sum(history.get("nonfinite_skipped", []))  # a count, not a mean
        out["actor/num_updates"] = float(len(history.get("lr", [])))
        out.update(perf.metrics())
        return DataProto(meta_info={"metrics": out})

    # ------------------------------------------------------------------ checkpoints / export

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> None:
        from megatron_workers.dist_ckpt import save_checkpoint

        engine, offload = self._main_engine()
        with offload.resident():
            save_checkpoint(path, engine.model, engine.optimizer, engine.scheduler, extra=extra)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        """Loads the actor (model, optimizer, LR step); returns the `extra` dict saved with it."""
        from megatron_workers.dist_ckpt import load_checkpoint

        engine, offload = self._main_engine()
        with offload.resident():
            return load_checkpoint(path, engine.model, engine.optimizer, engine.scheduler)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> list[str] | None:
        """Write the actor as an HF directory (rank 0 writes; returns the file names there)."""
        from megatron_workers.hf_io import export_mcore_to_hf, read_hf_config

        engine, offload = self._main_engine()
        path = self.config.model.path
        with offload.resident():
            return export_mcore_to_hf(engine.model, read_hf_config(path), out_dir, tokenizer_dir=path)

    def _main_engine(self):
        """The actor (with its offloader) if this worker has one, else the ref model."""
        return (self.actor, self.actor_offload) if self.actor is not None else (self.ref, self.ref_offload)


def _routed(data: DataProto) -> torch.Tensor:
    """The rollout's recorded experts (routing replay), or an error that says which keys record them."""
    if ROUTED_EXPERTS not in data.batch:
        raise KeyError(f"actor.router_replay.mode=R3, but the batch has no {ROUTED_EXPERTS!r}: the rollout records "
                       "them with actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    return data.batch[ROUTED_EXPERTS]
