"""Multi-turn agent rollouts end to end: real Ray, a Megatron TP=2 actor, vLLM engines behind the rollout server,
the lookup tool in its sandbox, GRPO over 2 steps, fp32.

The model is the agent demo's warm-start cut short (150 supervised steps, ~10 s): it calls the tool on about
half the prompts, usually with a wrong key, which is all the mechanics need (the demo's learning is measured by
`make demo-agent`, docs/agent_loop.md). Checked against references built here, not by our loop:
- token in, token out: every tool turn of every trajectory is exactly the compact format's tool turn for the
  value the tool gives the key the assistant wrote (`<|user|>VALUE</s><|assistant|>`, tokenised here), and it
  follows an assistant turn that ends in eos and holds `@lookup(KEY)`;
- the trainer's log-probs of the model tokens equal the engine's within 1e-5 (fp32), over model tokens only;
- the tool metrics are in every training row, and validation's tool-call rate is its transcripts' share of
  trajectories with a tool turn.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from test_e2e_trainer import _cmd, _rows, _run

from hybridflow.rewards.lookup import secret

LOGPROB_DIFF_MEAN, LOGPROB_DIFF_MAX = 1e-5, 1e-4


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    from hybridflow.trainer.warmstart_agent import prepare

    root = tmp_path_factory.mktemp("agent")
    assets = prepare(root / "assets", sft_steps=150, train_size=256, test_size=16)
    _run(_cmd("grpo_agent_tiny_cpu.yaml", root / "run", f"actor_rollout_ref.model.path={assets['model']}",
              f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['test']}]",
              "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
              "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=true",
              "actor_rollout_ref.model.dtype=float32", "actor_rollout_ref.recompute_old_log_prob=true",
              f"trainer.rollout_data_dir={root / 'rollouts'}", f"trainer.validation_data_dir={root / 'val'}"),
         root / "log")
    return root, assets


@pytest.mark.slow
def test_agent_trajectories_are_the_sampled_tokens_plus_the_tools_tokens(agent_run):
    from transformers import AutoTokenizer

    root, assets = agent_run
    tok = AutoTokenizer.from_pretrained(assets["model"])
    eos = tok.eos_token_id
    records = [json.loads(x) for step in (1, 2) for x in (root / "rollouts" / f"step_{step}.jsonl").read_text()
               .splitlines()]
    assert len(records) == 2 * 8 * 4
    rollout = yaml.safe_load((root / "run" / "config.yaml").read_text())["actor_rollout_ref"]["rollout"]
    budget = rollout["response_length"]  # the whole trajectory's: model turns and tool tokens
    turn_cap = rollout["multi_turn"]["max_tokens_per_turn"]
    tool_turns = 0
    for rec in records:
        turns = rec["turns"]
        assert turns[0]["role"] == "assistant" and rec["num_turns"] == sum(t["role"] == "assistant" for t in turns)
        for k, t in enumerate(turns):
            if t["role"] != "tool":
                continue
            tool_turns += 1
            call = turns[k - 1]
            # the call's turn ended at EOS, or was cut at max_tokens_per_turn and still held a call (the loop runs
            # it: ToolAgentLoop.run; seen on a CPU without bf16, where auto picks fp32 and the samples differ)
            assert call["role"] == "assistant" and (call["ids"][-1] == eos or len(call["ids"]) == turn_cap), rec
            found = re.search(r"@lookup\(([^)\n]*)\)", call["text"])
            key = found.group(1).strip() if found else ""
            value = secret(key) if key.isalpha() and key.islower() else None  # the tool's own rule
            # the last turn of a trajectory that reached the response budget is cut there (mask still 0)
            cut = k == len(turns) - 1 and sum(len(x["ids"]) for x in turns) == budget
            if value is not None:
                want = tok.encode(f"<|user|>{value}</s><|assistant|>", add_special_tokens=False)
                assert t["ids"] == (want[: len(t["ids"])] if cut else want), (rec["prompt"], call["text"], t["text"])
            else:  # a malformed call or a key the tool refuses: an error observation, still a tool turn of mask 0
                assert t["text"].startswith("<|user|>error: "), t
                assert cut or t["text"].endswith("</s><|assistant|>"), t
        # the model tokens the trainer scores are the assistant turns, in order
        assert rec["response_ids"] == [i for t in turns if t["role"] == "assistant" for i in t["ids"]]
    assert tool_turns >= 8, f"only {tool_turns} tool turns in 64 trajectories: the warm-start should call the tool"


@pytest.mark.slow
def test_agent_run_trains_on_the_engines_log_probs_and_reports_tool_metrics(agent_run):
    root, _ = agent_run
    rows = _rows(root / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # the val tool-call rate is the share of val trajectories with a tool turn in their transcript
    val = [json.loads(x) for x in (root / "val" / "step_0.jsonl").read_text().splitlines()]
    called = [any(t["role"] == "tool" for t in v["turns"]) for v in val]
    assert len(val) == 16 and rows[0]["val-aux/tool/call_rate"] == pytest.approx(sum(called) / len(called))
    for r in rows[1:]:
        # over model tokens only: tool tokens have no rollout log-prob, and a mask hole must not count
        assert r["rollout/logprob_diff_mean"] < LOGPROB_DIFF_MEAN, r["rollout/logprob_diff_mean"]
        assert r["rollout/logprob_diff_max"] < LOGPROB_DIFF_MAX, r["rollout/logprob_diff_max"]
        for key in ("tool/calls_per_trajectory", "tool/num_errors", "tool/num_timeouts", "tool/latency_s",
                    "num_turns/mean", "num_turns/max"):
            assert key in r, key
        assert r["num_turns/max"] >= 2 and r["tool/calls_per_trajectory"] > 0
        assert r["tool/num_timeouts"] == 0
