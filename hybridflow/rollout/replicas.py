"""Splitting a batch over generation replicas and putting the results back together.

A generation replica is one rollout tensor-parallel group (t_g ranks). Every rank
of a replica must generate the same prompts (vLLM's external_launcher relies on
identical scheduling in all TP ranks); different replicas take different slices.
Two ways to use this, whichever fits the trainer's dispatch:

- the driver splits: `slice_for_replica` per replica, and `gather_replica_outputs`
  on the list it gets back (one output per replica, e.g. from each TP-rank 0);
- every rank gets the full batch: each takes its slice, generates, and
  `all_gather_replicas` gives every rank the full output (what a colocated
  Megatron step needs, since its TP ranks must all see the same batch).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridflow.protocol import DataProto


def replica_bounds(num_rows: int, replica_rank: int, num_replicas: int) -> tuple[int, int]:
    """[start, stop) rows of a replica: consecutive, sizes differ by at most one (earlier ones larger)."""
    if num_replicas < 1 or not 0 <= replica_rank < num_replicas:
        raise ValueError(f"replica_rank={replica_rank} is outside [0, num_replicas={num_replicas})")
    base, extra = divmod(num_rows, num_replicas)
    start = replica_rank * base + min(replica_rank, extra)
    return start, start + base + (1 if replica_rank < extra else 0)


def slice_for_replica(batch: DataProto, replica_rank: int, num_replicas: int) -> DataProto:
    """The consecutive rows of `batch` that replica `replica_rank` of `num_replicas` generates (a view).

    Uneven sizes are allowed; a replica may get zero rows when the batch is smaller than the
    number of replicas (it must still take part in collective generation steps).
    """
    start, stop = replica_bounds(len(batch), replica_rank, num_replicas)
    return batch[start:stop]


def gather_replica_outputs(outputs: Sequence[DataProto]) -> DataProto:
    """Concatenates per-replica outputs given in replica order (the inverse of the slicing)."""
    parts = [o for o in outputs if len(o) > 0] or list(outputs[:1])
    if not parts:
        raise ValueError("gather_replica_outputs: got no outputs")
    return DataProto.concat(parts)


def all_gather_replicas(local: DataProto, replica_rank: int, num_replicas: int, is_replica_leader: bool,
                        group=None) -> DataProto:
    """Every rank of `group` (default: the world) gets the full output, in replica order.

    Only one rank per replica (`is_replica_leader`, e.g. its TP rank 0) sends its output; the
    others of the same replica hold identical outputs and send nothing, so the bytes moved are
    one copy of the batch. Uses pickled objects (`all_gather_object`) so uneven slices and
    numpy object fields travel as they are.
    """
    import torch.distributed as dist

    mine = (replica_rank, local) if is_replica_leader else None
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    by_replica = {}
    for item in gathered:
        if item is None:
            continue
        rank, data = item
        if rank in by_replica:
            raise RuntimeError(f"all_gather_replicas: two leaders claim replica {rank}")
        by_replica[rank] = data
    if sorted(by_replica) != list(range(num_replicas)):
        raise RuntimeError(f"all_gather_replicas: expected one leader for each of {num_replicas} replicas, "
                           f"got replicas {sorted(by_replica)} from a group of {len(gathered)} ranks")
    return gather_replica_outputs([by_replica[r] for r in range(num_replicas)])
