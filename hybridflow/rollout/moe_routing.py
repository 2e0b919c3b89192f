"""The HF rollout's MoE routers: run in the training's router dtype, and record what they chose (routing replay).

Training routes in `moe_router_dtype` (fp32 by default: logits, softmax and top-k) whatever the params' dtype
(model_builder._moe_fields). A transformers MoE router computes its logits in the params' dtype (bf16), so
near-ties between experts resolve differently in the rollout and in training, and a token routed differently
gets a different log-prob: the largest part of the rollout-vs-training gap of an MoE model in bf16. Here each
layer's router (`model.layers[i].mlp.gate`, transformers >= 5: a module returning (logits, scores, indices))
keeps its weight in the router dtype and gets its input cast to it; its scores go back to the hidden states'
dtype for the experts.

With `record=True` (actor_rollout_ref.rollout.enable_rollout_routing_replay) the chosen experts of every
forward of a generate() are kept and `routed_experts()` lays them out over the output batch's columns:
(rows, prompt + response columns, layers, top_k), -1 where nothing was routed (a row's last response
token, which is sampled but never fed back, and the response padding). The prompt's left padding is routed
by HF too; those slots are recorded but never used (training drops padding).
"""

from __future__ import annotations

import torch

ROUTED_EXPERTS = "routed_experts"  # the batch key (verl's), read by megatron_workers/engine.py's routing replay
ROUTED_DTYPE = torch.int16  # expert ids; -1: not routed


def moe_router_modules(model) -> list:
    """Each decoder layer's MoE router, in layer order ([] for a dense model)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    routers = []
    for layer in layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and isinstance(getattr(gate, "weight", None), torch.Tensor):
            routers.append(gate)
    return routers


class RouterRecorder:
    def __init__(self, model, router_dtype: torch.dtype = torch.float32, record: bool = False):
        self.routers = moe_router_modules(model)
        self.record = record
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        for i, router in enumerate(self.routers):
            router.to(router_dtype)
            router.register_forward_pre_hook(lambda m, args, dtype=router_dtype: (args[0].to(dtype), *args[1:]))
            router.register_forward_hook(self._after(i))

    def _after(self, layer: int):
        def hook(module, args, output):
            logits, scores, indices = output
            if self.record:
                self.calls[layer].append(indices.detach().to("cpu", ROUTED_DTYPE))
            return logits, scores.to(self._hidden_dtype), indices
        return hook

    def start(self, hidden_dtype: torch.dtype) -> None:
        """Before a generate(): forget the last one's choices."""
        self._hidden_dtype = hidden_dtype
        self.calls = [[] for _ in self.routers]

    def routed_experts(self, rows: int, prompt_len: int, response_len: int, generated: int) -> torch.Tensor:
        """(rows, prompt_len + response_len, layers, top_k) from the last generate(): its first forward routed
        rows x prompt_len tokens, each later one rows x 1 (generated token t at column prompt_len + t)."""
        out = torch.full((rows, prompt_len + response_len, len(self.routers), self.top_k), -1, dtype=ROUTED_DTYPE)
        for layer, calls in enumerate(self.calls):
            if not calls:
                continue
            expected = 1 + max(0, generated - 1)
            if len(calls) != expected:
                raise RuntimeError(f"routing replay: layer {layer} routed {len(calls)} forwards, a generate of "
                                   f"{generated} tokens makes {expected}")
            out[:, :prompt_len, layer] = calls[0].view(rows, prompt_len, self.top_k)
            for t, step in enumerate(calls[1:]):
                out[:, prompt_len + t, layer] = step.view(rows, self.top_k)
        return out
