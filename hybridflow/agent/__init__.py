"""Multi-turn, tool-using rollouts: agent loops, tool-call formats, the tool registry and its sandbox.

docs/agent_loop.md. Names are imported lazily, so the sandbox child (tool_child.py, run as a script) and the
tool registry never pull torch in.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AgentLoop": "loop", "ToolAgentLoop": "loop", "SingleTurnAgentLoop": "loop", "run_many": "loop",
    "agent_metrics": "loop", "turn_seed": "loop",
    "Trajectory": "trajectory", "TurnRecord": "trajectory", "to_batch": "trajectory",
    "ToolCall": "tool_calls", "ToolCallFormat": "tool_calls", "RenderTemplate": "tool_calls",
    "get_format": "tool_calls",
    "ToolSet": "tools", "ToolSpec": "tools", "ToolConfigError": "tools", "load_tools": "tools",
    "ToolSandbox": "tool_sandbox", "ToolResult": "tool_sandbox",
    "HFTokenClient": "hf_client",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridflow.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridflow.agent.{_EXPORTS[name]}"), name)
