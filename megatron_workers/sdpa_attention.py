"""Core attention for megatron's local (non-Transformer-Engine) layer spec through torch's fused SDPA.

megatron's `DotProductAttention` materialises the [b, heads, s, s] scores (baddbmm), masks them with a
causal mask it builds each call, softmaxes and multiplies by V; autograd then keeps those score and
probability tensors for the backward. On CPU (and on CUDA without TE) that path is what our models run,
and at s ~ 150-200 it was the largest share of the tiny model's forward and backward in a py-spy profile.
`torch.nn.functional.scaled_dot_product_attention` computes the same function with a fused kernel
(flash-style on CPU and CUDA) that never keeps the s x s tensors.

It is exact for what the engine runs (plain causal attention, no mask tensor: megatron_workers/engine.py
left-justifies every row), so anything else falls back to megatron's own forward: an explicit mask,
packed sequences, an attention bias, a sliding window, softmax variants, query-key layer scaling, and
attention dropout while training (its RNG stream is megatron's tracker's, not SDPA's).
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPADotProductAttention(DotProductAttention):
    """`DotProductAttention` with the causal, unmasked case computed by torch's SDPA (same inputs/outputs)."""

    def _sdpa_applies(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
        c = self.config
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout = self.attention_dropout.p if self.training else 0.0
        return (attention_mask is None and attention_bias is None and packed_seq_params is None
                and mask_type == AttnMaskType.causal and dropout == 0.0
                and self.softmax_offset is None and not c.apply_query_key_layer_scaling
                and self.scale_mask_softmax.window_size is None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._sdpa_applies(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        # megatron's layout is [s, b, heads, head_dim]; SDPA's is [b, heads, s, head_dim].
        sq, b, heads, _ = query.shape
        groups = heads // key.shape[2]
        if groups > 1:  # GQA: repeat the kv heads, as megatron's path does (SDPA's enable_gqa is not fused on CPU)
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        # [b, heads, s, d] -> [s, b, heads * d], the shape megatron's projection expects.
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
