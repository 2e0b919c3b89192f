"""Under torchrun (gloo): megatron's param all-gather pattern over buffers of two dtypes, through the
`_coalescing_manager` that param_and_grad_buffer uses, with cpu_compat applied (argv[1] == "patched") or not.
Rank 0 prints one JSON object: whether every buffer came back exactly."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    if sys.argv[1] == "patched":
        from megatron_workers.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    from megatron.core.distributed import param_and_grad_buffer as pgb

    rank, world = dist.get_rank(), dist.get_world_size()
    # like a bf16 model with an fp32 norm buffer: each rank holds its shard of each, and gathers the rest
    full = [torch.arange(8 * world, dtype=torch.float32).to(torch.bfloat16),
            torch.arange(100, 100 + 4 * world, dtype=torch.float32)]
    bufs = [f.clone() for f in full]
    for b in bufs:
        b.view(world, -1)[[r for r in range(world) if r != rank]] = 0  # only this rank's shard is known
    with pgb._coalescing_manager(None, async_ops=False):
        for b in bufs:
            dist.all_gather_into_tensor(b, b.view(world, -1)[rank])
    if rank == 0:
        print(json.dumps({"exact": [bool(torch.equal(b, f)) for b, f in zip(bufs, full)],
                          "first": bufs[0][:4].tolist()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
