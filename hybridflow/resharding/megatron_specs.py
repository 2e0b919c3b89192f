"""Adapter: Megatron parameters -> ParamSpecs, read from each parameter's own TP attributes.

Megatron tags every tensor-parallel parameter with `tensor_model_parallel`, `partition_dim` and
`partition_stride` (2 for the SwiGLU fc1 [gate; up]). The adapter only scales the local shape back
to the full one and marks the vocab-parallel matrices so the generation side splits the real
(unpadded) vocab as vLLM does. No per-model table: a new architecture with the same attributes
needs nothing here. Global names (PP layer offsets) come from hf_mapping, the one mapping module.

Experts: Megatron tags an expert's fc1/fc2 with the same attributes, but splits them over the
expert-TP group (etp) and gives each EP rank its own experts, which the attributes do not say (its
`allreduce=False` appears only at ep > 1). So the caller names them (`is_expert`, e.g.
hf_mapping.is_expert) and says this rank's EP rank; their specs are scaled by etp and owned by that
EP rank. Their global names carry the global expert index, so every expert's spec comes from the
ranks that hold it and `gather_param_specs` needs nothing new.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hybridflow.parallel.dims import LayoutError
from hybridflow.resharding.planner import ParamSpec

# Megatron's vocab-parallel matrices (rows = the vocab, padded to a multiple of 128 * tp). The
# HybridEngine asks hf_mapping instead; this default keeps the adapter usable without it.
VOCAB_PARALLEL_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def param_specs(
    named_params: Iterable[tuple[str, torch.Tensor]],
    tp: int,
    pp_stage: int,
    vocab_size: int | None = None,
    gen_vocab_pad_multiple: int = 1,
    is_vocab: Callable[[str], bool] | None = None,
    is_expert: Callable[[str], bool] | None = None,
    expert_tp: int | None = None,
    ep_rank: int = 0,
) -> tuple[list[ParamSpec], dict[str, torch.Tensor]]:
    """This rank's ParamSpecs and {name: local training shard} from (global name, Megatron parameter) pairs.

    Names must already be global (hf_mapping.global_named_parameters adds the stage's layer offset).
    vocab_size: the real (HF) vocab; with it the vocab-parallel matrices carry `valid_size` so padding
    rows are never sent, and the generation split pads to `gen_vocab_pad_multiple` (vLLM: 64).
    is_expert: names an expert's weight; those are split over `expert_tp` (None: tp) and owned by `ep_rank`.
    """
    is_vocab = is_vocab or (lambda name: name in VOCAB_PARALLEL_PARAMS)
    specs, shards = [], {}
    for name, param in named_params:
        is_tp = bool(getattr(param, "tensor_model_parallel", False))
        dim = int(getattr(param, "partition_dim", 0)) if is_tp else 0
        stride = int(getattr(param, "partition_stride", 1)) if is_tp else 1
        expert = is_expert is not None and is_expert(name)
        shape = list(param.shape)
        if is_tp:
            shape[dim] *= (expert_tp or tp) if expert else tp
        vocab = is_tp and vocab_size is not None and is_vocab(name)
        specs.append(ParamSpec(
            name=name,
            full_shape=tuple(shape),
            dtype_bytes=param.element_size(),
            tensor_parallel=is_tp,
            partition_dim=dim,
            partition_stride=stride,
            pp_stage=pp_stage,
            valid_size=vocab_size if vocab else None,
            gen_pad_multiple=gen_vocab_pad_multiple if vocab else 1,
            ep_owner=ep_rank if expert else None,
        ))
        shards[name] = param.detach()
    return specs, shards


def merge_rank_specs(per_rank: list[list[ParamSpec]]) -> list[ParamSpec]:
    """One global spec list from every rank's local list: by stage, in first-seen order; copies must agree."""
    seen: dict[str, tuple[ParamSpec, int]] = {}
    order: list[str] = []
    for rank, specs in enumerate(per_rank):
        for spec in specs:
            if spec.name in seen:
                if seen[spec.name][0] != spec:
                    raise LayoutError(f"parameter {spec.name!r}: rank {seen[spec.name][1]} has {seen[spec.name][0]}, "
                                      f"rank {rank} has {spec}")
                continue
            seen[spec.name] = (spec, rank)
            order.append(spec.name)
    position = {n: i for i, n in enumerate(order)}
    return sorted((seen[n][0] for n in order), key=lambda s: (s.pp_stage, position[s.name]))


def gather_param_specs(local_specs: list[ParamSpec], group=None) -> list[ParamSpec]:
    """All ranks' specs (every rank must know every stage's parameters to plan). One all_gather_object."""
    import torch.distributed as dist

    per_rank: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, local_specs, group=group)
    return merge_rank_specs(per_rank)
