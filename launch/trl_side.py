"""TRL's GRPOTrainer on the bench's model and prompts, timed per optimizer step; run by launch/bench_vs_trl.py.

Runs inside runs/bench_trl_venv (TRL is not in the project venv); the only project import is the
reward function, through PYTHONPATH. Writes --out as JSON: {"steps": [{"step_s", "tokens", "gen_s",
"timing"}], "setup": {...}} where tokens = prompt tokens (attention mask, no padding) + completion
tokens actually generated, as our trainer counts perf/total_num_tokens.

Step time is wall time between consecutive optimizer-step ends (the first from train start), so
it covers generation, reward, reference log-probs, the update and TRL's own bookkeeping.
Generation time is measured by wrapping the policy's `generate` (HF generate: TRL's vLLM modes
need a CUDA/vLLM server setup and are not used here).
"""

from __future__ import annotations

import argparse
import json
import time


def read_prompts(path: str):
    """The verl-layout parquet as a conversational dataset: `prompt` (messages) and `ground_truth`."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    table = pq.read_table(path).to_pylist()
    rows = []
    for i, row in enumerate(table):
        truth = (row.get("reward_model") or {}).get("ground_truth")
        if not row.get("prompt") or truth is None:
            raise ValueError(f"{path} row {i}: needs a non-empty `prompt` and reward_model.ground_truth")
        rows.append({"prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
                     "ground_truth": str(truth)})
    return Dataset.from_list(rows)


def reverse_reward(completions, ground_truth, **_):
    """The project's reward (hybridflow.rewards.synthetic), on the assistant message of each completion."""
    from hybridflow.rewards.synthetic import compute_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [compute_score(t, g) for t, g in zip(texts, ground_truth, strict=True)]


class StepClock:
    """Wall time per optimizer step plus what the policy's generate() did during it."""

    def __init__(self):
        self.steps: list[dict] = []
        self._t = None
        self._gen = {"gen_s": 0.0, "prompt_tokens": 0, "completion_tokens": 0, "calls": 0}

    def wrap_generate(self, model) -> None:
        inner = model.generate

        def timed_generate(*args, **kwargs):
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            self._gen["gen_s"] += time.perf_counter() - t
            mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids", args[0] if args else None)
            seqs = out.sequences if hasattr(out, "sequences") else out
            self._gen["prompt_tokens"] += int(mask.sum()) if mask is not None else int(ids.numel())
            self._gen["completion_tokens"] += int(seqs.shape[0] * (seqs.shape[1] - ids.shape[1]))
            self._gen["calls"] += 1
            return out

        model.generate = timed_generate

    def start(self) -> None:
        self._t = time.perf_counter()

    def step_end(self, metrics: dict) -> None:
        now = time.perf_counter()
        g = self._gen
        self.steps.append({"step_s": now - self._t, "tokens": g["prompt_tokens"] + g["completion_tokens"],
                           "gen_s": g["gen_s"], "generate_calls": g["calls"],
                           "timing": {"gen": g["gen_s"]}, "trl_metrics": metrics})
        self._gen = {"gen_s": 0.0, "prompt_tokens": 0, "completion_tokens": 0, "calls": 0}
        self._t = now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True, help="TRL's output_dir (nothing is saved there)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per optimizer step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--micro-batch", type=int, default=64, help="completions per forward/backward")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default (all cores)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: TRL's bf16=True, which on CPU is torch autocast over fp32 weights")
    args = ap.parse_args()

    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)

    completions = args.prompts * args.group
    if completions % args.micro_batch:
        raise ValueError(f"--micro-batch={args.micro_batch} must divide prompts*group={completions}")
    accumulation = completions // args.micro_batch
    config = GRPOConfig(
        output_dir=args.work, max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=args.dtype == "bf16", fp16=False, seed=0, dataloader_num_workers=0,
        remove_unused_columns=False,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,  # one generation of prompts*group completions per optimizer step
        num_generations=args.group, num_iterations=1, beta=args.beta,
        max_completion_length=args.response_tokens, temperature=1.0, top_p=1.0,
        # EOS never ends a completion early: every completion has exactly --response-tokens tokens.
        generation_kwargs={"min_new_tokens": args.response_tokens},
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        model_init_kwargs={"dtype": "float32"}, use_vllm=False,
        # TRL turns activation checkpointing on by default; our trainer keeps activations, so neither recomputes.
        gradient_checkpointing=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    clock = StepClock()

    class Clock(TrainerCallback):
        def __init__(self):
            self.last_logs = {}

        def on_train_begin(self, *a, **k):
            clock.start()

        def on_log(self, _args, state, control, logs=None, **k):
            self.last_logs = dict(logs or {})

        def on_step_end(self, *a, **k):
            clock.step_end({})

    cb = Clock()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reverse_reward, args=config, train_dataset=read_prompts(
        args.data), processing_class=tokenizer, callbacks=[cb])
    clock.wrap_generate(trainer.model)
    threads = torch.get_num_threads()
    trainer.train()
    # TRL logs after on_step_end, so attach each step's logs from the trainer's history.
    history = [h for h in trainer.state.log_history if "loss" in h or "completions/mean_length" in h]
    for s, h in zip(clock.steps, history, strict=False):
        s["trl_metrics"] = {k: v for k, v in h.items() if isinstance(v, (int, float))}
    setup = {"trl_generation": "HF generate (no vLLM)", "torch_threads": threads, "dtype": args.dtype,
             "bf16": config.bf16,
             "micro_batch": args.micro_batch, "grad_accumulation": accumulation,
             "trl_version": trl.__version__, "transformers_version": transformers.__version__,
             "loss_type": getattr(config, "loss_type", None),
             "gradient_checkpointing": config.gradient_checkpointing}
    with open(args.out, "w") as f:
        json.dump({"steps": clock.steps, "setup": setup}, f, indent=1)


if __name__ == "__main__":
    main()
