"""CriticWorker: the value network (GPTModel body + replicated scalar head) and its PPO value update.

Values are read at the position before each response token (the state the token was
generated from), shape (B, R), zero on padding. The loss is the clipped value loss
(hybridflow.algorithms.compute_value_loss), normalised over the whole mini-batch like the actor's.
"""

from __future__ import annotations

import torch

from hybridflow.config.schema import CriticConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import DataProto
from megatron_workers.engine import (
    agg_count,
    as_config,
    build_role_engine,
    init_megatron,
    mesh_coords,
    micro_agg_mode,
    unpack_tokens,
)
from megatron_workers.heads import response_values
from megatron_workers.offload import make_offloader
from megatron_workers.perf import UpdatePerf

MESH = "critic"


def packed_response_values(output: torch.Tensor, micro: dict, response_length: int) -> torch.Tensor:
    """Scalar-head output in the engine's packed layout (b, w, 1) -> (b, R) response values. Differentiable."""
    return response_values(unpack_tokens(output[..., 0], micro), response_length)


class CriticWorker(Worker):
    def __init__(self, config):
        super().__init__()
        self.config: CriticConfig = as_config(config, CriticConfig)
        self.engine = None
        self.offload = None
        self.dims = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg = self.config
        self.dims = init_megatron(cfg.megatron)
        self.engine = build_role_engine(cfg.model.path, self.dims, cfg.model.dtype, optim=cfg.optim,
                                        megatron_cfg=cfg.megatron, scalar_head=True)
        self.offload = make_offloader(self.engine, cfg.megatron)
        self.engine.nonfinite.stage = "update_critic"
        self.set_mesh_coords(MESH, **mesh_coords())
        self.offload.offload()

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=MESH)
    def compute_values(self, data: DataProto) -> DataProto:
        response_length = data.batch["responses"].shape[1]
        mask = data.batch["response_mask"]

        def post(output, micro):
            return {"values": packed_response_values(output, micro, response_length).float()}

        batch = {k: data.batch[k] for k in ("input_ids", "attention_mask")}
        cfg = self.config
        budget = cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        with self.offload.resident():
            out = self.engine.forward_only(batch, cfg.ppo_micro_batch_size_per_gpu, post, max_tokens=budget)
        return DataProto.from_dict({"values": out["values"] * mask.to(out["values"].dtype)},
                                   meta_info={"perf/padding_fraction/values": self.engine.padding_fraction})

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=MESH)
    def update_critic(self, data: DataProto) -> DataProto:
        """Value-loss epochs over mini-batches of this DP shard; returns meta_info['metrics'].

        ppo_mini_batch_size counts prompts; meta_info['rollout_n'] (default 1) turns it into rows.
        """
        from hybridflow.algorithms import compute_value_loss, masked_mean

        cfg = self.config
        keys = ["input_ids", "attention_mask", "responses", "response_mask", "values", "returns"]
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise KeyError(f"update_critic: batch lacks {missing} (has {sorted(data.batch)})")
        rows = cfg.ppo_mini_batch_size * int(data.meta_info.get("rollout_n", 1))
        if rows % self.dims.dp:
            raise ValueError(f"critic ppo_mini_batch_size * rollout_n = {rows} is not divisible by the critic DP "
                             f"size {self.dims.dp}")
        response_length = data.batch["responses"].shape[1]

        mode, sum_loss = micro_agg_mode(cfg.loss_agg_mode)  # token-sum: token-means scaled back by train_step

        def loss_fn(output, micro):
            vpreds = packed_response_values(output, micro, response_length)
            get = lambda k: micro[k].to(vpreds.device)
            vf_loss, clipfrac = compute_value_loss(vpreds=vpreds, returns=get("returns"), values=get("values"),
                                                   response_mask=get("response_mask"),
                                                   cliprange_value=cfg.cliprange_value, loss_agg_mode=mode,
                                                   loss_scale_factor=cfg.loss_scale_factor)
            vpred_mean = masked_mean(vpreds.detach(), get("response_mask"))
            return vf_loss, {"vf_loss": vf_loss.detach(), "vf_clipfrac": clipfrac.detach(), "vpred_mean": vpred_mean}

        count_fn = lambda micro: agg_count(micro, cfg.loss_agg_mode)
        budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        seed = int(data.meta_info.get("global_step", 0)) + cfg.megatron.seed
        history: dict[str, list[float]] = {}
        batches = data.select(batch_keys=keys).make_iterator(rows // self.dims.dp, epochs=cfg.ppo_epochs,
                                                             shuffle=False, seed=seed)
        perf = UpdatePerf("critic", self.rank)
        with self.offload.resident():
            for mb in batches:
                metrics = perf.timed(lambda mb=mb: self.engine.train_step(
                    mb.batch, cfg.ppo_micro_batch_size_per_gpu, loss_fn, count_fn, sum_loss=sum_loss,
                    max_tokens=budget, token_metrics=("vf_clipfrac", "vpred_mean")))
                for k, v in metrics.items():
                    history.setdefault(k, []).append(v)
        skip = ("loss", "update_ok", "padding_fraction")
        out = {f"critic/{k}": sum(v) / len(v) for k, v in history.items() if k not in skip}
        out["perf/padding_fraction/update_critic"] = sum(history["padding_fraction"]) / len(history["padding_fraction"])
        out["critic/nonfinite_skipped"] = sum(history.get("nonfinite_skipped", []))  # a count, not a mean
        out.update(perf.metrics())
        return DataProto(meta_info={"metrics": out})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> None:
        from megatron_workers.dist_ckpt import save_checkpoint

        e = self.engine
        with self.offload.resident():
            save_checkpoint(path, e.model, e.optimizer, e.scheduler, extra=extra)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        from megatron_workers.dist_ckpt import load_checkpoint

        e = self.engine
        with self.offload.resident():
            return load_checkpoint(path, e.model, e.optimizer, e.scheduler)
