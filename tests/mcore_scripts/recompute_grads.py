"""Activation recompute under torchrun (TP2): loss, gradients and bytes saved for backward, per setting.

Each setting builds the same model from the same HF weights, runs one training forward (a vocab-parallel
token log-likelihood loss) inside `torch.autograd.graph.saved_tensors_hooks` to count the bytes
autograd keeps for backward (each storage once, parameters not counted), then backward.
Rank 0 saves {setting: loss, grads, bytes}.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

SETTINGS = {
    "off": {},
    "full_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    # Selective recompute is made for the unfused attention, which keeps the s x s scores for backward; the
    # default fused SDPA keeps none. So it is measured there, against the same attention without recompute.
    "off_unfused": {"attention_backend": "unfused"},
    "selective": {"recompute_granularity": "selective", "attention_backend": "unfused"},
}


def saved_bytes_counter(params):
    """Bytes of the activations autograd saves (each storage once; the weights, saved too, left out)."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[tuple[int, int], int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def run_setting(hf_dir, hf_config, dims, override: dict, ids: torch.Tensor) -> dict:
    from hybridflow.config.schema import MegatronConfig, OverrideTransformerConfig
    from megatron_workers.hf_io import load_hf_into_mcore
    from megatron_workers.hf_mapping import global_named_parameters
    from megatron_workers.logprob import vocab_parallel_logprobs_entropy
    from megatron_workers.model_builder import build_model_chunks

    cfg = MegatronConfig(tensor_model_parallel_size=dims.tp, override_transformer_config=OverrideTransformerConfig(
        **override))
    (model,) = build_model_chunks(hf_config, dims, megatron_cfg=cfg)
    load_hf_into_mcore([model], hf_dir, hf_config=hf_config)
    model.train()
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    seen, hooks = saved_bytes_counter(model.parameters())
    with hooks:
        logits = model(ids, positions, None)
        logprob, _ = vocab_parallel_logprobs_entropy(logits[:, :-1], ids[:, 1:], model.hf_vocab_size)
        loss = -logprob.mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in global_named_parameters(model)}
    return {"loss": loss.item(), "grads": grads, "saved_bytes": sum(seen.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()

    from hybridflow.parallel.dims import ParallelDims
    from megatron_workers.hf_io import read_hf_config
    from megatron_workers.parallel_init import init_distributed, init_model_parallel

    _, world = init_distributed()
    dims = ParallelDims(tp=args.tp, dp=world // args.tp)
    init_model_parallel(dims, seed=3)
    hf_config = read_hf_config(args.model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, hf_config["vocab_size"], (4, 128), generator=g)
    result = {name: run_setting(args.model, hf_config, dims, o, ids) for name, o in SETTINGS.items()}
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
