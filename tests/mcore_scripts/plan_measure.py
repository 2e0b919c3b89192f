"""What the planner predicts, measured on real Megatron objects (run under torchrun, 2 ranks, gloo, fp32).

For each layout: build the GPTModel of a tiny HF config, wrap it in Megatron DDP and the distributed optimizer,
take one optimizer step (Adam state is created lazily), then count per rank
- params: bytes of the model's parameters,
- grads: bytes of the fp32 `main_grad` views DDP gives each parameter (and the padded grad buffer),
- optimizer: bytes of every optimizer-state tensor (Adam moments, and main params that own their storage).
Then the bytes the decoder saves for backward in one forward, seen by torch.autograd.graph.saved_tensors_hooks
(each storage counted once, parameters excluded), for recompute none / selective / full, with the default
fused SDPA attention and with megatron's unfused one.
Each rank writes its numbers to <out>/rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def saved_bytes(fn, exclude: set) -> int:
    """Bytes of the distinct storages autograd saves while fn() runs, minus the `exclude` storages (weights)."""
    seen: dict = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = _storage_key(t)
            if key[0] not in exclude:
                seen[key[0]] = max(seen.get(key[0], 0), key[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def count_state(model, optimizer) -> dict:
    params = list(model.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    grad_views = [p.main_grad for p in params]
    buffers = [b for b in model.buffers] if isinstance(model.buffers, list) else []
    grad_buffer = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    state_ptrs: dict = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for st in inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    state_ptrs[_storage_key(v)[0]] = v.numel() * v.element_size()
        for group in inner.param_groups:  # main params: count only those owning their storage
            for p in group["params"]:
                ptr = p.untyped_storage().data_ptr()
                if ptr not in param_ptrs and all(ptr != b.grad_data.untyped_storage().data_ptr() for b in buffers) \
                        and all(ptr != b.param_data.untyped_storage().data_ptr() for b in buffers
                                if b.param_data is not None):
                    state_ptrs[ptr] = p.numel() * p.element_size()
    return {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(g.numel() * g.element_size() for g in grad_views),
        "grad_buffer": grad_buffer,
        "optimizer": sum(state_ptrs.values()),
    }


def measure_state(hf_config: dict, tp: int, seed: int = 3) -> dict:
    from megatron.core import parallel_state

    from hybridflow.config.schema import OptimConfig
    from hybridflow.parallel.dims import ParallelDims
    from megatron_workers.model_builder import build_gpt_model
    from megatron_workers.optimizer import build_optimizer, wrap_ddp
    from megatron_workers.parallel_init import init_model_parallel

    world = torch.distributed.get_world_size()
    dims = ParallelDims(tp=tp, dp=world // tp)
    init_model_parallel(dims, seed=seed)
    model = build_gpt_model(hf_config, dims)
    chunks = wrap_ddp([model], use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(chunks, OptimConfig(lr=1e-3), use_distributed_optimizer=True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, hf_config["vocab_size"], (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    loss = chunks[0](ids, pos, None, labels=ids).float().mean()
    loss.backward()
    chunks[0].finish_grad_sync()
    optimizer.step()
    out = count_state(chunks[0], optimizer)
    out.update(tp=tp, dp=dims.dp)
    parallel_state.destroy_model_parallel()
    return out


def measure_activations(hf_config: dict, tp: int, sp: bool, recompute: str, seq: int, micro: int,
                        attention: str) -> int:
    """Bytes saved for backward by one forward of the decoder (all layers) at [seq, micro, hidden], with the
    local spec's core attention `attention` (attention_backend: auto = fused SDPA, unfused)."""
    from megatron.core import parallel_state

    from hybridflow.config.schema import MegatronConfig, OverrideTransformerConfig
    from hybridflow.parallel.dims import ParallelDims
    from megatron_workers.model_builder import build_gpt_model
    from megatron_workers.parallel_init import init_model_parallel

    world = torch.distributed.get_world_size()
    dims = ParallelDims(tp=tp, dp=world // tp, sp=sp)
    init_model_parallel(dims, seed=5)
    # Megatron's own recompute, as the trainer sets it from override_transformer_config (full: uniform, 1 layer)
    recompute_keys = {} if recompute == "none" else {"recompute_granularity": recompute}
    if recompute == "full":
        recompute_keys.update(recompute_method="uniform", recompute_num_layers=1)
    model = build_gpt_model(hf_config, dims, megatron_cfg=MegatronConfig(override_transformer_config=(
        OverrideTransformerConfig(attention_backend=attention, **recompute_keys))))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    h = hf_config["hidden_size"]
    s_local = seq // tp if sp else seq
    x = torch.randn(s_local, micro, h, requires_grad=True)
    rope = model.rotary_pos_emb(seq)
    model.train()
    nbytes, out = saved_bytes(lambda: model.decoder(x, attention_mask=None, rotary_pos_emb=rope), weights | {
        x.untyped_storage().data_ptr()})
    out.float().sum().backward()  # the graph is usable: the measured tensors are what backward reads
    parallel_state.destroy_model_parallel()
    return nbytes + x.numel() * x.element_size()  # the decoder's input is saved too (the first norm's input)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    args = ap.parse_args()
    from megatron_workers.parallel_init import init_distributed

    rank, world = init_distributed(timeout_s=120)
    hf_config = json.loads((Path(args.model) / "config.json").read_text())
    result = {"state": [measure_state(hf_config, tp) for tp in (world, 1)], "activations": []}
    for tp, sp, recompute, attention in (
            (world, False, "none", "auto"), (world, True, "none", "auto"), (world, False, "selective", "auto"),
            (world, False, "full", "auto"), (1, False, "none", "auto"),
            (world, False, "none", "unfused"), (world, False, "selective", "unfused")):
        nbytes = measure_activations(hf_config, tp, sp, recompute, args.seq, args.micro, attention)
        result["activations"].append(dict(tp=tp, sp=sp, recompute=recompute, attention=attention, seq=args.seq,
                                          micro=args.micro, bytes=nbytes))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
