"""The 3D-HybridEngine through the real worker: Megatron TP=2 actor + vLLM rollout in the same Ray actors.

For t=2 and t_g in {1, 2}: after a sync, vLLM's greedy tokens equal HF transformers' on the exported
weights, the rollout log-probs equal Megatron's within 1e-4, and after one PPO update and a re-sync
the rollout uses the updated weights (again equal to HF on a fresh export).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.config.load import to_dict
from hybridflow.config.schema import ActorRolloutRefConfig, MegatronConfig, ModelConfig, RolloutConfig
from hybridflow.controller import RayWorkerGroup, ResourcePool
from hybridflow.protocol import DataProto


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("hybrid") / "model", preset="tiny", arch="llama", seed=3)


def _prompts(tokenizer, n=4, width=16):
    texts = ["reverse: ab1", "reverse: 9zq", "reverse: k", "reverse: 1234"][:n]
    ids = torch.full((n, width), tokenizer.pad_token_id)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, t in enumerate(texts):
        tok = tokenizer(t, add_special_tokens=False)["input_ids"]
        ids[i, -len(tok):] = torch.tensor(tok)
        mask[i, -len(tok):] = 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                               {"uid": np.array([str(i) for i in range(n)], dtype=object)},
                               {"do_sample": False})


def _hf_greedy(model_dir, prompts: DataProto, max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                         max_new_tokens=max_new, do_sample=False, pad_token_id=model.config.pad_token_id)
    gen = out[:, prompts.batch["input_ids"].shape[1]:]
    eos = model.generation_config.eos_token_id
    res = []
    for row in gen.tolist():
        keep = []
        for t in row:
            keep.append(t)
            if t == eos:
                break
        res.append(keep)
    return res


def _rollout_tokens(out: DataProto) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(out.batch["responses"], out.batch["response_mask"], strict=True)]


# bf16 (model.dtype=auto on a CPU with native bf16): vLLM and Megatron run different bf16 kernels, so their
# log-probs of the same tokens agree only to bf16 rounding (measured 2026-12-04, AMD EPYC avx512_bf16, t_g=1:
# greedy tokens, mean |diff| 9.1e-4 and 3.0-4.4e-3, max 2.1e-3 and 1.1e-2 in the two rounds); greedy tokens are not
# compared with HF, since bf16 flips ties.
BF16_LOGPROB_MEAN_TOL, BF16_LOGPROB_MAX_TOL = 1e-2, 5e-2
_bytes_at_t_g1: dict[str, float] = {}  # dtype -> bytes each rank received at t_g=1, to compare fp32 with bf16


@pytest.mark.slow
@pytest.mark.parametrize(("t_g", "dtype"), [(2, "float32"), (1, "float32"), (1, "bfloat16")])
def test_sync_generate_update_resync(ray_cluster, tiny, tmp_path, t_g, dtype):
    from transformers import AutoTokenizer

    cfg = ActorRolloutRefConfig(model=ModelConfig(path=str(tiny), dtype=dtype))
    cfg.actor.megatron = MegatronConfig(tensor_model_parallel_size=2)
    cfg.ref.megatron = MegatronConfig(tensor_model_parallel_size=2)
    cfg.actor.optim.lr = 5e-2
    cfg.actor.optim.weight_decay = 0.0
    cfg.actor.ppo_mini_batch_size = 4
    cfg.rollout = RolloutConfig(name="vllm", tensor_model_parallel_size=t_g, response_length=6, n=1,
                                kv_cache_memory_bytes=64 * 1024**2)
    pool = ResourcePool(f"hybrid{t_g}", [2], cpus_per_proc=0.5, max_colocate=1)
    group = RayWorkerGroup(pool, _worker_cls(), (to_dict(cfg), "actor_rollout_ref"), role="arr", timeout_s=400,
                           env={"TOKENIZERS_PARALLELISM": "false"})
    try:
        group.refresh_rendezvous()
        group.init_model()
        tok = AutoTokenizer.from_pretrained(tiny)
        prompts = _prompts(tok)
        for round_ in range(2):
            out = group.generate_sequences(prompts)
            sync = out.meta_info["metrics"]
            # each rank receives exactly its planned shard bytes, in the params' dtype (bf16: half of fp32's)
            assert sync["reshard/bytes_recv_per_rank"] == sync["reshard/expected_bytes_per_rank"]
            assert (sync["reshard/bytes_recv_per_rank"] > 0) == (t_g < 2)
            if t_g == 1:
                _bytes_at_t_g1[dtype] = sync["reshard/bytes_recv_per_rank"]
                if len(_bytes_at_t_g1) == 2:  # both ran (the parametrised order runs fp32 first)
                    assert _bytes_at_t_g1["bfloat16"] * 2 == _bytes_at_t_g1["float32"], _bytes_at_t_g1
            lp = group.compute_log_prob(out)
            mask = out.batch["response_mask"].bool()
            diff = (lp.batch["old_log_probs"] - out.batch["rollout_log_probs"]).abs()[mask]
            if dtype == "bfloat16":
                print(f"bf16 round {round_}: rollout vs Megatron log-prob |diff| mean {diff.mean().item():.3e} "
                      f"max {diff.max().item():.3e}; bytes {sync['reshard/bytes_recv_per_rank']}")
                assert 0 < diff.mean().item() < BF16_LOGPROB_MEAN_TOL and diff.max().item() < BF16_LOGPROB_MAX_TOL
            else:
                export = tmp_path / f"export{round_}"
                group.export_hf(str(export))
                assert _rollout_tokens(out) == _hf_greedy(export, prompts, 6), f"round {round_}"
                assert diff.max().item() < 1e-4, diff.max().item()
            if round_ == 0:
                batch = out.union(lp.select(batch_keys=["old_log_probs"]))
                adv = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0)[:, None].expand_as(mask).float()
                batch.batch["advantages"] = adv * mask
                batch.meta_info["rollout_n"] = 1
                before = group.compute_log_prob(out).batch["old_log_probs"]
                group.update_actor(batch)
                after = group.compute_log_prob(out).batch["old_log_probs"]
                assert (after - before).abs()[mask].max().item() > 1e-3  # the update really moved the policy
    finally:
        group.kill()
        pool.remove()


def _worker_cls():
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    return ActorRolloutRefWorker
