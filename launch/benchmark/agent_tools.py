"""`python -m launch.benchmark --ablation agent_tools`: does tool latency overlap generation?

64 trajectories, each: an assistant turn, one call of a tool that sleeps 50 ms (in the sandbox, a child
process per call, as any tool), then a second assistant turn. They run through the real rollout server (Ray,
the Megatron actor's vLLM engines, serve ticks) three ways, in one process, one after the other:
  - concurrent: every trajectory in flight at once (rollout.agent.max_concurrent_trajectories=64);
  - sequential: one trajectory at a time;
  - generation only: concurrent, the tool call skipped: the bound that overlap can reach.
Each trajectory's turns are seeded, so the three runs sample the same tokens (up to near-ties: CPU logits are
not exactly batch-invariant; `same_tokens_frac` says how many agree, and the benchmark fails if the token counts
differ by over 5%). The last line is one JSON object with concurrent_s, sequential_s, concurrent_vs_sequential,
generation_only_s and the summed tool sleep.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from launch.benchmark.output import emit

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_agent_tiny_cpu.yaml"
TRAJECTORIES, SLEEP_S, TURN_TOKENS = 64, 0.05, 16
TOOL_FILE = '''import time


def wait(ms: str) -> str:
    """Sleep for `ms` milliseconds and say so (a stand-in for a tool with latency: a search, a code run).

    Args:
        ms: milliseconds to sleep.
    """
    time.sleep(int(ms) / 1000)
    return "slept " + ms
'''


def _loop_class():
    from hybridflow.agent.loop import AgentLoop
    from hybridflow.agent.tool_calls import get_format
    from hybridflow.agent.trajectory import Trajectory

    class OneToolCall(AgentLoop):
        """turn, one tool call (always, whatever the random model wrote), turn; call_tool=False skips the call."""

        def __init__(self, tokenizer, response_length, sampling, call_tool: bool):
            super().__init__(response_length, sampling)
            self.tokenizer, self.call_tool = tokenizer, call_tool

        async def run(self, sample, llm, tools):
            traj = Trajectory(prompt_ids=list(sample["prompt_ids"]))
            await self.generate_turn(llm, traj, sample, 0)
            result = f"slept {int(SLEEP_S * 1000)}"  # what the tool says: turn 2 then reads the same either way
            if self.call_tool:
                res = await tools.call("wait", {"ms": str(int(SLEEP_S * 1000))})
                traj.tool_calls += 1
                traj.tool_latencies_s.append(res.latency_s)
                if res.status != "ok":
                    raise RuntimeError(f"the benchmark's tool failed: {res.text}")
                result = res.text
            traj.add_inserted(get_format("compact").render([result], self.tokenizer, 16))
            await self.generate_turn(llm, traj, sample, 1)
            return traj

    return OneToolCall


def run(work_dir: Path) -> dict:
    from hybridflow.agent.loop import run_many
    from hybridflow.agent.tools import load_tools
    from hybridflow.config.load import load_config
    from hybridflow.data.lookup import make_lookup_rows
    from hybridflow.data.synthetic import write_parquet
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.rollout.server import RolloutServer
    from hybridflow.rollout.server_api import TurnSampling
    from hybridflow.trainer.main import trainer_session

    model = save_tiny_model(work_dir / "model", preset="tiny", arch="llama", seed=0)
    rows = make_lookup_rows(TRAJECTORIES, seed=0)
    write_parquet(rows, work_dir / "data.parquet")
    (work_dir / "tools.py").write_text(TOOL_FILE)
    cfg = load_config(str(CONFIG), [f"actor_rollout_ref.model.path={model}",
                                    f"data.train_files=[{work_dir / 'data.parquet'}]", "data.val_files=[]",
                                    "trainer.val_before_train=false", "trainer.test_freq=-1",
                                    f"trainer.default_local_dir={work_dir / 'run'}", "trainer.logger=[console]",
                                    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={work_dir / 'tools.py'}"])
    tools = load_tools(work_dir / "tools.py", timeout_s=30)
    loop_cls = _loop_class()
    result: dict = {"trajectories": TRAJECTORIES, "tool_sleep_s": SLEEP_S, "turn_tokens": TURN_TOKENS}
    with trainer_session(cfg) as trainer:
        tok = trainer.tokenizer
        samples = [{"prompt_ids": tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                                      add_special_tokens=False)["input_ids"], "seed": i, "uid": f"t{i}",
                    "route_key": f"t{i}"} for i, r in enumerate(rows)]
        sampling = TurnSampling(max_tokens=TURN_TOKENS)
        server = RolloutServer(trainer.actor_rollout, trainer.actor_rollout.world_size)

        async def timed(call_tool: bool, concurrency: int):
            loop = loop_cls(tok, 64, sampling, call_tool)
            async with server.running(weight_version=0):
                t = time.perf_counter()
                trajs = await run_many(loop, samples, server, tools, concurrency=concurrency)
                return time.perf_counter() - t, trajs, dict(server.stats)

        asyncio.run(timed(True, TRAJECTORIES))  # warm-up: engine graphs, the sandbox's first interpreters
        runs = {}
        for name, call_tool, conc in (("concurrent", True, TRAJECTORIES), ("sequential", True, 1),
                                      ("generation_only", False, TRAJECTORIES)):
            seconds, trajs, stats = asyncio.run(timed(call_tool, conc))
            runs[name] = trajs
            result[f"{name}_s"] = seconds
            result[f"{name}_ticks"] = stats["ticks"]
        model_ids = {name: [[t for t, m in zip(tr.response_ids, tr.response_mask) if m] for tr in trajs]
                     for name, trajs in runs.items()}
        tokens = {name: sum(len(x) for x in ids) for name, ids in model_ids.items()}
        result.update({f"{name}_model_tokens": n for name, n in tokens.items()})
        # Per-request seeds make the draws independent of what else is in flight; the logits are not exactly
        # batch-invariant on CPU, so a rare near-tie may still flip a token: count how many trajectories agree.
        result["same_tokens_frac"] = sum(a == b for a, b in zip(model_ids["concurrent"], model_ids["sequential"])
                                         ) / TRAJECTORIES
        if max(tokens.values()) > 1.05 * min(tokens.values()):
            raise RuntimeError(f"the three runs sampled different amounts of work ({tokens}); their times would "
                               "not compare")
        result["tool_latency_s_mean"] = sum(x for tr in runs["concurrent"] for x in tr.tool_latencies_s) / TRAJECTORIES
    result["concurrent_vs_sequential"] = result["sequential_s"] / result["concurrent_s"]
    result["concurrent_vs_generation_only"] = result["concurrent_s"] / result["generation_only_s"]
    result["tool_sleep_total_s"] = TRAJECTORIES * SLEEP_S
    return result


def main(out: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="agent_tools_") as d:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        result = run(Path(d))
    r = result
    summary = (f"64 trajectories, one {SLEEP_S * 1000:.0f} ms tool call each: concurrent {r['concurrent_s']:.2f} s, "
               f"sequential {r['sequential_s']:.2f} s ({r['concurrent_vs_sequential']:.1f}x), generation only "
               f"{r['generation_only_s']:.2f} s; the sleeps alone sum to {r['tool_sleep_total_s']:.1f} s")
    return emit(summary, result, out)
