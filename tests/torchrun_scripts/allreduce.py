"""Run by launch.torchrun_ray in the tests: every rank all-reduces (rank + 1) over gloo and prints the sum.

With an argument N, rank N then raises and the others sleep: only the launcher can end them (fail-fast).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
print(f"up rank={rank} world={world} local={os.environ['LOCAL_RANK']}", flush=True)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"sum={t.item():g} rank={rank} marker={os.environ.get('TRR_MARKER', '')} cwd={os.getcwd()}", flush=True)
fail_rank = int(sys.argv[1]) if len(sys.argv) > 1 else -1
if rank == fail_rank:
    raise RuntimeError(f"injected failure on rank {rank}")
if fail_rank >= 0:
    time.sleep(600)
dist.destroy_process_group()
