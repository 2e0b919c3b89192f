"""Validation, the pure parts: when it runs, how it samples, and its metrics under verl's names.

The driver side (generate, score, log) is `RayPPOTrainer.validate`; everything here is a plain
function of its arguments so it can be checked against hand-computed values.

Metrics, per data source (verl's `process_validation_metrics`, for the one variable we score, "reward"):
each prompt's n samples are summarised, then the summaries are averaged over the prompts.

    val-core/<data_source>/reward/mean@<n>        mean score
    val-aux/<data_source>/reward/std@<n>          n > 1: the spread of a prompt's n scores (population std)
    val-core/<data_source>/reward/best@<n>/mean   n > 1: the best of a prompt's n scores
    val-aux/<data_source>/reward/worst@<n>/mean   n > 1: the worst of them

best/worst are exact over the n samples; verl estimates them by bootstrap resampling (with replacement),
which reads slightly lower for best and higher for worst.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

# The meta_info marker every validation generate call carries (hybridflow.rollout.base reads it).
VALIDATE_KEY = "validate"


def should_validate(step: int, total_steps: int, test_freq: int) -> bool:
    """After training step `step`: every test_freq steps and after the last one; test_freq <= 0 is never."""
    if test_freq <= 0:
        return False
    return step % test_freq == 0 or step == total_steps


def validate_before_training(val_before_train: bool, step: int, last_val_step: int | None) -> bool:
    """Whether to validate before the loop: asked for, and the policy at `step` was not validated already
    (a run resumed from a checkpoint written right after its validation would only log the same numbers twice)."""
    return val_before_train and last_val_step != step


def sampling_meta(val_kwargs) -> dict:
    """The meta_info overrides of a validation generate call, from actor_rollout_ref.rollout.val_kwargs.

    `n` is always given: greedy would otherwise also default to one sample, but a sampled validation must
    not silently use the training rollout.n.
    """
    return {"do_sample": bool(val_kwargs.do_sample), "temperature": float(val_kwargs.temperature),
            "top_p": float(val_kwargs.top_p), "top_k": int(val_kwargs.top_k), "n": int(val_kwargs.n),
            VALIDATE_KEY: True}


def chunks(num_rows: int, batch_size: int | None) -> list[range]:
    """Consecutive row ranges of at most batch_size (None: one range with every row), in dataset order."""
    if num_rows <= 0:
        return []
    size = num_rows if batch_size is None else batch_size
    if size < 1:
        raise ValueError(f"data.val_batch_size={batch_size} must be >= 1 (or null for the whole val set)")
    return [range(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


def validation_metrics(data_sources: Sequence[str], prompt_ids: Sequence, scores: Sequence[float]) -> dict[str, float]:
    """verl-named metrics (module docstring) from one entry per sample: its data source, the prompt it
    answers (anything hashable that is the same for a prompt's n samples) and its score."""
    if not len(data_sources) == len(prompt_ids) == len(scores):
        raise ValueError(f"validation_metrics: {len(data_sources)} data sources, {len(prompt_ids)} prompt ids "
                         f"and {len(scores)} scores")
    groups: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for source, prompt, score in zip(data_sources, prompt_ids, scores):
        groups[str(source)][prompt].append(float(score))
    out = {}
    for source, by_prompt in groups.items():
        sizes = {len(v) for v in by_prompt.values()}
        if len(sizes) != 1:
            raise ValueError(f"validation_metrics: prompts of {source} have different sample counts {sorted(sizes)}")
        n = sizes.pop()
        per_prompt = np.array(list(by_prompt.values()), dtype=np.float64)  # (prompts, n)
        out[f"val-core/{source}/reward/mean@{n}"] = float(per_prompt.mean(axis=1).mean())
        if n > 1:
            out[f"val-aux/{source}/reward/std@{n}"] = float(per_prompt.std(axis=1).mean())
            out[f"val-core/{source}/reward/best@{n}/mean"] = float(per_prompt.max(axis=1).mean())
            out[f"val-aux/{source}/reward/worst@{n}/mean"] = float(per_prompt.min(axis=1).mean())
    return out


def pick_generations(inputs: Sequence[str], outputs: Sequence[str], scores: Sequence[float],
                     count: int) -> list[tuple[str, str, float]]:
    """trainer.log_val_generations: which `count` samples (input, output, score) to show, as verl picks them: sorted
    by input, shuffled with a fixed seed (42), the first `count`. So a run shows the same prompts at every
    validation (their answers change), whatever order the samples came in."""
    if count <= 0:
        return []
    samples = sorted(zip(inputs, outputs, (float(s) for s in scores)), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:count]


def prompt_texts(batch, tokenizer) -> list[str]:
    """Each sample's prompt as text (special tokens dropped, as verl logs val inputs)."""
    width = batch.batch["responses"].shape[1]
    ids, mask = batch.batch["input_ids"][:, :-width], batch.batch["attention_mask"][:, :-width].bool()
    return [tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(ids, mask, strict=True)]


def summary_line(step: int, metrics: dict[str, float], num_prompts: int, n: int) -> str:
    """One line per validation for the console: each mean@n, how much was validated and how long it took."""
    means = [f"{k.split('/', 1)[1]}={v:.4f}" for k, v in sorted(metrics.items())
             if k.startswith("val-core/") and "/mean@" in k]
    seconds = metrics.get("timing_s/testing")
    took = f", {seconds:.1f} s" if seconds is not None else ""
    return f"validation at step {step}: {' '.join(means) or 'no samples'} ({num_prompts} prompts x {n}{took})"
