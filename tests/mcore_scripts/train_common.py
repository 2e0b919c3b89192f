"""Shared pieces of the training tests: RL-shaped batches, worker configs, and the torchrun launcher."""

from __future__ import annotations

import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent


def make_rl_batch(vocab: int, seed: int = 0, batch: int = 8, prompt_len: int = 6, response_len: int = 5) -> dict:
    """verl's layout: left-padded prompts + right-padded responses, with varying lengths per row.

    Token ids avoid the special ids 0-3 (pad/bos/eos/unk of the tiny tokenizer) except the pad.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(batch, prompt_len, dtype=torch.long)
    prompt_mask = torch.zeros(batch, prompt_len, dtype=torch.long)
    responses = torch.zeros(batch, response_len, dtype=torch.long)
    response_mask = torch.zeros(batch, response_len, dtype=torch.long)
    for i in range(batch):
        p = 2 + (i * 3) % (prompt_len - 1)  # 2..prompt_len
        r = response_len if i % 3 == 0 else 1 + (i * 2) % response_len  # full-length rows and short ones
        prompts[i, prompt_len - p:] = torch.randint(4, vocab, (p,), generator=g)
        prompt_mask[i, prompt_len - p:] = 1
        responses[i, :r] = torch.randint(4, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
    }


def ppo_inputs(batch: dict, old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor, seed: int = 1,
               drop_rows: tuple[int, ...] = ()) -> dict:
    """Add advantages and an off-policy `old_log_probs` (perturbed, so the PPO clip and dual clip both act).

    drop_rows: rows whose response_mask is zeroed (filtered samples: attended to, never in the loss).
    """
    g = torch.Generator().manual_seed(seed)
    batch = {**batch, "response_mask": batch["response_mask"].clone()}
    batch["response_mask"][list(drop_rows)] = 0
    mask = batch["response_mask"].float()
    noise = 0.4 * torch.randn(old_log_probs.shape, generator=g)
    advantages = torch.randn(old_log_probs.shape, generator=g) * mask
    return {**batch, "old_log_probs": (old_log_probs + noise) * mask, "advantages": advantages,
            "ref_log_prob": ref_log_prob}


def actor_config(model_dir, tp: int = 1, pp: int = 1, sp: bool = False, lr: float = 1e-3, mini_batch: int = 8,
                 micro_batch: int = 2, dist_opt: bool = True, loss_agg_mode: str = "token-mean", dtype: str = "float32",
                 **optim) -> dict:
    megatron = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "sequence_parallel": sp,
                "use_distributed_optimizer": dist_opt, "seed": 7}
    return {
        "model": {"path": str(model_dir), "dtype": dtype},
        "actor": {"megatron": megatron, "optim": {"lr": lr, "clip_grad": 1.0, "weight_decay": 0.01, **optim},
                  "ppo_mini_batch_size": mini_batch, "ppo_micro_batch_size_per_gpu": micro_batch,
                  "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                  "loss_agg_mode": loss_agg_mode},
        "ref": {"megatron": megatron, "log_prob_micro_batch_size_per_gpu": 4},
        "rollout": {"n": 1, "log_prob_micro_batch_size_per_gpu": 4},
    }


def run_torchrun(script: str, nproc: int, args: list[str], timeout: int = 150) -> str:
    """Run tests/mcore_scripts/<script> as torchrun would, on `nproc` ranks forked from the preloaded launch server
    (tests/rank_launch.py); raises with the output tail when it fails.

    The rendezvous port is probed free and then bound by rank 0 a moment later; another process can take it
    in between (seen with several suites on one machine). Only that failure, EADDRINUSE at the rendezvous, is
    retried on a fresh port; any other failure raises at once."""
    from rank_launch import torchrun

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    for attempt in range(3):
        proc = torchrun(SCRIPTS / script, nproc, args, env=env, cwd=REPO, timeout=timeout)
        if proc.returncode == 0:
            return proc.stdout
        out = proc.stdout + proc.stderr
        if "EADDRINUSE" not in out or "server socket has failed to listen" not in out or attempt == 2:
            break
    lines = [ln for ln in out.splitlines() if "Warning" not in ln and "warn" not in ln]
    raise RuntimeError(f"{script} x{nproc} failed (rc={proc.returncode}):\n" + "\n".join(lines)[-6000:])


def hf_state(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def hf_ppo_update(model_dir, result: dict, lr=1e-3, clip=1.0, wd=0.01, entropy_coeff=0.01, kl_coef=0.1,
                  loss_agg_mode="token-mean", drop_rows: tuple[int, ...] = ()):
    """The same update in plain PyTorch on the whole batch at once: HF forward, full-vocab log-softmax,
    AdamW (no decay on 1-D params); the loss aggregated by agg_loss(loss_agg_mode) over all rows."""
    from transformers import AutoModelForCausalLM

    from hybridflow.algorithms import agg_loss, compute_policy_loss, kl_penalty

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_rl_batch(model.config.vocab_size)
    r = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    log_prob = logp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0][:, -r:]
    entropy = -(logp.exp() * logp).sum(-1)[:, -r:]
    data = ppo_inputs(batch, result["old_log_probs"], result["ref_log_prob"], drop_rows=drop_rows)
    mask, mode = data["response_mask"], loss_agg_mode
    pg = compute_policy_loss(data["old_log_probs"], log_prob, data["advantages"], mask, clip_ratio_low=0.2,
                             clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode=mode)
    kl = agg_loss(kl_penalty(log_prob, data["ref_log_prob"], "low_var_kl"), mask, mode)
    loss = pg["pg_loss"] - entropy_coeff * agg_loss(entropy, mask, mode) + kl_coef * kl
    loss.backward()
    params = list(model.parameters())
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
    scale = clip / (grad_norm + 1e-6)  # megatron's clip_grad_by_total_norm_fp32
    if scale < 1:
        for p in params:
            p.grad.mul_(scale)
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": wd},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8).step()
    return {"log_prob": log_prob.detach(), "entropy": entropy.detach(), "mask": batch["response_mask"],
            "loss_mask": mask, "grad_norm": grad_norm,
            "pg_loss": pg["pg_loss"].item(), "params": {k: v.detach() for k, v in model.state_dict().items()}}
