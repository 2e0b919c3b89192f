"""Published steps split into their stages, set beside the planned stages: where a step's error sits.

NeMo-RL's v0.3 release blog ("NeMo-RL V0.3: Scalable and Performant Post-training with Nemo-RL via Megatron-Core",
2025-07-21; github NVIDIA-NeMo/RL discussion #1161) publishes, for four Megatron-backend GRPO runs on H100 nodes,
the total step and its four timed stages (averaged over steps 22-29): policy training, refit, generation and get
logprobs. Its settings: max sequence 4096, rollout batch 2048 (64 prompts x 32), global batch 512, sequence packing.
Each row is planned like the performance-summary rows (nemo_setting.nemo_overrides, the same ASSUMED prompt mean and
offload) with the layout the blog and the v0.3.0 example configs give.

Which planned stages a published stage holds, from NeMo-RL's timers at v0.3.0 (nemo_rl/algorithms/grpo.py):
"policy_training" is the update; "policy_and_reference_logprobs" the two forward passes; "prepare_for_generation"
(refit) moves the training state off the GPU, wakes vLLM and copies the new weights in; "generation" runs the
rollout, the math environment's reward inside it, and vLLM's sleep after. Our transition plus the offload traffic
stand for refit: the offload stage also holds the reload before training, which NeMo-RL times apart
("training_prep", outside the four columns).
Pure: plans only, no I/O.
"""

from __future__ import annotations

from launch.plan import Plan
from launch.plan.nemo_setting import nemo_options, nemo_overrides, plan_overrides

BLOG = "NeMo-RL v0.3 blog (2025-07-21): steps 22-29 averaged, max sequence 4096, 2048 rollouts, GBS 512, packing"

# published stage -> the planned stages it holds
STAGES = {"policy training": ("update_actor",), "get logprobs": ("old_log_prob", "ref"),
          "refit": ("transition", "offload"), "generation": ("generate",)}

# (case, model, nodes, t, p, ep, etp, t_g, vLLM memory fraction, mean generated tokens, total step s,
#  {published stage: s}, setting)
# Layouts: the blog's ("Llama 3.1-8B was run with only data parallel, Llama 3.1-70B ... 4-way tensor and 4-way
# pipeline parallel, Qwen3 32B ... 4-way tensor and 2-way pipeline parallel, and Qwen3 30B-A3B ... 8-way expert and
# 2-way tensor parallel"). vLLM and micro-batches from the example configs at v0.3.0: grpo_math_8B_megatron.yaml
# (vLLM TP1 at 0.6), grpo_math_70B_megatron.yaml (TP4 at 0.6), grpo_math_qwen30ba3b_megatron.yaml (TP4 at 0.7,
# expert TP 1, sequence parallel); train micro-batch 1, logprob batch 4, no activation checkpointing in all.
# Qwen3-32B has no v0.3.0 config: its vLLM TP4 at 0.6 is ASSUMED from the later performance recipes.
# Llama-3.1-70B has Llama 3 70B's shape (launch/plan/shapes.py ALIASES).
ROWS = [
    ("Llama-3.1-8B GRPO, 8 H100 (v0.3 blog)", "Llama-3.1-8B-Instruct", 1, 1, 1, 1, None, 1, 0.6, 795, 112.0,
     {"policy training": 28.0, "refit": 5.0, "generation": 58.0, "get logprobs": 18.0}, "train DP8, vLLM TP1"),
    ("Llama-3.1-70B GRPO, 64 H100 (v0.3 blog)", "Llama-3.1-70B", 8, 4, 4, 1, None, 4, 0.6, 398, 147.0,
     {"policy training": 28.0, "refit": 14.0, "generation": 84.0, "get logprobs": 18.0}, "train TP4 PP4, vLLM TP4"),
    ("Qwen3-32B GRPO, 64 H100 (v0.3 blog)", "Qwen3-32B", 8, 4, 2, 1, None, 4, 0.6, 3283, 213.0,
     {"policy training": 68.0, "refit": 7.0, "generation": 96.0, "get logprobs": 40.0},
     "train TP4 PP2, vLLM TP4 (ASSUMED)"),
    ("Qwen3-30B-A3B GRPO, 64 H100 (v0.3 blog)", "Qwen3-30B-A3B", 8, 2, 1, 8, 1, 4, 0.7, 3251, 167.0,
     {"policy training": 50.0, "refit": 12.0, "generation": 78.0, "get logprobs": 23.0},
     "train TP2 EP8 (expert TP1), vLLM TP4"),
]


def plan_row(row: tuple) -> Plan:
    _, model, nodes, t, p, ep, etp, t_g, mem, mean, *_ = row
    overrides = nemo_overrides(model, nodes, t, p, t_g, logprob_micro=4, ep=ep, gpu_memory_utilization=mem, etp=etp)
    return plan_overrides(overrides, nemo_options(mean, activation_checkpointing=False))


def planned_stages(plan: Plan) -> dict[str, float]:
    """The plan's seconds gathered into the published stages (STAGES)."""
    by_name = {s.name: s.seconds for s in plan.stages}
    return {stage: sum(by_name.get(n, 0.0) for n in ours) for stage, ours in STAGES.items()}


def breakdowns() -> list[dict]:
    """Each row: its plan's total and stages beside the published ones, and their ratios (planned / published)."""
    out = []
    for row in ROWS:
        name, published_stages, total = row[0], row[11], row[10]
        plan = plan_row(row)
        planned = planned_stages(plan)
        out.append({"case": name, "predicted": plan.step_s, "published": total, "setting": row[12],
                    "mean_generated": row[9],
                    "stages": [{"stage": s, "planned_s": planned[s], "published_s": published_stages[s],
                                "ratio": planned[s] / published_stages[s]} for s in STAGES]})
    return out
