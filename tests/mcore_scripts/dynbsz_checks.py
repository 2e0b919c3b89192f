"""Token-budget micro-batches under torchrun (gloo, fp32): what tests/test_dynamic_bsz.py compares.

One launch runs every check, so the ~10 s megatron import is paid once per world size:
- actor update gradients (captured after megatron's DP all-reduce, before the optimizer, which is not
  stepped so every update starts from the same weights), for every loss_agg_mode: one micro-batch holding
  this rank's whole mini-batch share vs token-budget micro-batches;
- critic update gradients, the same two ways, for two modes;
- forward-only passes (old log-prob, ref, values): fixed micro-batches vs token-budget ones, and with
  per-micro-batch trimming off vs on; plus each call's padding_fraction and micro-batch shapes.
Every rank computes forward passes over the full batch and updates on its DP shard (as DP_COMPUTE_PROTO).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from train_common import actor_config, make_rl_batch, ppo_inputs

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm")
CRITIC_MODES = ("token-mean", "seq-mean-token-mean")


def capture_grads(engine, store: dict):
    """Replace optimizer.step: record every parameter's reduced gradient, leave the weights alone."""

    def step():
        store.clear()
        for chunk in engine.model:
            for name, p in chunk.named_parameters():
                grad = getattr(p, "main_grad", None)
                store[name] = (grad if grad is not None else p.grad).detach().clone().cpu()
        return True, 0.0, None

    engine.optimizer.step = step


def record_shapes(engine, log: list):
    """Wrap engine._run: log each call's micro-batch shapes (rows, width)."""
    run = engine._run

    def wrapped(micro_batches, forward_only, make_loss):
        log.append([list(m["packed_input_ids"].shape) for m in micro_batches])
        return run(micro_batches, forward_only, make_loss)

    engine._run = wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()

    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker
    from megatron_workers.critic import CriticWorker
    from megatron_workers.engine import build_role_engine
    from megatron_workers.offload import make_offloader

    # The non-distributed optimizer: after the all-reduce every rank holds the whole gradient.
    cfg = actor_config(args.model, pp=args.pp, dist_opt=False, micro_batch=8)
    worker = ActorRolloutRefWorker(cfg, role="actor_ref")
    worker.init_model()
    coords = worker.get_mesh_coords("actor")
    actor = worker.actor
    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    batch = make_rl_batch(vocab, batch=8, prompt_len=6, response_len=8)
    full = DataProto.from_dict(batch, meta_info={"temperature": 1.0})
    shapes: list = []
    record_shapes(actor, shapes)
    out: dict = {"forward": {}, "padding": {}, "actor_grads": {}, "actor_metrics": {}, "critic_grads": {}}

    # ---- forward-only: fixed (4 rows) vs token budget, and untrimmed vs trimmed
    r, a = worker.config.rollout, worker.config.actor
    r.log_prob_max_token_len_per_gpu = worker.config.ref.log_prob_max_token_len_per_gpu = args.budget
    for name, dynamic, trim in (("fixed", False, True), ("dynamic", True, True), ("untrimmed", False, False)):
        r.log_prob_use_dynamic_bsz = worker.config.ref.log_prob_use_dynamic_bsz = dynamic
        actor.trim_micro_batches = worker.ref.trim_micro_batches = trim
        shapes.clear()
        old = worker.compute_log_prob(full)
        ref = worker.compute_ref_log_prob(full)
        out["forward"][name] = {"old_log_probs": old.batch["old_log_probs"], "entropys": old.batch["entropys"],
                                "ref_log_prob": ref.batch["ref_log_prob"]}
        out["padding"][name] = {"old_log_prob": old.meta_info["perf/padding_fraction/old_log_prob"],
                                "ref": ref.meta_info["perf/padding_fraction/ref"], "shapes": list(shapes)}
    actor.trim_micro_batches = worker.ref.trim_micro_batches = True
    fwd = out["forward"]["fixed"]
    train = DataProto.from_dict(ppo_inputs(batch, fwd["old_log_probs"], fwd["ref_log_prob"], drop_rows=(3,)),
                                meta_info={"temperature": 1.0})
    shard = train.chunk(coords.dp_size)[coords.dp_rank]

    # ---- actor update gradients, per loss_agg_mode
    grads: dict = {}
    capture_grads(actor, grads)
    a.ppo_max_token_len_per_gpu = args.budget
    for mode in MODES:
        a.loss_agg_mode = mode
        for name, dynamic in (("one", False), ("dynamic", True)):
            a.use_dynamic_bsz = dynamic
            shapes.clear()
            metrics = worker.update_actor(shard).meta_info["metrics"]
            out["actor_grads"][f"{mode}/{name}"] = dict(grads)
            out["actor_metrics"][f"{mode}/{name}"] = {**metrics, "shapes": list(shapes)}

    # ---- critic: a second engine in the same Megatron groups
    critic = CriticWorker({"model": {"path": args.model, "dtype": "float32"},
                           "megatron": {"use_distributed_optimizer": False, "seed": 7,
                                        "pipeline_model_parallel_size": args.pp},
                           "optim": {"lr": 1e-3}, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 3,
                           "ppo_max_token_len_per_gpu": args.budget, "forward_max_token_len_per_gpu": args.budget})
    critic.dims = worker.dims
    critic.engine = build_role_engine(args.model, worker.dims, "float32", optim=critic.config.optim,
                                      megatron_cfg=critic.config.megatron, scalar_head=True)
    critic.offload = make_offloader(critic.engine, critic.config.megatron)
    values = {}
    for name, dynamic in (("fixed", False), ("dynamic", True)):
        critic.config.use_dynamic_bsz = dynamic
        v = critic.compute_values(full)
        values[name] = v.batch["values"]
        out["padding"][f"values/{name}"] = v.meta_info["perf/padding_fraction/values"]
    out["forward"]["values"] = values
    g = torch.Generator().manual_seed(3)
    returns = (values["fixed"] + torch.randn(values["fixed"].shape, generator=g)) * batch["response_mask"]
    ctrain = DataProto.from_dict({**{k: train.batch[k] for k in ("input_ids", "attention_mask", "responses",
                                                                 "response_mask")},
                                  "values": values["fixed"], "returns": returns})
    cshard = ctrain.chunk(coords.dp_size)[coords.dp_rank]
    capture_grads(critic.engine, grads)
    critic.config.ppo_micro_batch_size_per_gpu = 8
    for mode in CRITIC_MODES:
        critic.config.loss_agg_mode = mode
        for name, dynamic in (("one", False), ("dynamic", True)):
            critic.config.use_dynamic_bsz = dynamic
            metrics = critic.update_critic(cshard).meta_info["metrics"]
            out["critic_grads"][f"{mode}/{name}"] = dict(grads)
            out["actor_metrics"][f"critic/{mode}/{name}"] = metrics

    # every rank's micro-batch shapes of the dynamic updates (the counts must agree over DP)
    mine = {k: v["shapes"] for k, v in out["actor_metrics"].items() if "shapes" in v}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out["shapes_per_rank"] = everyone
    out["dp_size"] = coords.dp_size
    if dist.get_rank() == 0:
        torch.save(out, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
