"""Asynchronous RL on split pools (docs/async.md): one step when generation runs on a rollout pool of its
own and the training stages on the actor's pool, with the weight sync between them. Pure functions of seconds and
bytes; step_time.py feeds them the planner's stage times.

- Generation: the rollout pool's vLLM replicas at rollout TP (step_time.generation on the rollout pool's GPUs).
- Training: old/ref log-probs, values, RM, the updates and offload traffic, on the actor pool's GPUs.
- Weight sync (hybridflow/resharding/cross_pool_plan.py): every rollout rank receives exactly its vLLM shard,
  M/t_g bytes; rollout replica q reads from training data replica q mod (cp*dp), each of whose ranks sends its own
  M/(t*p) slice, so the busiest training rank sends that once per replica it serves. The slower of the two, over the
  link between the pools, every `async_training.trigger_parameter_sync_step` steps (amortised per step).
- sync mode: gen + train + sync. one_step_off_policy: max(gen, train) + sync. The sync is not overlapped with
  anything: PoolWeights.transfer (hybridflow/trainer/generation/weights.py) waits for both the send and the
  receive, and the receive queues on the rollout workers behind the next batch's generation (started before the
  training stages), so it starts only when both generation and training are done, and the next step starts only
  after it (the trainer's `send(wait=False)` exists, but the step does not use it).
- Idle fractions count the sync as busy on both pools (one sends, the other receives), as
  launch/benchmark/async_ablation.py's row_metrics does with weight_sync/send_s and recv_s.
- fully_async with staleness eta (hybridflow/trainer/async_producer.py): after the sync that ends step k, the
  rollout generates what admission held back of batch k+1, the (1 - eta) share (eta < 1), then the trainer trains
  k+1 while the rollout generates up to eta of batch k+2: step = sync + (1 - eta) gen + max(train, eta gen). eta >= 1
  never holds the rollout back in steady state: max(gen, train) + sync, one_step_off_policy's step. eta = 0 is sync.
  The weight update pauses the rollout (interrupting what is in flight), so the sync is busy time on both pools.
  ASSUMED: generation time proportional to the prompt groups generated (no long tail, which is where partial
  rollouts and a larger eta pay beyond this model).
Steady state: the first step of one_step_off_policy (nothing generated ahead yet) is a sync-mode step.
"""

from __future__ import annotations

import math

MODES = ("sync", "one_step_off_policy", "fully_async")


def rollout_rank_recv_bytes(model_bytes: float, t_g: int) -> float:
    """What each rollout rank receives per sync: its vLLM tensor-parallel shard, M/t_g (nothing is held locally)."""
    return model_bytes / t_g


def busiest_sender_bytes(model_bytes: float, tp: int, pp: int, train_replicas: int, rollout_replicas: int) -> float:
    """What the busiest training rank sends per sync: its M/(tp*pp) slice once for each rollout replica it serves
    (replica q reads from training data replica q mod train_replicas, train_replicas = cp*dp)."""
    return math.ceil(rollout_replicas / train_replicas) * model_bytes / (tp * pp)


def pools_share_node(actor_procs: list[int], rollout_procs: list[int], gpus_per_node: int) -> bool:
    """ASSUMED placement: the two pools share a node (NVLink between them) only when both fit in one node together;
    otherwise the sync crosses the inter-node network (Ray places each pool's bundles; a pool of its own is then on
    nodes of its own)."""
    return len(actor_procs) == 1 and len(rollout_procs) == 1 and actor_procs[0] + rollout_procs[0] <= gpus_per_node


def weight_sync_s(recv_bytes: float, send_bytes: float, link_bytes_s: float) -> float:
    """One sync: the larger of a rollout rank's receive and the busiest training rank's send over the link (per GPU,
    per direction)."""
    return max(recv_bytes, send_bytes) / link_bytes_s


def sync_per_step_s(sync_s: float, every: int) -> float:
    """The sync runs every `every` steps (trigger_parameter_sync_step): its share of one step."""
    if every < 1:
        raise ValueError(f"async_training.trigger_parameter_sync_step={every} must be >= 1")
    return sync_s / every


def async_step_s(gen_s: float, train_s: float, sync_s: float, mode: str, staleness: float = 0.0) -> float:
    """One step on split pools: sync = gen + train + sync (no overlap); one_step_off_policy = max(gen, train) +
    sync (generation of step k+1 overlaps training of step k; the sync waits for both); fully_async: the share of
    generation admission lets overlap training (`staleness`, see the module's docstring)."""
    if mode == "sync":
        return gen_s + train_s + sync_s
    if mode == "one_step_off_policy":
        return max(gen_s, train_s) + sync_s
    if mode == "fully_async":
        if staleness < 0:
            raise ValueError(f"async_training.staleness_threshold={staleness} must be >= 0")
        eta = min(staleness, 1.0)
        return sync_s + (1 - eta) * gen_s + max(train_s, eta * gen_s)
    raise ValueError(f"async_training.mode={mode!r}; the planner models {', '.join(MODES)}")


def idle_fractions(gen_s: float, train_s: float, sync_s: float, mode: str,
                   staleness: float = 0.0) -> tuple[float, float]:
    """(rollout pool, training pool) idle shares of the step; the sync is busy time on both."""
    step = async_step_s(gen_s, train_s, sync_s, mode, staleness)
    if step <= 0:
        return 0.0, 0.0
    return max(0.0, 1 - (gen_s + sync_s) / step), max(0.0, 1 - (train_s + sync_s) / step)
