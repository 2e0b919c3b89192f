"""Log-probs of given labels and entropy, straight from vocab-parallel (TP-sharded) logits.

No rank ever holds the full vocabulary for a token: the softmax normaliser,
the target logit and the entropy's expectation are each one TP all-reduce
(max, then sums) over per-shard partial results. Vocab rows that exist only
because of padding (`padded_vocab_size`) are masked out, so they get no
probability mass and no gradient.

`vocab_parallel_logprobs_entropy` is a custom autograd function with an
explicit backward, so the actor loss can backprop through log-probs and
entropy without materialising more than one extra vocab-sized tensor.

`forward_logprobs` is an inference helper (no grad) that runs a Megatron
GPTModel on padded batches, using megatron's own forward schedule so it also
works with PP > 1, and returns per-token log-probs/entropy on every rank.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Per token: log p(label) and entropy H of softmax(logits) over the real vocab, logits split on the last dim."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, real_vocab_size, group, compute_entropy):
        x = logits if logits.dtype == torch.float64 else logits.float()  # float64 kept for gradcheck
        local_vocab = x.shape[-1]
        # Columns past the real vocab are padding: they must not take part in the softmax.
        n_real_local = max(0, min(local_vocab, real_vocab_size - vocab_start))
        valid = torch.arange(local_vocab, device=x.device) < n_real_local
        x_valid = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))

        row_max = torch.where(valid, x, torch.full((), float("-inf"), dtype=x.dtype, device=x.device)).amax(dim=-1)
        row_max = _all_reduce(row_max, dist.ReduceOp.MAX, group)
        exp = torch.where(valid, torch.exp(x - row_max.unsqueeze(-1)), torch.zeros((), dtype=x.dtype, device=x.device))
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        lse = torch.log(sum_exp) + row_max

        local_label = labels - vocab_start
        owned = (local_label >= 0) & (local_label < n_real_local)
        target = torch.gather(x_valid, -1, local_label.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
        target = _all_reduce(torch.where(owned, target, torch.zeros_like(target)), dist.ReduceOp.SUM, group)
        logprob = target - lse

        probs = exp.div_(sum_exp.unsqueeze(-1))  # reuse the buffer: exp is not needed any more
        if compute_entropy:
            mean_x = _all_reduce((probs * x_valid).sum(dim=-1), dist.ReduceOp.SUM, group)
            entropy = lse - mean_x
        else:
            entropy = torch.zeros_like(lse)
        ctx.save_for_backward(probs, x_valid, lse, entropy, local_label, owned)
        ctx.input_dtype = logits.dtype
        ctx.compute_entropy = compute_entropy
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        probs, x_valid, lse, entropy, local_label, owned = ctx.saved_tensors
        # d logprob / dx_j = 1[j = label] - p_j
        grad = probs * (-grad_logprob.unsqueeze(-1))
        onehot_grad = torch.where(owned, grad_logprob, torch.zeros_like(grad_logprob))
        grad.scatter_add_(-1, local_label.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), onehot_grad.unsqueeze(-1))
        if ctx.compute_entropy:
            # d H / dx_j = -p_j (log p_j + H), log p_j = x_j - lse; padded columns have p_j = 0.
            log_p = x_valid - lse.unsqueeze(-1)
            grad -= grad_entropy.unsqueeze(-1) * probs * (log_p + entropy.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    real_vocab_size: int,
    tp_group=None,
    tp_rank: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(labels), entropy) per position from this rank's vocab shard of the logits.

    logits_shard: [..., V_padded / tp] (this TP rank's contiguous vocab rows); labels: [...] global ids.
    tp_group None means "megatron's TP group if model parallel is initialised, else no TP".
    Differentiable w.r.t. logits_shard. Entropy is zeros when compute_entropy=False.
    """
    if tp_group is None:
        tp_group, tp_rank = _default_tp_group()
    if tp_rank is None:
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    if temperature != 1.0:
        logits_shard = logits_shard / temperature
    vocab_start = tp_rank * logits_shard.shape[-1]
    return _VocabParallelLogProbEntropy.apply(
        logits_shard, labels, vocab_start, real_vocab_size, tp_group, compute_entropy
    )


def _default_tp_group():
    # If megatron was never imported, model parallel cannot be initialised: skip the 10 s import.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None, 0
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()


# --------------------------------------------------------------------------- padded batches


def left_justify(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1):
    """Move each row's valid tokens to the front (keeping order) and trim the common right padding.

    Megatron's RoPE uses the position in the sequence, so valid tokens must start at 0 to get the
    positions HF gets from cumsum(attention_mask) - 1. Returns (packed_ids, packed_mask, index) where
    index[b, j] is the original column of packed token j (valid where packed_mask is 1).
    The packed length is rounded up to `multiple` (sequence parallel needs a multiple of TP).
    """
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    width = int(lengths.max().item()) if lengths.numel() else 0
    width = max(1, -(-width // multiple) * multiple)
    cols = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    # stable sort puts valid columns first in their original order
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    index = torch.gather(cols, 1, order)[:, :width]
    if index.shape[1] < width:
        index = torch.cat([index, index.new_zeros(index.shape[0], width - index.shape[1])], dim=1)
    packed_mask = torch.arange(width, device=input_ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    packed_ids = torch.where(packed_mask, torch.gather(input_ids, 1, index), torch.zeros_like(index))
    return packed_ids, packed_mask, index


def unpack_next_token(values: torch.Tensor, packed_mask: torch.Tensor, index: torch.Tensor, seq_len: int):
    """Map packed next-token values back: out[b, k-1] = value for original token k; 0 elsewhere.

    values[b, j] belongs to packed token j+1 (predicted from packed tokens <= j).
    """
    b = values.shape[0]
    out = values.new_zeros(b, seq_len)
    target_valid = packed_mask[:, 1:]
    target_col = index[:, 1:] - 1  # column in the [.., seq_len - 1] next-token layout (plus one spare)
    out.scatter_(1, torch.where(target_valid, target_col, torch.full_like(target_col, seq_len - 1)),
                 torch.where(target_valid, values, torch.zeros_like(values)))
    return out[:, : seq_len - 1]


@torch.no_grad()
def forward_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    real_vocab_size: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    micro_batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log-probs, entropy) of a padded batch, [b, s-1] each, on every rank.

    out[:, k-1] is log p(input_ids[:, k] | valid tokens before k) and the entropy of that
    distribution; 0 where token k is padding or is the row's first valid token.
    `model` is one Megatron chunk (GPTModel, possibly DDP-wrapped); all ranks of the
    model-parallel group call this with the same batch. position_ids, if given, must be the
    HF default cumsum(attention_mask) - 1 (Megatron's RoPE has no other positions).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_workers.hf_mapping import unwrap

    gpt = unwrap(model)
    real_vocab_size = real_vocab_size or getattr(gpt, "hf_vocab_size", None)
    if real_vocab_size is None:
        raise ValueError("forward_logprobs: pass real_vocab_size (the model has no hf_vocab_size attribute)")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if position_ids is not None:
        expected = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if not torch.equal(position_ids[attention_mask.bool()], expected[attention_mask.bool()]):
            raise ValueError("forward_logprobs: position_ids differ from cumsum(attention_mask) - 1 on valid tokens; "
                             "Megatron's RoPE cannot use other positions")

    tp = parallel_state.get_tensor_model_parallel_world_size()
    multiple = tp if gpt.config.sequence_parallel else 1
    packed, packed_mask, index = left_justify(input_ids, attention_mask, multiple)
    device = next(gpt.parameters()).device
    packed, packed_mask = packed.to(device), packed_mask.to(device)
    batch, width = packed.shape
    mbs = micro_batch_size or batch
    if batch % mbs:
        raise ValueError(f"batch size {batch} is not divisible by micro_batch_size {mbs}")
    micro_batches = [(packed[i: i + mbs], packed_mask[i: i + mbs]) for i in range(0, batch, mbs)]
    positions = torch.arange(width, device=device).unsqueeze(0)

    def forward_step(data_iterator, chunk):
        ids, _ = next(data_iterator)
        out = chunk(input_ids=ids, position_ids=positions.expand_as(ids), attention_mask=None)

        def collect(logits):
            lp, ent = vocab_parallel_logprobs_entropy(
                logits[:, :-1], ids[:, 1:], real_vocab_size, temperature=temperature,
                compute_entropy=compute_entropy)
            return logits.new_zeros(()), {"logprobs": lp.float(), "entropy": ent.float()}

        return out, collect

    was_training = model.training
    model.eval()
    try:
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=width,
            micro_batch_size=mbs,
            forward_only=True,
        )
    finally:
        model.train(was_training)

    packed_lp = torch.empty(batch, width - 1, device=device)
    packed_ent = torch.empty(batch, width - 1, device=device)
    if parallel_state.is_pipeline_last_stage():
        packed_lp.copy_(torch.cat([r["logprobs"] for r in results]))
        packed_ent.copy_(torch.cat([r["entropy"] for r in results]))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(packed_lp, src=src, group=group)
        dist.broadcast(packed_ent, src=src, group=group)
    packed_mask, index = packed_mask.cpu(), index.cpu()
    seq_len = input_ids.shape[1]
    return (unpack_next_token(packed_lp.cpu(), packed_mask, index, seq_len),
            unpack_next_token(packed_ent.cpu(), packed_mask, index, seq_len))
