"""The token-in, token-out contract between an agent loop and the async rollout server.

An agent loop never sees text it did not decode itself: it sends token ids and gets back the ids the engine
sampled, with their log-probs and the weight version that sampled them. The server (hybridflow/rollout/
server.py) routes each request to one generation replica, sticky per trajectory (`route_key`), so a
multi-turn trajectory keeps hitting the replica that holds its prefix in the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class TurnSampling:
    """The sampling of one request (one assistant turn). `seed` makes the request's draws its own: the same
    (seed, prompt) samples the same tokens whatever else is in flight. greedy: temperature 0."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    greedy: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class TokenOutput:
    """What the engine sampled for one request."""

    token_ids: list[int]
    log_probs: list[float] | None  # one per token; None when the rollout computes none
    finish_reason: str  # "stop": an end-of-sequence / stop token ends it (and is in token_ids); "length"; "abort"
    weight_version: int = 0  # the version of the weights that sampled these tokens (the last of them)
    # one per token where they differ: a request interrupted by a weight update and continued (partial rollout)
    token_versions: list[int] | None = None

    @property
    def min_weight_version(self) -> int:
        return min(self.token_versions) if self.token_versions else self.weight_version


class RequestInterrupted(RuntimeError):
    """A weight update interrupted this request and partial rollouts are off: its tokens are dropped (a sample
    never mixes versions silently); the caller decides whether to sample it again with the new weights."""


class LLMClient(Protocol):
    """What `AgentLoop.run` calls. `route_key` pins a trajectory to one replica (its prefix cache)."""

    async def generate(self, prompt_ids: list[int], sampling: TurnSampling, route_key: str) -> TokenOutput: ...
