"""Checks of server mode and multi-turn keys (actor_rollout_ref.rollout.mode / multi_turn / agent), run by
preflight before Ray starts; each error names its key (or the tool file)."""

from __future__ import annotations

from hybridflow.algorithms.choices import require_choice

MODES = ("sync", "async")
FORMATS = ("hermes", "compact")
TRUNCATE_SIDES = ("left", "middle", "right")
P = "actor_rollout_ref.rollout"


def turn_budget(rollout) -> int:
    """Tokens one assistant turn may sample: multi_turn.max_tokens_per_turn, or the whole response budget."""
    return rollout.multi_turn.max_tokens_per_turn or rollout.response_length


def validate_server_mode(rollout) -> None:
    """`rollout`: actor_rollout_ref.rollout. Any layout serves: one replica or several, each of any t_g (vLLM's
    data-parallel replicas step in lockstep; VLLMRollout.serve_tick, tests/test_server_mode_dp.py)."""
    require_choice(f"{P}.mode", rollout.mode, MODES)
    mt, ag = rollout.multi_turn, rollout.agent
    if mt.enable and rollout.mode != "async":
        raise ValueError(f"{P}.multi_turn.enable=true needs the server mode: set {P}.mode=async "
                         f"(got mode={rollout.mode!r})")
    if rollout.mode != "async":
        return
    if rollout.name != "vllm":
        raise ValueError(f"{P}.mode=async serves from vLLM's engine loop; {P}.name={rollout.name!r} has none "
                         f"(set {P}.name=vllm)")
    for key, value, ok, want in (
            ("agent.max_concurrent_trajectories", ag.max_concurrent_trajectories,
             ag.max_concurrent_trajectories >= 1, ">= 1"),
            ("agent.max_steps_per_tick", ag.max_steps_per_tick, ag.max_steps_per_tick >= 1, ">= 1"),
            ("agent.request_timeout_s", ag.request_timeout_s, ag.request_timeout_s > 0, "> 0")):
        if not ok:
            raise ValueError(f"{P}.{key}={value} must be {want}")
    if not mt.enable:
        return
    if mt.max_assistant_turns is not None and mt.max_assistant_turns < 1:
        raise ValueError(f"{P}.multi_turn.max_assistant_turns={mt.max_assistant_turns} must be >= 1 (or null: "
                         "until a turn calls no tool or the response budget ends)")
    if mt.max_tokens_per_turn is not None and mt.max_tokens_per_turn < 1:
        raise ValueError(f"{P}.multi_turn.max_tokens_per_turn={mt.max_tokens_per_turn} must be >= 1")
    if rollout.response_length < turn_budget(rollout):
        raise ValueError(f"{P}.response_length={rollout.response_length} (the whole trajectory's budget, tool "
                         f"tokens included) is smaller than one turn ({P}.multi_turn.max_tokens_per_turn="
                         f"{mt.max_tokens_per_turn})")
    require_choice(f"{P}.multi_turn.format", mt.format, FORMATS)
    require_choice(f"{P}.multi_turn.tool_response_truncate_side", mt.tool_response_truncate_side, TRUNCATE_SIDES)
    for key, value, ok, want in (
            ("max_parallel_calls", mt.max_parallel_calls, mt.max_parallel_calls >= 1, ">= 1"),
            ("max_tool_response_length", mt.max_tool_response_length, mt.max_tool_response_length >= 1, ">= 1"),
            ("tool_timeout_s", mt.tool_timeout_s, mt.tool_timeout_s > 0, "> 0"),
            ("tool_memory_mb", mt.tool_memory_mb, mt.tool_memory_mb >= 64, ">= 64")):
        if not ok:
            raise ValueError(f"{P}.multi_turn.{key}={value} must be {want}")
    if mt.tool_config_path:
        from hybridflow.agent.tools import load_tools

        load_tools(mt.tool_config_path)  # a file that does not import, a nameless tool, two of one name: named here
