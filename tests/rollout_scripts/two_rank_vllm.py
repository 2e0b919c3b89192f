"""Two ranks, one in-process vLLM engine each (external_launcher), as a colocated worker runs it.

Run under torchrun with 2 processes:
    python -m torch.distributed.run --nproc-per-node 2 two_rank_vllm.py MODEL_DIR NEW_WEIGHTS_DIR OUT_DIR

The process group is created here first (gloo), the way the Megatron worker does before it
builds the rollout. Then, in the same processes:
  1. t_g=2 (one replica over both ranks): greedy; sampling with n=2; greedy after load_weights. Its TP
     collectives run on vLLM's shared-memory communicator where this CPU's vLLM build has it (AVX-512/AMX),
     whose segment names must already be gone from /dev/shm while the engine runs, as must the name of the TP
     group's broadcast buffer.
  2. shutdown, then t_g=1 (two replicas, vLLM data_parallel_size=2): each rank generates its own
     slice of the batch (uneven: 5 and 4 rows), all_gather_replicas gives both the full output;
     then a one-prompt batch, so replica 1 has nothing to do but must still take part.
Each rank saves what it saw to OUT_DIR/rank{r}.pt; the test compares with HF.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from reference import make_prompts
from safetensors.torch import load_file

from hybridflow.config.schema import RolloutConfig
from hybridflow.models.tiny import build_tokenizer
from hybridflow.rollout.replicas import all_gather_replicas, slice_for_replica
from hybridflow.rollout.vllm_rollout import VLLMRollout

R = 16


def generate_all(rollout: VLLMRollout, batch):
    """This replica's slice, then everyone gets the full output (the replica leaders' outputs:
    compare the local one, also returned, to check that TP ranks agree)."""
    mine = slice_for_replica(batch, rollout.replica_rank, rollout.num_replicas)
    local = rollout.generate_sequences(mine)
    gathered = all_gather_replicas(local, rollout.replica_rank, rollout.num_replicas, rollout.is_replica_leader)
    return gathered, local


def main(model_dir: str, new_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = build_tokenizer()
    greedy = make_prompts(tok, meta_info={"do_sample": False})
    saved = {}

    cfg = RolloutConfig(tensor_model_parallel_size=2, response_length=R, ignore_eos=True, seed=7,
                        kv_cache_memory_bytes=64 * 1024 * 1024)
    t0 = time.perf_counter()
    rollout = VLLMRollout(model_dir, cfg, dtype="float32")  # compared with HF fp32
    saved["tp2_layout"] = (rollout.num_replicas, rollout.replica_rank, rollout.tp_rank)
    saved["tp2_engine_s"] = rollout.engine_start_s
    saved["tp2_shm_active"] = rollout.shm_active
    dist.barrier()  # both engines are up: every name each rank created has been unlinked
    saved["tp2_shm_names"] = [n for n in os.listdir("/dev/shm") if n.startswith(f"hybridflow-{rollout.shm_token}-")]
    from vllm.distributed import parallel_state

    ring = parallel_state.get_tp_group().mq_broadcaster.buffer  # the TP group's broadcast buffer (psm_*)
    saved["tp2_broadcast_buffer_named"] = os.path.exists(f"/dev/shm/{ring.shared_memory.name}")
    out, local = generate_all(rollout, greedy)
    saved["tp2_greedy"] = out.batch["responses"]
    saved["tp2_greedy_local"] = local.batch["responses"]
    saved["tp2_greedy_logp_local"] = local.batch["rollout_log_probs"]
    t1 = time.perf_counter()
    out, _ = generate_all(rollout, greedy)
    saved["tp2_second_generate_s"] = time.perf_counter() - t1
    # Different global RNG states per rank (as a trainer's dropout might leave them): the TP ranks
    # must still draw the same tokens, since the rollout seeds each call itself.
    torch.manual_seed(100 + rank)
    _, sampled = generate_all(rollout, make_prompts(tok, meta_info={"n": 2, "temperature": 0.9}))
    saved["tp2_sampled_local"] = sampled.batch["responses"]
    rollout.load_weights(load_file(f"{new_dir}/model.safetensors").items())
    saved["tp2_load_s"] = rollout.last_weight_load_s
    out, _ = generate_all(rollout, greedy)
    saved["tp2_new_weights_greedy"] = out.batch["responses"]
    rollout.shutdown()

    cfg = RolloutConfig(tensor_model_parallel_size=1, response_length=R, ignore_eos=True, seed=7,
                        kv_cache_memory_bytes=64 * 1024 * 1024)
    rollout = VLLMRollout(model_dir, cfg, dtype="float32")  # compared with HF fp32
    saved["dp2_layout"] = (rollout.num_replicas, rollout.replica_rank, rollout.tp_rank)
    out, local = generate_all(rollout, greedy)
    saved["dp2_greedy"] = out.batch["responses"]
    saved["dp2_uids"] = list(out.non_tensor_batch["uid"])
    saved["dp2_rows"] = len(local)
    out, local = generate_all(rollout, greedy[:1])
    saved["dp2_one_prompt"] = out.batch["responses"]
    saved["dp2_one_prompt_rows"] = len(local)
    saved["total_s"] = time.perf_counter() - t0
    rollout.shutdown()
    # The trainer's default group survives both engines' teardown.
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    saved["world_sum_after_shutdown"] = total.item()
    torch.save(saved, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
