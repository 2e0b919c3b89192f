"""Agent loops: multi-turn rollouts over the rollout server, token in, token out.

An `AgentLoop` turns one sample (at least `prompt_ids`, plus anything else: `seed`, `uid`, ground truth)
into a `Trajectory` by calling `LLMClient.generate` (hybridflow/rollout/server_api.py) as many times as it
likes. It only ever sends token ids and appends the ids the engine returned, so nothing is re-tokenised.
`AgentLoop.generate_turn` does one assistant turn the standard way: the prompt is prompt_ids + the response
so far, max_tokens = min(sampling.max_tokens, response budget left), a seed derived from (sample seed, turn
index) so a run is reproducible whatever else is in flight, and a timeout on the request.

`ToolAgentLoop` is the default tool-using loop; `SingleTurnAgentLoop` is one plain generate (server mode
without multi_turn). A step-based environment is a small subclass (docs/agent_loop.md has it as a
runnable example, tested by tests/test_agent_loop.py)::

    class GuessNumber(AgentLoop):
        # The model guesses; the environment answers higher/lower; reward 1 for the right number.
        def __init__(self, tokenizer, response_length, sampling, max_turns=4):
            super().__init__(response_length, sampling)
            self.tokenizer, self.max_turns = tokenizer, max_turns

        async def run(self, sample, llm, tools):
            traj = Trajectory(prompt_ids=list(sample["prompt_ids"]), reward=0.0)
            target = str(sample["ground_truth"])
            for turn in range(self.max_turns):
                out = await self.generate_turn(llm, traj, sample, turn)
                if out is None:  # the response budget is spent
                    break
                guess = self.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
                if guess == target:
                    traj.reward, traj.stop_reason = 1.0, "done"
                    break
                hint = "higher" if guess.isdigit() and int(guess) < int(target) else "lower"
                traj.add_inserted(self.tokenizer.encode(f"<|user|>{hint}</s><|assistant|>",
                                                        add_special_tokens=False))
            return traj
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from hybridflow.agent.tool_calls import SIDES, ToolCall, get_format
from hybridflow.agent.tools import ToolSet
from hybridflow.agent.trajectory import Trajectory
from hybridflow.rollout.server_api import LLMClient, TokenOutput, TurnSampling


def stable_seed(*parts: int) -> int:
    """The one way a seed is derived from integers (a trajectory's, a request's): a hash that is the same in every
    process and Python version (unlike hash() of a str), in [0, 2**31)."""
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of one request: from (sample seed, turn index)."""
    return stable_seed(sample_seed, turn)


class AgentLoop(abc.ABC):
    """Runs one trajectory. Subclasses implement `run`; `generate_turn` is the standard assistant turn."""

    def __init__(self, response_length: int, sampling: TurnSampling, request_timeout_s: float = 900.0):
        if response_length < 1:
            raise ValueError(f"agent loop: response_length={response_length} must be >= 1 (rollout.response_length)")
        if sampling.max_tokens < 1:
            raise ValueError(f"agent loop: sampling.max_tokens={sampling.max_tokens} must be >= 1 "
                             "(multi_turn.max_tokens_per_turn)")
        self.response_length, self.sampling, self.request_timeout_s = response_length, sampling, request_timeout_s

    @abc.abstractmethod
    async def run(self, sample: dict, llm: LLMClient, tools: ToolSet) -> Trajectory: ...

    async def generate_turn(self, llm: LLMClient, traj: Trajectory, sample: dict, turn: int) -> TokenOutput | None:
        """One assistant turn appended to `traj` (mask 1); None, with traj marked truncated, when no budget is left.

        A turn cut by max_tokens sets traj.truncated; an aborted request sets stop_reason "abort".
        """
        left = self.response_length - len(traj.response_ids)
        if left <= 0:
            traj.truncated, traj.stop_reason = True, "budget"
            return None
        max_tokens = min(self.sampling.max_tokens, left)
        sampling = replace(self.sampling, max_tokens=max_tokens, seed=turn_seed(sample_seed(sample), turn))
        try:
            out = await asyncio.wait_for(llm.generate(traj.prompt_ids + traj.response_ids, sampling,
                                                      route_key(sample)), timeout=self.request_timeout_s)
        except TimeoutError as e:
            if str(e):  # the client's own, already explained
                raise
            raise TimeoutError(f"agent loop: turn {turn} of sample {route_key(sample)!r} got no tokens in "
                               f"{self.request_timeout_s:g} s (rollout.agent.request_timeout_s)") from None
        ids = list(out.token_ids)[:max_tokens]  # an engine that overshoots must not break the budget
        log_probs = None if out.log_probs is None else list(out.log_probs)[: len(ids)]
        versions = getattr(out, "token_versions", None)  # a client of the LLMClient protocol may not know of them
        traj.add_model_turn(ids, log_probs, out.finish_reason, out.weight_version,
                            min(versions[: len(ids)]) if versions else None)
        if out.finish_reason == "abort":
            traj.stop_reason = "abort"
        elif out.finish_reason == "length" or len(ids) >= max_tokens and out.finish_reason != "stop":
            traj.truncated = True
            traj.stop_reason = "budget" if max_tokens == left else "turn_length"
        return TokenOutput(ids, log_probs, out.finish_reason, out.weight_version,
                           list(versions[: len(ids)]) if versions else None)


def sample_seed(sample: dict) -> int:
    return int(sample.get("seed", 0))


def route_key(sample: dict) -> str:
    return str(sample.get("route_key", sample.get("uid", f"seed-{sample_seed(sample)}")))


class SingleTurnAgentLoop(AgentLoop):
    """One generate, no tools: server mode's plain single-turn rollout."""

    async def run(self, sample: dict, llm: LLMClient, tools: ToolSet) -> Trajectory:
        traj = Trajectory(prompt_ids=list(sample["prompt_ids"]))
        await self.generate_turn(llm, traj, sample, 0)
        traj.stop_reason = traj.stop_reason or "no_tool_call"
        return traj


class ToolAgentLoop(AgentLoop):
    """Generate a turn, run the tool calls found in its text in the sandbox, append the results (mask 0), repeat.

    Stops at a turn without a tool call, after max_assistant_turns turns (the last turn's calls are not run),
    when the response budget (response_length tokens, tool tokens included) is spent (the response is cut
    there and marked truncated), when a turn hits its max_tokens without a call, or on an aborted request.
    Of one turn's calls the first max_parallel_calls run, concurrently; the others get an error observation.
    """

    def __init__(self, tokenizer, format: str = "hermes", *, response_length: int, sampling: TurnSampling,
                 max_assistant_turns: int | None = None, max_parallel_calls: int = 1,
                 max_tool_response_length: int = 256, tool_response_truncate_side: str = "middle",
                 request_timeout_s: float = 900.0, tools_timeout_s: float = 600.0, template=None):
        super().__init__(response_length, sampling, request_timeout_s)
        self.tokenizer, self.format = tokenizer, get_format(format, template)
        if max_assistant_turns is not None and max_assistant_turns < 1:
            raise ValueError(f"multi_turn.max_assistant_turns={max_assistant_turns} must be >= 1 (or null)")
        if max_parallel_calls < 1:
            raise ValueError(f"multi_turn.max_parallel_calls={max_parallel_calls} must be >= 1")
        if max_tool_response_length < 0:
            raise ValueError(f"multi_turn.max_tool_response_length={max_tool_response_length} must be >= 0")
        if tool_response_truncate_side not in SIDES:
            raise ValueError(f"multi_turn.tool_response_truncate_side={tool_response_truncate_side!r}: "
                             f"expected one of {SIDES}")
        self.max_assistant_turns, self.max_parallel_calls = max_assistant_turns, max_parallel_calls
        self.max_tool_response_length, self.side = max_tool_response_length, tool_response_truncate_side
        self.tools_timeout_s = tools_timeout_s

    async def run(self, sample: dict, llm: LLMClient, tools: ToolSet) -> Trajectory:
        traj = Trajectory(prompt_ids=list(sample["prompt_ids"]))
        turn = 0
        while True:
            out = await self.generate_turn(llm, traj, sample, turn)
            turn += 1
            if out is None or traj.stop_reason in ("abort", "budget"):
                return traj
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=False)
            calls = self.format.parse(text, tools.specs)
            if not calls:
                traj.stop_reason = traj.stop_reason or "no_tool_call"
                return traj
            traj.truncated, traj.stop_reason = False, ""  # a turn cut at max_tokens that still holds a call
            if self.max_assistant_turns is not None and turn >= self.max_assistant_turns:
                traj.stop_reason = "max_assistant_turns"
                return traj
            results = await self._run_calls(calls, tools, traj)
            ids = self.format.render(results, self.tokenizer, self.max_tool_response_length, self.side)
            left = self.response_length - len(traj.response_ids)
            traj.add_inserted(ids[:left])
            if len(ids) >= left:
                traj.truncated, traj.stop_reason = True, "budget"
                return traj

    async def _run_calls(self, calls: list[ToolCall], tools: ToolSet, traj: Trajectory) -> list[str]:
        record = traj.turns[-1].calls
        texts: list[str | None] = [None] * len(calls)
        jobs = []
        for i, call in enumerate(calls):
            traj.tool_calls += 1
            if call.error is not None:
                texts[i] = f"error: {call.error}"
                traj.tool_errors += 1
                traj.tool_parse_errors += 1
                record.append({"name": call.name, "status": "parse_error", "latency_s": 0.0})
            elif len(jobs) >= self.max_parallel_calls:
                texts[i] = (f"error: skipped: more than multi_turn.max_parallel_calls={self.max_parallel_calls} "
                            "calls in one turn")
                record.append({"name": call.name, "status": "skipped", "latency_s": 0.0})
            else:
                jobs.append((i, call))
        try:
            results = await asyncio.wait_for(asyncio.gather(*(tools.call(c.name, c.arguments) for _, c in jobs)),
                                             timeout=self.tools_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"agent loop: a turn's {len(jobs)} tool call(s) took over {self.tools_timeout_s:g} "
                               "s (each call has its own multi_turn.tool_timeout_s; this is the loop's backstop)"
                               ) from None
        for (i, call), res in zip(jobs, results):
            texts[i] = res.text
            traj.tool_latencies_s.append(res.latency_s)
            traj.tool_errors += res.status != "ok"
            traj.tool_timeouts += res.status == "timeout"
            record.append({"name": call.name, "status": res.status, "latency_s": res.latency_s})
        return [t for t in texts if t is not None]


async def run_many(loop: AgentLoop, samples: Sequence[dict], llm: LLMClient, tools: ToolSet | None = None,
                   concurrency: int = 1024, seed: int = 0, timeout_s: float = 3600.0, *,
                   slots: asyncio.Semaphore | None = None, admit: Callable[[int], Awaitable[None]] | None = None,
                   group_size: int = 1, sample_again_on: tuple[type[BaseException], ...] = (),
                   on_sample_again: Callable[[], None] | None = None) -> list[Trajectory]:
    """Runs every sample (at most `concurrency` at once), in order: the one way trajectories run, in every mode. A
    sample without `seed` gets one derived from (seed, its index), without `uid` the uid `traj-<index>`. One that
    fails or runs past timeout_s cancels the rest and raises, naming the sample.

    fully_async's producer (hybridflow/trainer/async_producer.py) runs its batches through here too, with:
    `slots`, a semaphore shared by all its batches in place of one of `concurrency`; `admit(g)`, awaited once before
    any sample of group g (`group_size` consecutive samples: a prompt's n) starts; `sample_again_on`, the errors after
    which a sample runs again from its prompt (an interrupted request without partial_rollout), each one counted by
    calling `on_sample_again()`.
    """
    if concurrency < 1:
        raise ValueError(f"run_many: concurrency={concurrency} must be >= 1 "
                         "(rollout.agent.max_concurrent_trajectories)")
    tools = tools if tools is not None else ToolSet()
    slots = slots if slots is not None else asyncio.Semaphore(concurrency)
    gates: dict[int, asyncio.Future] = {}

    async def admitted(group: int) -> None:
        if admit is None:
            return
        if group not in gates:
            gates[group] = asyncio.ensure_future(admit(group))
        await asyncio.shield(gates[group])  # one wait per group, however many of its samples are waiting

    async def one(i: int, sample: dict) -> Trajectory:
        sample = {"seed": turn_seed(seed, i), "uid": f"traj-{i}", **sample}
        await admitted(i // group_size)
        while True:
            async with slots:
                try:
                    return await asyncio.wait_for(loop.run(sample, llm, tools), timeout=timeout_s)
                except sample_again_on:
                    if on_sample_again is not None:
                        on_sample_again()
                except TimeoutError as e:
                    if str(e):  # a request's or the tools' own timeout, already explained
                        raise
                    raise TimeoutError(f"run_many: sample {i} (uid {sample['uid']!r}) ran past {timeout_s:g} s "
                                       "(the trajectory timeout)") from None

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, s)) for i, s in enumerate(samples)]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from eg
    finally:
        for gate in gates.values():
            gate.cancel()
    return [t.result() for t in tasks]


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """tool/* and num_turns/* over a batch: counts are totals, calls_per_trajectory and latency_s means."""
    if not trajectories:
        return {}
    latencies = [x for t in trajectories for x in t.tool_latencies_s]
    turns = [t.num_turns for t in trajectories]
    return {
        "tool/num_errors": float(sum(t.tool_errors for t in trajectories)),
        "tool/num_timeouts": float(sum(t.tool_timeouts for t in trajectories)),
        "tool/num_parse_errors": float(sum(t.tool_parse_errors for t in trajectories)),
        "tool/calls_per_trajectory": sum(t.tool_calls for t in trajectories) / len(trajectories),
        "tool/latency_s": statistics.fmean(latencies) if latencies else 0.0,
        "tool/latency_s_max": max(latencies, default=0.0),
        "num_turns/mean": statistics.fmean(turns),
        "num_turns/max": float(max(turns)),
        "num_turns/min": float(min(turns)),
        "response/truncated_frac": sum(t.truncated for t in trajectories) / len(trajectories),
    }
