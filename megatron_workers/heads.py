"""A scalar head on GPTModel: the critic's value head and the reward model's score head.

The LM output layer (vocab-parallel ColumnParallelLinear) is replaced by a
hidden -> 1 linear that every TP rank holds whole (replicated). GPTModel calls
its output layer as `output_layer(hidden, weight=..., runtime_gather_output=...)`
and expects `(output, bias)`, so the head keeps that signature and the rest of
GPTModel (pipeline stages, checkpoint sharding) is untouched.

Tensor parallelism without sequence parallel: the final hidden states are the
full sequence on every TP rank, so each rank computes the same values and the
same head gradient; the residual stream's gradient is then already complete
(in the LM case megatron's copy-to-TP region has to sum the vocab shards'
partial gradients; here there is nothing to sum).

With sequence parallel each rank holds S/tp positions. We gather the sequence
first, with `tensor_parallel_output_grad=False`: its backward only takes this
rank's slice of the (identical on every rank) gradient instead of summing tp
copies with a reduce-scatter, which would scale the gradient by tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Same seed on every rank, so TP replicas of a freshly initialised head agree without a broadcast.
HEAD_INIT_SEED = 1234


class ScalarHead(torch.nn.Module):
    """Replicated hidden -> 1 linear without bias (the layout of HF's *ForSequenceClassification `score`)."""

    def __init__(self, hidden_size: int, init_std: float, sequence_parallel: bool, dtype=torch.float32,
                 device=None):
        super().__init__()
        gen = torch.Generator().manual_seed(HEAD_INIT_SEED)
        weight = torch.randn(1, hidden_size, generator=gen, dtype=torch.float32) * init_std
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        # In fp32 whatever the params' dtype, as the log-probs are: values and the value loss then carry no bf16
        # rounding of their own (the product is hidden -> 1, so the upcast costs nothing).
        return F.linear(hidden_states.float(), self.weight.float()), None


def attach_scalar_head(model, weight: torch.Tensor | None = None) -> ScalarHead | None:
    """Replace `model.output_layer` (last PP stage only) by a ScalarHead; returns the head (None elsewhere).

    `weight` (1, hidden) initialises it, e.g. an HF reward model's `score.weight`; otherwise the
    head is drawn from a fixed-seed normal with the model's init std. The model must not tie
    its output layer to the embedding (build it with share_embeddings=False).
    """
    if getattr(model, "share_embeddings_and_output_weights", False):
        raise ValueError("attach_scalar_head: build the model with share_embeddings=False (the LM output layer "
                         "is tied to the embedding and cannot be replaced)")
    if not getattr(model, "post_process", True):
        return None
    config = model.config
    device = next(model.parameters()).device
    head = ScalarHead(config.hidden_size, config.init_method_std, config.sequence_parallel,
                      dtype=config.params_dtype, device=device)
    if weight is not None:
        if tuple(weight.shape) != (1, config.hidden_size):
            raise ValueError(f"scalar head weight has shape {tuple(weight.shape)}, expected (1, {config.hidden_size})")
        with torch.no_grad():
            head.weight.copy_(weight.to(head.weight.dtype))
    model.output_layer = head
    return head


def response_values(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """Per-position values (B, S) -> (B, R) values of the states before each response token.

    The value of response token t is read at the position that predicts it (t - 1),
    the same alignment as log-probs: positions S-R-1 .. S-2.
    """
    return values[:, -response_length - 1 : -1]


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """Per-position scores (B, S) -> (B, R) token-level scores: the last valid token's score, at its response slot.

    An empty response (no valid response token) puts the prompt's last score on response slot 0.
    """
    b, s = attention_mask.shape
    mask = attention_mask.to(values.device).bool()
    positions = torch.arange(s, device=values.device).expand(b, s)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    if (last < 0).any():
        rows = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} have no valid token (attention_mask all zero)")
    rows = torch.arange(b, device=values.device)
    slot = (last - (s - response_length)).clamp(min=0, max=response_length - 1)
    scores = torch.zeros(b, response_length, dtype=values.dtype, device=values.device)
    scores[rows, slot] = values[rows, last]
    return scores
