"""The parameters one token's forward touches: the N of the 2·N·tokens FLOP count. Pure (no torch).

One count for both sides: the trainer's perf/mfu/actor (hybridflow/trainer/main.py count_active_params) and the
planner (launch/plan/memory.py active_params). An MoE layer runs each token through top-k of its E routed experts,
so the count is every parameter less (E − k) routed experts per layer; the router, the shared expert and the rest
count in full. Every layer is sparse in the MoE models mapped here (megatron_workers/model_builder.py _moe_facts).
"""

from __future__ import annotations


def routed_expert_params(hidden_size: int, expert_ffn: int) -> int:
    """One routed expert's SwiGLU matrices: [gate; up] (2F x h) and down (h x F)."""
    return 3 * expert_ffn * hidden_size


def idle_expert_params(num_layers: int, num_experts: int, moe_topk: int, hidden_size: int, expert_ffn: int) -> int:
    """The routed-expert parameters a token's forward leaves out: E − k experts in each layer (0 for a dense model)."""
    if num_experts <= 0:
        return 0
    if not 1 <= moe_topk <= num_experts:
        raise ValueError(f"moe_topk={moe_topk} must be in [1, num_experts={num_experts}]")
    return num_layers * (num_experts - moe_topk) * routed_expert_params(hidden_size, expert_ffn)


def active_params(total: int, num_layers: int, num_experts: int = 0, moe_topk: int = 0, hidden_size: int = 0,
                  expert_ffn: int = 0) -> int:
    """`total` parameters (every expert counted) less those a token's forward leaves out."""
    return total - idle_expert_params(num_layers, num_experts, moe_topk, hidden_size, expert_ffn)
