"""Server mode on vLLM data-parallel replicas: 4 ranks, 2 replicas x t_g=2 (external_launcher, data_parallel_size=2).

Run under torchrun with 4 processes:
    python -m torch.distributed.run --nproc-per-node 4 serve_dp_vllm.py MODEL_DIR OUT_DIR [lockstep|free]

Each rank plays the driver (hybridflow/rollout/server.py: every tick goes to every rank, replica d's TP ranks get
replica d's list) over the worker's own ServingRole (megatron_workers/serving.py), as a Ray worker runs it. The
requests are routed unevenly and finish at different steps, so one replica's engine is often idle while the other
decodes; vLLM's data-parallel engines step as one collective, so every rank must take the same steps per tick.
  A. 3 requests to replica 0 (max_tokens 3, 9, 16), none to replica 1; a tick later one to replica 1 (5).
  B. replica 0 idle throughout, 2 requests to replica 1.
  C. interrupt_serving (a weight update) while replica 0 has one request in flight and replica 1 none; the
     interrupted request then continues (prompt + its tokens) on replica 1, with a new one on replica 0.
  D. end_serving (abort) with a request in flight on replica 1 only; then one request on each.
  E. a prompt longer than the engine's max_model_len on replica 0, a good request on replica 1: every rank must
     raise in that tick (not wait in the next step's collective); after end_serving both serve again.
Each rank saves what its replica served and its engine steps per tick to OUT_DIR/rank{r}.pt; the test compares
them with HF greedy and across ranks. "free" ticks without the lockstep rule (VLLMRollout.serve_tick(lockstep=
False)): the control, whose first tick must fail within the short collective timeout set here.
"""

import sys
import time

import torch
import torch.distributed as dist

from hybridflow.config.schema import RolloutConfig
from hybridflow.rollout.vllm_rollout import VLLMRollout
from megatron_workers.serving import ServingRole

R = 16
MAX_STEPS = 4
MAX_MODEL_LEN = 64
COLLECTIVE_TIMEOUT_S = 60  # vLLM's data-parallel group: its default (gloo's 30 min) would make a mismatch a hang
PROMPTS = [[1, 10, 20, 30, 40], [1, 50, 51, 52], [1, 7, 7, 7, 7, 7, 60], [1, 33], [1, 90, 91], [1, 5, 6, 7, 8, 9]]


def req(rid, prompt, max_tokens):
    return {"request_id": rid, "prompt_ids": list(prompt), "max_tokens": max_tokens, "greedy": True,
            "ignore_eos": True}


class Driver:
    """One phase of the driver's loop: each tick sends every replica its list; tick while any request sent has not
    come back (RolloutServer's rule). Records each tick's engine steps on this rank."""

    def __init__(self, host: ServingRole, lockstep: bool):
        self.host, self.lockstep = host, lockstep
        self.done: dict[str, dict] = {}
        self.steps: list[tuple[int, int]] = []  # (steps, of which dummy steps) per tick
        self.in_flight = 0

    def tick(self, per_replica: list[list[dict]]) -> None:
        rollout = self.host.rollout
        self.in_flight += sum(len(x) for x in per_replica)
        mine = per_replica[rollout.replica_rank]
        out = (self.host.serve_tick(mine, max_steps=MAX_STEPS) if self.lockstep
               else rollout.serve_tick(mine, max_steps=MAX_STEPS, lockstep=False))
        self.steps.append((rollout.last_stats["steps"], rollout.last_stats.get("idle_steps", 0)))
        self.done.update({d["request_id"]: d for d in out})
        n = torch.tensor([len(out) if rollout.is_replica_leader else 0])
        dist.all_reduce(n)  # the driver hears every replica's finished requests
        self.in_flight -= int(n)

    def drain(self, max_ticks: int = 20) -> None:
        for _ in range(max_ticks):
            if not self.in_flight:
                return
            self.tick([[], []])
        raise RuntimeError(f"{self.in_flight} requests still in flight after {max_ticks} ticks")

    def saved(self) -> dict:
        return {"done": self.done, "steps": self.steps}


def main(model_dir: str, out_dir: str, mode: str = "lockstep") -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    p = PROMPTS
    cfg = RolloutConfig(tensor_model_parallel_size=2, response_length=R, ignore_eos=True, seed=7,
                        kv_cache_memory_bytes=64 * 1024 * 1024)
    host = ServingRole()
    host.rollout = VLLMRollout(model_dir, cfg, dtype="float32", max_model_len=MAX_MODEL_LEN,
                               engine_kwargs={"cpu_distributed_timeout_seconds": COLLECTIVE_TIMEOUT_S})
    host.weight_version = 1
    host._start_serving_clock()
    rollout = host.rollout
    saved = {"layout": (rollout.num_replicas, rollout.replica_rank, rollout.tp_rank),
             "steps_in_lockstep": rollout.steps_in_lockstep, "engine_start_s": rollout.engine_start_s,
             "prompts": p, "max_steps": MAX_STEPS, "response_length": R}
    lockstep = mode == "lockstep"
    t0 = time.perf_counter()

    a = Driver(host, lockstep)
    a.tick([[req("a0", p[0], 3), req("a1", p[1], 9), req("a2", p[2], 16)], []])
    a.tick([[], [req("a3", p[3], 5)]])
    a.drain()
    saved["A"] = a.saved()

    b = Driver(host, lockstep)
    b.tick([[], [req("b0", p[4], 7), req("b1", p[5], 12)]])
    b.drain()
    saved["B"] = b.saved()

    c = Driver(host, lockstep)
    c.tick([[req("c0", p[0], R)], []])
    partial = host.interrupt_serving()
    mine = next((x["token_ids"] for x in partial if x["request_id"] == "c0"), None)
    heard = [None] * dist.get_world_size()
    dist.all_gather_object(heard, mine)  # the driver hears replica 0's partial tokens
    cut = next(t for t in heard if t is not None)
    c.in_flight = 0
    c.tick([[req("c1", p[1], 6)], [req("c0+", p[0] + cut, R - len(cut))]])
    c.drain()
    saved["C"] = {**c.saved(), "partial": partial, "cut": cut}

    d = Driver(host, lockstep)
    d.tick([[], [req("d0", p[2], R)]])
    saved["D_end"] = host.end_serving()
    d.in_flight = 0
    d.tick([[req("d1", p[3], 4)], [req("d2", p[4], 8)]])
    d.drain()
    saved["D"] = d.saved()

    e = Driver(host, lockstep)
    t = time.perf_counter()
    try:
        e.tick([[req("e0", [1] * (MAX_MODEL_LEN + 6), 4)], [req("e1", p[5], 4)]])
        saved["E_error"] = None
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        saved["E_error"] = f"{type(err).__name__}: {err}"
    saved["E_error_s"] = time.perf_counter() - t
    saved["E_end"] = host.end_serving()
    e = Driver(host, lockstep)
    e.tick([[req("e2", p[1], 5)], [req("e3", p[5], 3)]])
    e.drain()
    saved["E"] = e.saved()

    saved["serve_s"] = time.perf_counter() - t0
    rollout.shutdown()
    torch.save(saved, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
