"""The agent demo's starting point (make demo-agent): lookup-task data, a tiny model, and a noisy warm-start.

The task (hybridflow/rewards/lookup.py) cannot be solved without the tool: the answer is a hash of the key.
The warm-start is supervised on traces rendered exactly as the agent loop will produce them (token in, token
out: the compact format's `@lookup(KEY)</s>`, then the tool turn `<|user|>VALUE</s><|assistant|>` that the
loop inserts, loss-masked, then `VALUE</s>`). The traces are noisy on purpose: a share of them answers with a
guessed value and no tool call, so the policy RL starts from calls the tool only part of the time and scores
below 0.5. RL's job is to make the tool call reliable; the tool-call rate and the success climb together.

    python -m hybridflow.trainer.warmstart_agent --out runs/demo_agent_assets
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from pathlib import Path

log = logging.getLogger(__name__)

TOOL_FILE = Path(__file__).resolve().parents[2] / "configs" / "tools" / "lookup.py"
DEMO_SFT_STEPS = 800  # copying the key and the value forms between 150 (success 0) and 800 steps (every call right)
DEMO_TOOL_SHARE = 0.4  # of the warm-start traces that call the tool; the others guess
EVAL_ROWS = 64


def trace_ids(tokenizer, row: dict, use_tool: bool, rng: random.Random) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one supervised trace: prompt (mask 0), then the turns as the agent loop appends them."""
    from hybridflow.agent.tool_calls import get_format

    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)

    def model_turn(text: str) -> None:
        turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.extend(turn)
        mask.extend([1] * len(turn))

    value = row["reward_model"]["ground_truth"]
    if use_tool:
        model_turn(f"@lookup({row['extra_info']['key']})")
        inserted = get_format("compact").render([value], tokenizer, max_tool_response_length=64)
        ids.extend(inserted)
        mask.extend([0] * len(inserted))
        model_turn(value)
    else:
        model_turn(f"{rng.randrange(1000):03d}")  # a guess: right 1 time in 1000
    return ids, mask


def supervised_warmstart(model_dir: Path, rows: list[dict], out_dir: Path, steps: int, tool_share: float,
                         batch_size: int = 64, lr: float = 3e-3, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    t0, losses = time.time(), []
    from tqdm import tqdm

    for _ in tqdm(range(steps), desc="agent warm-start SFT", unit="step", mininterval=2.0):
        traces = [trace_ids(tok, rows[rng.randrange(len(rows))], rng.random() < tool_share, rng)
                  for _ in range(batch_size)]
        width = max(len(t[0]) for t in traces)
        ids = torch.full((batch_size, width), tok.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((batch_size, width))
        attn = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (t, m) in enumerate(traces):
            ids[i, : len(t)] = torch.tensor(t)
            loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
            attn[i, : len(t)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        m = loss_mask[:, 1:]
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return {"sft_steps": steps, "sft_tool_share": tool_share, "sft_final_loss": losses[-1] if losses else None,
            "sft_s": time.time() - t0}


def evaluate(model_dir: str | Path, rows: list[dict], tools_file: str | Path | None, seed: int = 0,
             response_length: int = 40, max_tokens_per_turn: int = 16) -> dict:
    """Success and tool-call rate of the policy sampled at temperature 1 through the agent loop itself (HF in
    this process, the real sandboxed tool); tools_file=None: the no-tool baseline (any call is an error)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.agent.hf_client import HFTokenClient
    from hybridflow.agent.loop import ToolAgentLoop, run_many
    from hybridflow.agent.tools import ToolSet, load_tools
    from hybridflow.rewards.lookup import compute_score
    from hybridflow.rollout.server_api import TurnSampling

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tools = load_tools(tools_file) if tools_file else ToolSet()
    loop = ToolAgentLoop(tok, "compact", response_length=response_length, max_assistant_turns=3,
                         sampling=TurnSampling(max_tokens=max_tokens_per_turn))
    samples = []
    for i, row in enumerate(rows):
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        samples.append({"prompt_ids": tok(text, add_special_tokens=False)["input_ids"], "seed": seed * 100003 + i})
    trajs = asyncio.run(run_many(loop, samples, HFTokenClient(model, tok.eos_token_id), tools, concurrency=8))
    scores, calls = [], []
    for t, row in zip(trajs, rows, strict=True):
        model_ids = [i for i, m in zip(t.response_ids, t.response_mask, strict=True) if m]
        scores.append(compute_score(tok.decode(model_ids, skip_special_tokens=True),
                                    row["reward_model"]["ground_truth"]))
        calls.append(1.0 if t.tool_calls else 0.0)
    return {"success": sum(scores) / len(scores), "tool_call_rate": sum(calls) / len(calls)}


def prepare(out: str | Path, preset: str = "tiny", arch: str = "llama", sft_steps: int = DEMO_SFT_STEPS,
            tool_share: float = DEMO_TOOL_SHARE, train_size: int = 2048, test_size: int = 128, seed: int = 0,
            force: bool = False) -> dict:
    """Create (or reuse) data/{train,test}.parquet, base_model/ and sft_model/ under `out`, and measure the
    warm-start (held out) with the tool and without it."""
    import pyarrow.parquet as pq

    from hybridflow.data.lookup import make_lookup_rows
    from hybridflow.data.synthetic import write_parquet
    from hybridflow.models.tiny import save_tiny_model

    out = Path(out)
    key = {"preset": preset, "arch": arch, "sft_steps": sft_steps, "tool_share": tool_share,
           "train_size": train_size, "test_size": test_size, "seed": seed, "version": 1}
    manifest = out / "manifest.json"
    if not force and manifest.is_file():
        cached = json.loads(manifest.read_text())
        if cached.get("key") == key:
            log.info("agent demo assets in %s are up to date", out)
            return cached
    test = make_lookup_rows(test_size, seed + 1, split="test")
    train = make_lookup_rows(train_size, seed, split="train", exclude={r["extra_info"]["key"] for r in test})
    write_parquet(train, out / "data" / "train.parquet")
    write_parquet(test, out / "data" / "test.parquet")
    base = save_tiny_model(out / "base_model", preset=preset, arch=arch, seed=seed)
    rows = pq.read_table(out / "data" / "train.parquet").to_pylist()
    info = supervised_warmstart(base, rows, out / "sft_model", sft_steps, tool_share, seed=seed)
    held_out = test[:EVAL_ROWS]
    with_tool = evaluate(out / "sft_model", held_out, TOOL_FILE)
    without = evaluate(out / "sft_model", held_out, None)
    result = {"key": key, **info, "sft_success": with_tool["success"],
              "sft_tool_call_rate": with_tool["tool_call_rate"],
              "no_tool_success": without["success"], "model": str(out / "sft_model"),
              "train": str(out / "data" / "train.parquet"), "test": str(out / "data" / "test.parquet"),
              "tools": str(TOOL_FILE)}
    manifest.write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo_agent_assets")
    ap.add_argument("--sft-steps", type=int, default=DEMO_SFT_STEPS)
    ap.add_argument("--tool-share", type=float, default=DEMO_TOOL_SHARE,
                    help="share of warm-start traces that call the tool (the rest guess)")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(2)
    info = prepare(a.out, sft_steps=a.sft_steps, tool_share=a.tool_share, force=a.force)
    print(json.dumps({k: v for k, v in info.items() if k != "key"}))


if __name__ == "__main__":
    main()
