"""MegatronEngine: forward-only and training steps over megatron's pipeline schedules.

One engine holds the model chunks (DDP-wrapped) of one worker role and, for
trainable roles, its optimizer and LR scheduler. It knows nothing about RL: the
caller hands it a batch (dict of (B, ...) tensors with `input_ids` and
`attention_mask`) and closures that turn the model output of a micro-batch
into results (`post_fn`) or into a loss (`loss_fn`). Those closures run on the
last pipeline stage only; the engine brings their results to every rank of
the pipeline.

Padding. Batches arrive as padded rectangles (prompts left-padded, responses
right-padded). Each micro-batch moves its rows' valid tokens to the front
(`logprob.left_justify`) and is trimmed to its own longest row, so the model
runs with plain causal attention and positions 0..L-1, exactly what HF gets
from position_ids = cumsum(attention_mask) - 1 (megatron's RoPE takes no
position ids). Padding then sits after every valid token and is never
attended to. Under PP with fixed micro-batches the whole batch is packed to
one width instead (pipeline p2p needs equal shapes); with token-budget
micro-batches under PP, megatron's `variable_seq_lengths` sends each shape
first. The closures see the packed output plus `packed_mask` / `pack_index`
in the micro-batch, whose original tensors keep the batch's full width;
`unpack_tokens` and `logprob.unpack_next_token` map values back to the
original columns. `padding_fraction` (per call) is the share of computed
token slots that were padding, over all DP ranks.

Micro-batches. Fixed (`micro_batch_size` rows each) or, with `max_tokens`,
token-budget ones (verl's use_dynamic_bsz; hybridflow/data/token_budget.py):
rows grouped so each micro-batch's valid tokens fit the budget, results put
back in the original row order. In train_step every DP rank runs the same
number of micro-batches (the max over DP, by splitting micro-batches, never
empty ones). With megatron's DDP as wired here this is not needed for the
sum itself: gradients are reduced once, after the last micro-batch (no_sync
before it, overlapped or not), and each rank's loss is scaled by its own
count. It is kept because it is cheap (one int all-reduce per update) and it
keeps one schedule on every rank: a collective ever added per micro-batch
(inside a loss closure, or an MoE/aux-loss reduction) would otherwise hang
on the rank that has fewer, and a rank that finishes early only waits at the
gradient all-reduce anyway. Within a pipeline the stages always agree: they
pack the same rows the same way.

Loss normalisation is global over the mini-batch: a micro-batch's loss is
weighted by its share of the mini-batch's tokens (or non-empty sequences),
summed over all micro-batches and data-parallel ranks (token-sum: then times
the global token count). That makes one update with DP=d and m micro-batches
the same as one update on the whole mini-batch in one process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from hybridflow.controller import fault_inject
from hybridflow.data.token_budget import (
    fixed_micro_batches,
    inverse_permutation,
    micro_batches_needed,
    pack_by_token_budget,
    padding_fraction,
)
from hybridflow.rollout.moe_routing import ROUTED_EXPERTS  # routing replay's input; see _replay_routing
from megatron_workers.logprob import left_justify
from megatron_workers.nonfinite import NonFiniteGuard
from megatron_workers.profiling import ScheduleRanges

logger = logging.getLogger(__name__)

# post_fn(output, micro_batch) -> dict of (b, ...) tensors; loss_fn(output, micro_batch) -> (loss, metrics)
PostFn = Callable[[torch.Tensor, dict], dict]
LossFn = Callable[[torch.Tensor, dict], tuple]
PACKED_KEYS = ("packed_input_ids", "packed_mask", "pack_index")


def unpack_tokens(values: torch.Tensor, micro: dict) -> torch.Tensor:
    """Packed per-position values (b, w, ...) -> original columns (b, S, ...); 0 at padding. Differentiable."""
    index, mask = micro["pack_index"].to(values.device), micro["packed_mask"].to(values.device)
    seq_len = micro["attention_mask"].shape[1]
    b, w = index.shape
    extra = values.shape[2:]
    # Padding positions are sent to a spare column S that is cut off afterwards.
    target = torch.where(mask, index, torch.full_like(index, seq_len))
    target = target.view(b, w, *([1] * len(extra))).expand(b, w, *extra)
    out = values.new_zeros(b, seq_len + 1, *extra).scatter(1, target, values)
    return out[:, :seq_len]


def agg_count(micro_batch: dict, loss_agg_mode: str, mask_key: str = "response_mask") -> torch.Tensor:
    """The quantity a loss_agg_mode averages over: valid tokens (token-*) or non-empty rows (seq-mean-*).

    Non-empty rows, as verl's agg_loss: a fully masked row is left out of the seq-mean, so a
    micro-batch's weight must not count it either (hybridflow.algorithms.masked.agg_loss).
    """
    from hybridflow.algorithms import LOSS_AGG_MODES, require_choice

    require_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    mask = micro_batch[mask_key]
    if loss_agg_mode.startswith("token-"):
        return mask.bool().sum().to(torch.float64)
    return (mask.bool().sum(dim=-1) > 0).sum().to(torch.float64)


def micro_agg_mode(loss_agg_mode: str) -> tuple[str, bool]:
    """(the mode each micro-batch's loss aggregates with, whether train_step must scale the mean back to a sum).

    token-sum over the mini-batch = its valid-token count x the token-mean over it. So the
    micro-batches compute token-means (their metrics stay per-token numbers) and train_step,
    with sum_loss=True, multiplies the token-weighted mean by the global token count. Every
    other mode is a mean, computed per micro-batch as it is.
    """
    from hybridflow.algorithms import SUM_LOSS_AGG_MODES

    if loss_agg_mode in SUM_LOSS_AGG_MODES:
        return "token-mean", True
    return loss_agg_mode, False


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _batch_size(batch: dict) -> int:
    sizes = {k: v.shape[0] for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the batch size: {sizes}")
    return next(iter(sizes.values()))


class MegatronEngine:
    """Runs megatron's forward/backward schedule (any PP size) over padded micro-batches."""

    def __init__(self, model: list, optimizer=None, scheduler=None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        self.transformer_impl = "local"  # build_role_engine records the resolved choice
        # Each micro-batch at its own longest row (False: the whole batch's width; tests compare the two).
        # HYBRIDFLOW_NO_TRIM=1 is a benchmark-only knob: launch.benchmark --ablation's "before trim" row.
        self.trim_micro_batches = os.environ.get("HYBRIDFLOW_NO_TRIM") != "1"
        self.padding_fraction = 0.0  # of the last forward_only call (train_step returns its own)
        self.model = list(model)  # model chunks: one, or one per virtual pipeline stage (interleaved schedule)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.nonfinite = NonFiniteGuard("train_step")  # the worker names its stage (update_actor, ...)
        self.config = get_model_config(model[0])  # megatron's chunks share one TransformerConfig
        # MoE: routed tokens per expert (and megatron's aux loss) over each update (megatron_workers/moe_stats.py)
        self.moe_meter = None
        self._routers = {}  # id(chunk) -> [(global layer number, TopKRouter)]: routing replay's targets
        if getattr(self.config, "num_moe_experts", None):
            from megatron_workers.moe_stats import RouterMeter, moe_routers

            self.moe_meter = RouterMeter(self.model)
            self._routers = {id(chunk): moe_routers([chunk]) for chunk in self.model}
        if self.config.timers is None:  # forward/backward ranges on timeline steps (megatron_workers/profiling.py)
            self.config.timers = ScheduleRanges()
        self.module = _unwrap(model[-1])  # the GPTModel holding the output layer on the last stage (DDP unwrapped)
        self.hf_vocab_size = getattr(self.module, "hf_vocab_size", None)  # real vocab, before TP padding
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.vpp_size = len(self.model)
        if self.vpp_size != (ps.get_virtual_pipeline_model_parallel_world_size() or 1):
            raise ValueError(f"{self.vpp_size} model chunks, but megatron's virtual pipeline size is "
                             f"{ps.get_virtual_pipeline_model_parallel_world_size()}")
        if ps.get_context_parallel_world_size() > 1:
            raise NotImplementedError("context parallel > 1 needs Transformer Engine's attention on GPU and "
                                      "sequence sharding of the batch; not supported (refused at config time)")
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.last_stage_rank = ps.get_pipeline_model_parallel_last_rank()
        if self.pp_size > 1 and self.config.pipeline_dtype is None:
            self.config.pipeline_dtype = self.config.params_dtype
        if optimizer is not None:
            # What megatron's own training loop wires up: grad sync is deferred to the last
            # micro-batch (no_sync), then finalize_model_grads all-reduces over DP and ties
            # embedding / sequence-parallel norm grads; scale_loss is the fp16 loss scale (1.0 otherwise).
            no_sync = [chunk.no_sync for chunk in self.model]
            self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            self.config.finalize_model_grads_func = finalize_model_grads
            self.config.grad_scale_func = optimizer.scale_loss

    # ------------------------------------------------------------------ helpers

    def _pack(self, batch: dict) -> dict:
        """Add the left-justified copy of the batch (see module docstring); width is a multiple of TP under SP."""
        for key in ("input_ids", "attention_mask"):
            if key not in batch:
                raise KeyError(f"batch has no {key!r} (keys: {sorted(batch)})")
        multiple = self.tp_size if self.config.sequence_parallel else 1
        packed_ids, packed_mask, index = left_justify(batch["input_ids"], batch["attention_mask"], multiple)
        return {**batch, "packed_input_ids": packed_ids, "packed_mask": packed_mask, "pack_index": index}

    def _micro_batches(self, batch: dict, micro_batch_size: int, max_tokens: int | None,
                       same_count_over_dp: bool) -> tuple[list[dict], list[int]]:
        """(packed micro-batches, the batch rows they hold, concatenated in their order).

        max_tokens None: fixed groups of micro_batch_size consecutive rows; else token-budget groups
        (the count made equal over DP when same_count_over_dp). Each micro-batch is trimmed to its own
        longest row, except fixed micro-batches under PP, which share the batch's width (equal p2p shapes).
        """
        for key in ("input_ids", "attention_mask"):
            if key not in batch:
                raise KeyError(f"batch has no {key!r} (keys: {sorted(batch)})")
        n = _batch_size(batch)
        if max_tokens is None:
            groups = fixed_micro_batches(n, micro_batch_size)
        else:
            lengths = batch["attention_mask"].bool().sum(dim=-1).tolist()
            count = micro_batches_needed(lengths, max_tokens)
            if same_count_over_dp and self.dp_size > 1:
                t = torch.tensor([count], dtype=torch.int64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
                count = int(t)
            groups = pack_by_token_budget(lengths, max_tokens, min_micro_batches=count)
        per_micro = self.trim_micro_batches and (self.pp_size == 1 or max_tokens is not None)
        whole = None if per_micro else self._pack(batch)
        micro_batches = []
        for rows in groups:
            if len(groups) == 1:
                micro = dict(batch) if whole is None else whole
            else:
                idx = torch.tensor(rows, dtype=torch.long)
                micro = {k: v[idx] for k, v in (batch if whole is None else whole).items()}
            micro_batches.append(self._pack(micro) if whole is None else micro)
        return micro_batches, [i for rows in groups for i in rows]

    def _padding_fraction(self, micro_batches: list[dict]) -> float:
        """Padding share of the token slots these micro-batches compute, summed over the DP ranks."""
        t = torch.tensor([sum(int(m["packed_mask"].sum()) for m in micro_batches),
                          sum(m["packed_input_ids"].numel() for m in micro_batches)], dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        return padding_fraction(float(t[0]), float(t[1]))

    def _run(self, micro_batches: list[dict], forward_only: bool, make_loss: Callable) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shapes = {tuple(m["packed_input_ids"].shape) for m in micro_batches}
        mbs, width = max(b for b, _ in shapes), max(w for _, w in shapes)
        # Under PP the stages exchange activations of each micro-batch's shape: with one shape the schedule
        # knows it; with several (token-budget micro-batches) megatron sends each shape before the tensor.
        variable = self.pp_size > 1 and len(shapes) > 1
        device = next(self.model[0].parameters()).device

        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            if ROUTED_EXPERTS in micro:
                self._replay_routing(micro, model)
            ids = micro["packed_input_ids"].to(device)
            positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
            # attention_mask=None: plain causal attention, padding is behind every valid token.
            output = model(ids, positions.expand_as(ids), None)
            return output, partial(make_loss, micro)

        if self._interleave_padding(len(micro_batches)):
            raise ValueError(f"the interleaved schedule (vpp={self.vpp_size}) needs a multiple of pp={self.pp_size} "
                             f"micro-batches, got {len(micro_batches)} (the callers pad)")
        # The interleaved schedule takes one iterator per chunk; each chunk walks the micro-batches in order.
        data = iter(micro_batches) if self.vpp_size == 1 else [iter(micro_batches) for _ in self.model]
        saved = self.config.variable_seq_lengths
        self.config.variable_seq_lengths = saved or variable
        replaying = any(ROUTED_EXPERTS in m for m in micro_batches)
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=self.model,
                num_microbatches=len(micro_batches),
                seq_length=width,
                micro_batch_size=mbs,
                forward_only=forward_only,
            )
        finally:
            self.config.variable_seq_lengths = saved
            if replaying:
                for routers in self._routers.values():
                    for _, router in routers:
                        router.router_replay.clear_router_replay_action()
                        router.router_replay.clear_indices()

    def _replay_routing(self, micro: dict, chunk) -> None:
        """Routing replay (verl's R3): this micro-batch's MoE layers route each token to the experts the rollout
        chose for it (`routed_experts`, (B, S, layers, k) over the batch's columns, -1 where the rollout recorded
        none), instead of their own top-k; the gate weights are the router's own probabilities of those experts.
        Set right before the chunk's forward, for the routers on this chunk (megatron's RouterReplay)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self._routers.get(id(chunk), [])
        if not routers:
            if self.moe_meter is None:
                raise ValueError(f"the batch has {ROUTED_EXPERTS!r} (routing replay) but the model has no MoE layers")
            return
        routed = micro[ROUTED_EXPERTS].to(torch.long)
        layers, k = routed.shape[2], routed.shape[3]
        index = micro["pack_index"]
        packed = torch.gather(routed, 1, index[:, :, None, None].expand(-1, -1, layers, k))
        # Tokens the rollout did not route (padding slots, a row's last token, which only predicts past the
        # response) take experts 0..k-1: their outputs feed no log-prob (padding sits behind every valid token).
        valid = micro["packed_mask"][:, :, None, None] & (packed >= 0).all(dim=-1, keepdim=True)
        packed = torch.where(valid, packed, torch.arange(k))
        tokens = packed.transpose(0, 1)  # megatron's hidden states are [s, b, h]: token s*b + row
        if self.config.sequence_parallel:  # each TP rank routes its own slice of the sequence
            from megatron.core import parallel_state as ps

            tokens = tokens.chunk(self.tp_size, dim=0)[ps.get_tensor_model_parallel_rank()]
        flat = tokens.reshape(-1, layers, k)
        device = next(chunk.parameters()).device
        for layer, router in routers:
            if layer > layers:
                raise ValueError(f"{ROUTED_EXPERTS} covers {layers} layers; the model routes at layer {layer}")
            router.router_replay.set_target_indices(flat[:, layer - 1].contiguous().to(device))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _interleave_padding(self, num_micro: int) -> int:
        """Micro-batches to add so megatron 0.16's interleaved schedule accepts the count: it runs them in
        groups of pp per chunk (microbatch_group_size_per_vp_stage = pp) and refuses any count that is not
        a multiple of pp. 0 without VPP."""
        return (-num_micro) % self.pp_size if self.vpp_size > 1 else 0

    def _broadcast_from_last_stage(self, obj):
        """Objects (dicts of tensors / floats) computed on the last PP stage, on every PP rank."""
        if self.pp_size == 1:
            return obj
        holder = [obj if self.is_last_stage else None]
        dist.broadcast_object_list(holder, src=self.last_stage_rank, group=self.pp_group)
        return holder[0]

    # ------------------------------------------------------------------ public

    @torch.no_grad()
    def forward_only(self, batch: dict, micro_batch_size: int, post_fn: PostFn,
                     max_tokens: int | None = None) -> dict[str, torch.Tensor]:
        """Run the model over `batch` in micro-batches; returns post_fn's outputs concatenated, on every rank.

        max_tokens: token-budget micro-batches (micro_batch_size is then not used); rows come back in
        the batch's order either way. Sets self.padding_fraction.
        """
        n = _batch_size(batch)
        if n == 0:
            raise ValueError("forward_only got an empty batch")
        micro_batch_size = min(micro_batch_size, n)
        if max_tokens is None and self.pp_size > 1:
            # Pipeline p2p needs equal shapes: pad the last micro-batch by repeating the batch's last row.
            pad_rows = (-n) % micro_batch_size
            if pad_rows:
                batch = {k: torch.cat([v, v[-1:].expand(pad_rows, *v.shape[1:])]) for k, v in batch.items()}
        micro_batches, order = self._micro_batches(batch, micro_batch_size, max_tokens, same_count_over_dp=False)
        self.padding_fraction = self._padding_fraction(micro_batches)
        # The interleaved schedule needs a multiple of pp micro-batches: repeat the last one; outputs dropped.
        micro_batches += [{**micro_batches[-1], "_padding": True}
                          for _ in range(self._interleave_padding(len(micro_batches)))]
        outputs: list[dict] = []

        def make_loss(micro, output):
            if not micro.get("_padding"):
                outputs.append({k: v.detach() for k, v in post_fn(output, micro).items()})
            return torch.zeros((), device=output.device), {}

        for chunk in self.model:
            chunk.eval()
        self._run(micro_batches, forward_only=True, make_loss=make_loss)
        result = None
        if self.is_last_stage:
            back = torch.tensor(inverse_permutation(order), dtype=torch.long)
            result = {k: torch.cat([o[k] for o in outputs]).cpu()[back][:n] for k in outputs[0]}
        return self._broadcast_from_last_stage(result)

    def train_step(self, batch: dict, micro_batch_size: int, loss_fn: LossFn,
                   count_fn: Callable[[dict], torch.Tensor], sum_loss: bool = False,
                   max_tokens: int | None = None, token_metrics: tuple[str, ...] = ()) -> dict[str, float]:
        """One optimizer update on this rank's share of a mini-batch.

        loss_fn(output, micro) -> (loss, metrics): the micro-batch's loss, aggregated over the
        micro-batch the way count_fn counts (see agg_count), and scalar metrics aggregated the same way.
        sum_loss: the loss to optimise is the sum, not the mean, over the counted units (token-sum,
        see micro_agg_mode); the gradient is scaled by the global count, the metrics stay means.
        max_tokens: token-budget micro-batches (micro_batch_size is then not used). The grouping does not
        change the loss or its gradient: each micro-batch is weighted by count_fn(micro) / the global count.
        token_metrics: metrics that are per-token means whatever the loss mode (clip fractions, KL(old||new)):
        weighted by the micro-batch's share of the valid response tokens instead, so under a seq-mean mode
        they do not depend on the grouping either.
        Returns the mini-batch metrics (weighted like the loss's mean, over all DP ranks), plus
        `grad_norm`, `lr` (the lr this update used) and `padding_fraction`. Same dict on every rank.
        """
        if self.optimizer is None:
            raise RuntimeError("train_step on an engine without an optimizer (a forward-only role?)")
        n = _batch_size(batch)
        # A micro-batch larger than this rank's mini-batch share means "the whole share in one pass".
        micro_batch_size = min(micro_batch_size, n) if n else micro_batch_size
        if n == 0 or (max_tokens is None and n % micro_batch_size):
            raise ValueError(f"train_step: batch size {n} must be a positive multiple of micro_batch_size "
                             f"{micro_batch_size}")
        micro_batches, _ = self._micro_batches(batch, micro_batch_size, max_tokens, same_count_over_dp=True)
        num_micro = len(micro_batches)
        padding = self._padding_fraction(micro_batches)
        # Global normaliser: the tokens (or sequences) of the whole mini-batch over all DP ranks.
        token_count = lambda m: agg_count(m, "token-mean") if token_metrics else torch.zeros((), dtype=torch.float64)
        totals = torch.stack([torch.stack([count_fn(m).to(torch.float64), token_count(m)])
                              for m in micro_batches]).sum(dim=0)
        dist.all_reduce(totals, group=self.dp_group)
        total, tokens = totals.clamp(min=1.0)
        loss_scale = float(total) if sum_loss else 1.0
        sums: dict[str, torch.Tensor] = {}
        # The interleaved schedule takes a multiple of pp micro-batches: repeat the last one as padding
        # whose loss is 0 * output, so it adds compute but nothing to the gradient or the metrics.
        pad = self._interleave_padding(num_micro)
        micro_batches += [{**micro_batches[-1], "_padding": True} for _ in range(pad)]
        num_micro += pad

        def make_loss(micro, output):
            if micro.get("_padding"):
                return output.sum() * 0.0, {}
            loss, metrics = loss_fn(output, micro)
            if fault_inject.nan_requested():  # tests: a NaN loss exactly where HYBRIDFLOW_FAULT says
                loss = loss * float("nan")
            weight = (count_fn(micro) / total).to(loss.dtype)
            token_weight = token_count(micro) / tokens
            for k, v in {"loss": loss, **metrics}.items():
                # Clone/detach: the schedule divides the returned loss in place.
                w = token_weight if k in token_metrics else weight.double()
                value = (torch.as_tensor(v).detach().to(torch.float64) * w).cpu()
                sums[k] = sums.get(k, 0.0) + value
            # Undo the schedule's 1/num_microbatches and DDP's 1/dp average: the weights already sum to 1.
            return loss * weight * (num_micro * self.dp_size * loss_scale), {}

        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe_meter is not None:
            self.moe_meter.reset()
        self._run(micro_batches, forward_only=False, make_loss=make_loss)
        lr = self.scheduler.current_lr() if self.scheduler is not None else float("nan")
        # fp32/bf16 have no grad scaler to skip a non-finite step (fp16's found_inf does): check first.
        problem = self.nonfinite.check(self.model, float(sums["loss"]) if "loss" in sums else 0.0)
        if problem is None:
            with torch.profiler.record_function("optimizer"):
                update_ok, grad_norm, _ = self.optimizer.step()
        else:
            logger.warning("skipped a non-finite update (%s)", problem)
            self.optimizer.zero_grad()
            update_ok, grad_norm = False, None
        if update_ok and self.scheduler is not None:
            self.scheduler.step()

        metrics = None
        if self.is_last_stage:
            names = sorted(sums)
            vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in names])
            dist.all_reduce(vec, group=self.dp_group)
            metrics = dict(zip(names, vec.tolist()))
        metrics = self._broadcast_from_last_stage(metrics)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = lr
        metrics["update_ok"] = float(bool(update_ok))
        metrics["padding_fraction"] = padding
        metrics["num_micro_batches"] = float(num_micro)  # what ran, token-budget packing and DP max included
        metrics["nonfinite_skipped"] = float(not update_ok)  # ours, or megatron's fp16 found_inf
        if self.moe_meter is not None:
            metrics.update(self.moe_meter.metrics())
        return metrics


# ---------------------------------------------------------------------- building one for a worker role


def resolve_dtype(name: str) -> torch.dtype:
    """ModelConfig.dtype -> torch dtype for this process (hybridflow.precision: 'auto' is bf16 on GPU and on CPUs
    with native bf16, fp32 elsewhere)."""
    from hybridflow.precision import resolve_local

    return resolve_local(name)


def init_megatron(megatron_cfg, timeout_s: float | None = None):
    """Join the process group (env set by torchrun or the worker group) and build megatron's groups.

    timeout_s: every collective's timeout; None: $HYBRIDFLOW_PG_TIMEOUT_S (trainer.fault.pg_timeout_s, set by
    the trainer's worker groups), else 300 s. Returns the ParallelDims; dp is what the world leaves after tp*pp*cp.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get("HYBRIDFLOW_PG_TIMEOUT_S", 300.0))
    from hybridflow.parallel.dims import ParallelDims
    from megatron_workers.parallel_init import init_distributed, init_model_parallel

    _, world_size = init_distributed(timeout_s=timeout_s)
    dims = ParallelDims.from_megatron_config(megatron_cfg, world_size)
    init_model_parallel(dims, seed=megatron_cfg.seed, timeout_s=timeout_s)
    return dims


def mesh_coords() -> dict:
    """This rank's coordinates for Worker.set_mesh_coords: it collects if tp=0, cp=0 on the last PP stage."""
    from megatron.core import parallel_state as ps

    tp, cp = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    return dict(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), tp_rank=tp,
                pp_rank=ps.get_pipeline_model_parallel_rank(), cp_rank=cp,
                is_collect=tp == 0 and cp == 0 and ps.is_pipeline_last_stage())


def build_role_engine(model_path: str, dims, dtype: str = "auto", optim=None, megatron_cfg=None,
                      scalar_head: bool = False) -> MegatronEngine:
    """Build this rank's model from an HF directory, load its weights, and (with `optim`) DDP + optimizer.

    scalar_head=True gives the critic / reward-model network: the LM head is replaced by a
    hidden -> 1 head (heads.py), loaded from the checkpoint's `score.weight` when it has one
    (an HF *ForSequenceClassification reward model), freshly initialised otherwise.
    """
    from megatron_workers.hf_io import checkpoint_weight_map, load_hf_into_mcore, read_hf_config
    from megatron_workers.model_builder import SUPPORTED_MODEL_TYPES, build_model_chunks

    hf_config = read_hf_config(model_path)
    torch_dtype = resolve_dtype(dtype)
    from megatron_workers.model_builder import resolve_transformer_impl

    impl, why = resolve_transformer_impl(getattr(megatron_cfg, "transformer_impl", "auto"))
    if dist.get_rank() == 0:
        o = getattr(megatron_cfg, "override_transformer_config", None)
        logger.info("building %s: transformer_impl=%s (%s), dtype=%s, vpp=%d, recompute=%s", model_path, impl, why,
                    torch_dtype, dims.vpp, getattr(o, "recompute_granularity", None))
    if scalar_head:
        # Build and load as the causal-LM body; the vocab-sized output layer is loaded from the
        # embedding (always present) and then replaced by the scalar head.
        model_type = hf_config.get("model_type")
        arch = SUPPORTED_MODEL_TYPES.get(model_type)
        hf_config = {**hf_config, "tie_word_embeddings": True, **({"architectures": [arch]} if arch else {})}
        chunks = build_model_chunks(hf_config, dims, dtype=torch_dtype, share_embeddings=False,
                                    megatron_cfg=megatron_cfg)
    else:
        chunks = build_model_chunks(hf_config, dims, dtype=torch_dtype, megatron_cfg=megatron_cfg)
    if getattr(megatron_cfg, "use_dist_checkpointing", False):  # verl's key: start from a Megatron dist checkpoint
        from megatron_workers.dist_ckpt import load_weights

        load_weights(megatron_cfg.dist_checkpointing_path, chunks)
    else:
        load_hf_into_mcore(chunks, model_path, hf_config=hf_config)
    model = chunks[-1]  # the chunk with the output layer, on the last stage
    if scalar_head:
        from megatron_workers.heads import attach_scalar_head

        weights = checkpoint_weight_map(model_path)
        score = None
        if "score.weight" in weights:
            from safetensors import safe_open

            with safe_open(str(weights["score.weight"]), framework="pt") as f:
                score = f.get_tensor("score.weight")
        attach_scalar_head(model, weight=score)
    if optim is None:
        engine = MegatronEngine(chunks)
        engine.transformer_impl = impl
        return engine
    from megatron_workers.optimizer import build_optimizer, wrap_ddp

    use_dist_opt = bool(megatron_cfg.use_distributed_optimizer) if megatron_cfg is not None else False
    chunks = wrap_ddp(chunks, use_distributed_optimizer=use_dist_opt)
    optimizer, scheduler = build_optimizer(chunks, optim, use_distributed_optimizer=use_dist_opt,
                                           bf16=torch_dtype == torch.bfloat16)
    engine = MegatronEngine(chunks, optimizer, scheduler)
    engine.transformer_impl = impl
    return engine


def as_config(cfg, cls):
    """A config dataclass from an instance of it, or from a (nested) dict / DictConfig; unknown keys fail."""
    if isinstance(cfg, cls):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), cfg if cfg is not None else {}))
