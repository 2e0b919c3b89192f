"""Several `megatron_workers.convert` commands in one torchrun, so the processes pay megatron's imports once.

Each argument is one command line of the converter (e.g. "hf-to-mcore --hf A --out B --tp 2"). Each job
creates and tears down its own Megatron groups (`convert.megatron_session`) inside the one default group.
Rank 0 prints one `STEP {json}` line per job with its timings.
"""

from __future__ import annotations

import json
import shlex
import sys

import torch.distributed as dist

from megatron_workers import convert, parallel_init


def main() -> None:
    parallel_init.init_distributed()
    for line in sys.argv[1:]:
        job = convert.plan(convert.parse_args(shlex.split(line)))
        seconds = convert.run(job)
        if dist.get_rank() == 0:
            print("STEP " + json.dumps({"cmd": line, "tp": job.tp, "pp": job.pp, "seconds": seconds}), flush=True)
    parallel_init.destroy()


if __name__ == "__main__":
    main()
