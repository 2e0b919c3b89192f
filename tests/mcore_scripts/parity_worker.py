"""torchrun worker for tests/test_mcore_parity.py: one spawn checks several things for one layout.

Per rank: load an HF checkpoint into a Megatron GPTModel (TP/PP/SP/DP from the args), compute
per-token log-probs and entropy of a padded batch, optionally export back to HF, check the
vocab-parallel log-prob/entropy gradient against autograd on the full vocab, and optionally run
one DDP + distributed-optimizer training step whose grad norm the test compares with HF's.
Rank 0 writes everything to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcore_cases import make_batch  # noqa: E402

from hybridflow.parallel.dims import ParallelDims  # noqa: E402
from megatron_workers import cpu_compat, hf_io, logprob, model_builder, parallel_init  # noqa: E402


def tp_grad_check(vocab: int, tp: int) -> dict:
    """Vocab-parallel log-prob/entropy and their gradients vs autograd on the gathered full vocab."""
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(7)
    vp = model_builder.padded_vocab_size(vocab, tp)
    full = torch.randn(2, 5, vp, generator=gen) * 3
    labels = torch.randint(0, vocab, (2, 5), generator=gen)
    w_lp, w_ent = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    lp, ent = logprob.vocab_parallel_logprobs_entropy(shard, labels, vocab)
    (lp * w_lp + ent * w_ent).sum().backward()
    grads = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(grads, shard.grad, group=parallel_state.get_tensor_model_parallel_group())
    ref_in = full.double().requires_grad_()
    ref_logp = torch.log_softmax(ref_in[..., :vocab], dim=-1)
    ref_lp = ref_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    return {
        "lp_err": (lp.double() - ref_lp).abs().max().item(),
        "ent_err": (ent.double() - ref_ent).abs().max().item(),
        "grad_err": (torch.cat(grads, -1).double() - ref_in.grad).abs().max().item(),
    }


def train_step_grad_norm(model, ids, mask, mbs: int) -> tuple[float, float]:
    """One step of loss = mean over valid tokens of -log p; returns (megatron grad norm, loss)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e9,
                                                 use_distributed_optimizer=True), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    packed, pmask, _ = logprob.left_justify(ids, mask, multiple)
    n_valid = pmask[:, 1:].sum().item()
    batches = [(packed[i:i + mbs], pmask[i:i + mbs]) for i in range(0, packed.shape[0], mbs)]
    n_micro = len(batches)
    positions = torch.arange(packed.shape[1]).unsqueeze(0)

    def step(it, chunk):
        x, m = next(it)
        out = chunk(input_ids=x, position_ids=positions.expand_as(x), attention_mask=None)

        def loss_func(logits):
            lp, _ = logprob.vocab_parallel_logprobs_entropy(logits[:, :-1], x[:, 1:], model.hf_vocab_size,
                                                            compute_entropy=False)
            # the schedule divides by the number of micro-batches; undo it to get a global token mean
            loss = -(lp * m[:, 1:]).sum() / n_valid * n_micro
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(batches), model=[ddp], num_microbatches=n_micro,
        seq_length=packed.shape[1], micro_batch_size=mbs, forward_only=False)
    ok, grad_norm, _ = opt.step()
    assert ok
    # only the last PP stage has the losses; share them so rank 0 can report
    mine = sum(d["loss"].item() for d in losses) / n_micro if losses else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return float(grad_norm), next(v for v in every if v is not None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--ep", type=int, default=1, help="expert parallel (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel (MoE; default: tp)")
    p.add_argument("--mbs", type=int, default=0, help="micro-batch size (0: whole batch)")
    p.add_argument("--export-dir")
    p.add_argument("--export-shard-bytes", type=int, default=2 * 1024**3)
    p.add_argument("--train-step", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's params dtype")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    times = {}
    t0 = time.perf_counter()

    rank, world = parallel_init.init_distributed(timeout_s=60)
    dims = ParallelDims(tp=args.tp, pp=args.pp, dp=world // (args.tp * args.pp), sp=args.sp, ep=args.ep,
                        etp=args.etp)
    parallel_init.init_model_parallel(dims, seed=0)
    from megatron.core import parallel_state

    times["init"] = time.perf_counter() - t0
    cfg = hf_io.read_hf_config(args.hf_dir)
    vocab = cfg["vocab_size"]

    t = time.perf_counter()
    model = model_builder.build_gpt_model(cfg, dims, dtype=getattr(torch, args.dtype))
    times["build"] = time.perf_counter() - t
    t = time.perf_counter()
    load_stats = hf_io.load_hf_into_mcore([model], args.hf_dir)
    times["load"] = time.perf_counter() - t

    ids, mask = make_batch(vocab)
    # DP: each replica takes every dp-th row; the results are gathered back in row order
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    rows = list(range(dp_rank, ids.shape[0], dp))
    t = time.perf_counter()
    lp, ent = logprob.forward_logprobs(model, ids[rows], mask[rows], position_ids=(mask[rows].cumsum(-1) - 1).clamp(
        min=0), micro_batch_size=args.mbs or None)
    times["forward_logprobs"] = time.perf_counter() - t
    parts = [None] * dp
    dist.all_gather_object(parts, (rows, lp, ent), group=parallel_state.get_data_parallel_group())
    full_lp, full_ent = torch.zeros(ids.shape[0], ids.shape[1] - 1), torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for r, a, b in parts:
        full_lp[r], full_ent[r] = a, b

    if args.export_dir:
        t = time.perf_counter()
        hf_io.export_mcore_to_hf([model], cfg, args.export_dir, tokenizer_dir=args.hf_dir,
                                 max_shard_bytes=args.export_shard_bytes)
        times["export"] = time.perf_counter() - t

    grad_check = tp_grad_check(vocab, args.tp)
    train = None
    if args.train_step:
        t = time.perf_counter()
        train = train_step_grad_norm(model, ids, mask, args.mbs or ids.shape[0])
        times["train_step"] = time.perf_counter() - t

    bytes_read = [None] * world
    dist.all_gather_object(bytes_read, load_stats["bytes_read"])
    times["total"] = time.perf_counter() - t0
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "logprobs": full_lp.tolist(), "entropy": full_ent.tolist(), "grad_check": grad_check,
            "train": train, "bytes_read": bytes_read, "times": times, "patches": cpu_compat.applied_patches,
        }))
    parallel_init.destroy()


if __name__ == "__main__":
    main()
