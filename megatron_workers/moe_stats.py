"""What an MoE actor's routers did during one update: load imbalance and the load-balancing loss.

`RouterMeter` hooks every TopKRouter of a rank's model chunks and counts the tokens each expert was routed per
layer (the router's routing_map, summed over the update's forwards: micro-batches, and the recompute forward
too when recompute is on). `metrics()` sums the counts over all ranks (each layer lives on one pipeline stage;
without sequence parallelism every TP rank routes the same tokens, which scales a layer's counts but not its
ratio) and reports:

- `moe_load_imbalance`: max over mean tokens per expert, averaged over the MoE layers (1.0: perfectly even;
  E/k when every token of a layer goes to the same k experts). Padding slots of a packed micro-batch are
  routed too and counted.
- `moe_aux_loss`: megatron's load-balancing loss (without its coefficient), mean over layers and forwards,
  taken from megatron's aux-loss tracker; megatron computes it only when moe_aux_loss_coeff > 0, so it is
  reported only then.

A collective: every rank calls `metrics()` at the same point (the engine does, after each train_step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def moe_routers(model_chunks) -> list:
    """(global layer number, router) of every MoE router in these chunks."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                found.append((int(module.layer_number), module))
    return found


class RouterMeter:
    def __init__(self, model_chunks):
        self.routers = moe_routers(model_chunks)
        config = self.routers[0][1].config if self.routers else None
        self.num_layers = int(config.num_layers) if config is not None else 0
        self.num_experts = int(config.num_moe_experts) if config is not None else 0
        self.aux_coeff = float(config.moe_aux_loss_coeff or 0.0) if config is not None else 0.0
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.forwards = 0
        self.active = False
        for layer, router in self.routers:
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def count(module, inputs, output):
            if self.active:
                _, routing_map = output
                self.counts[layer - 1] += routing_map.detach().sum(dim=0).to(torch.float64).cpu()
                if layer == self.routers[0][0]:
                    self.forwards += 1
        return count

    def reset(self) -> None:
        self.counts.zero_()
        self.forwards = 0
        self.active = True
        if self.aux_coeff > 0:
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

            clear_aux_losses_tracker()

    def metrics(self) -> dict[str, float]:
        """Every rank the same dict (a collective over the default group)."""
        self.active = False
        counts = self.counts.clone()
        dist.all_reduce(counts)
        layers = counts.sum(dim=1) > 0
        per_layer = counts[layers].max(dim=1).values / counts[layers].mean(dim=1)
        out = {"moe_load_imbalance": float(per_layer.mean()) if layers.any() else float("nan")}
        if self.aux_coeff > 0:
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            values = get_moe_layer_wise_logging_tracker().get("load_balancing_loss", {}).get("values")
            # per layer: (this rank's mean over its forwards, 1 if the layer is on this rank); the sums over
            # ranks give each layer's mean over the ranks that hold it (DP shards see different tokens)
            per_layer = torch.zeros(2, self.num_layers, dtype=torch.float64)
            if values is not None and self.forwards:
                for layer, _ in self.routers:
                    per_layer[0, layer - 1] = float(values[layer - 1]) / self.forwards
                    per_layer[1, layer - 1] = 1.0
            dist.all_reduce(per_layer)
            held = per_layer[1] > 0
            out["moe_aux_loss"] = float((per_layer[0][held] / per_layer[1][held]).mean()) if held.any() else (
                float("nan"))
        return out
