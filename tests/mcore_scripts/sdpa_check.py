"""One gloo rank: megatron's DotProductAttention against SDPADotProductAttention on the same q/k/v.

Prints one JSON line: per case, the max abs difference of the outputs and of the q/k/v gradients, and
which path SDPADotProductAttention took (sdpa, or megatron's own forward for the cases it must not take).
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])

from hybridflow.parallel.dims import ParallelDims  # noqa: E402
from megatron_workers.parallel_init import init_distributed, init_model_parallel  # noqa: E402


def main() -> None:
    init_distributed()
    init_model_parallel(ParallelDims())
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_workers.sdpa_attention as sdpa_mod
    from megatron_workers.sdpa_attention import SDPADotProductAttention

    calls = {"sdpa": 0}
    real_sdpa = sdpa_mod.F.scaled_dot_product_attention

    def counting(*a, **k):
        calls["sdpa"] += 1
        return real_sdpa(*a, **k)

    sdpa_mod.F.scaled_dot_product_attention = counting
    out = {}
    for name, heads, groups, seq, batch, mask in (("mha", 4, 4, 37, 3, False), ("gqa", 8, 2, 150, 2, False),
                                                 ("explicit_mask", 4, 2, 20, 2, True)):
        cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                                kv_channels=32, attention_dropout=0.0, use_cpu_initialization=True,
                                masked_softmax_fusion=False)
        ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
        ours = SDPADotProductAttention(cfg, 1, AttnMaskType.causal, "self")
        g = torch.Generator().manual_seed(len(name))
        q = torch.randn(seq, batch, heads, 32, generator=g)
        k = torch.randn(seq, batch, groups, 32, generator=g)
        v = torch.randn(seq, batch, groups, 32, generator=g)
        # An explicit mask (True = masked) that is causal plus a masked first key: only megatron's path honours it.
        m = None
        if mask:
            m = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
            m[:, 0] = True
            m[0, 0] = False
            m = m.expand(batch, 1, seq, seq)
        results = []
        for module in (ref, ours):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            before = calls["sdpa"]
            o = module(qq, kk, vv, m)
            (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
            results.append((o.detach(), qq.grad, kk.grad, vv.grad, calls["sdpa"] - before))
        (ro, rq, rk, rv, _), (so, sq_, sk, sv, used) = results
        out[name] = {"shape": list(so.shape), "ref_shape": list(ro.shape), "used_sdpa": used > 0,
                     "out": float((ro - so).abs().max()), "dq": float((rq - sq_).abs().max()),
                     "dk": float((rk - sk).abs().max()), "dv": float((rv - sv).abs().max()),
                     "scale": float(ro.abs().max())}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
