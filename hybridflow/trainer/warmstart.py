"""The demo's starting point: synthetic data, a tiny model, and a short supervised warm-start (cached).

RL from a random char-level model would spend minutes discovering the output
format, so the demo starts from a supervised warm-start. How that warm-start is
made decides what the RL stage can show (measured on 2 cores, tiny preset):

- A short clean SFT (55 steps, sampled score ~0.28) is not enough. RL then plateaus
  at ~0.69: the model solves the reversal's end positions and never the middle ones,
  which need a positional circuit that SFT itself only forms in a sudden jump near
  step 110 (greedy 0.68 -> 0.91). A scalar reward does not cross that jump in 150 steps,
  whatever the entropy bonus, clip-higher, group size, learning rate or dense reward.
- SFT with label smoothing 0.5 for 200 steps forms the circuit (greedy score 0.99) but
  keeps half of each token's probability spread over the vocabulary, so sampled at
  temperature 1 it scores ~0.27. That is the state RL post-training starts from in
  practice: the answer is in the policy's samples (pass@k) but not reliably (pass@1).
  RL's job is to make it reliable, and it visibly climbs past 0.9.

    python -m hybridflow.trainer.warmstart --out runs/demo_assets
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

# Digits only: with 36 characters RL must find each right character among 36 by sampling and
# the measured PPO curve crawled (0.42 -> 0.6 in 150 steps); with 10 it climbs 0.26 -> 0.68 in 120.
DEMO_ALPHABET = "0123456789"
# See the module docstring: enough steps to form the reversal circuit (~10 s on 2 cores), with half
# of each target's mass smoothed away so the sampled score starts under 0.3.
DEMO_SFT_STEPS = 200
DEMO_LABEL_SMOOTHING = 0.5


def _sft_batch(tokenizer, rows: list[dict], device: str):
    """Prompt (chat template) + answer + eos; loss on the answer tokens only."""
    import torch

    seqs, masks = [], []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"]
        a_ids = a_ids + [tokenizer.eos_token_id]
        seqs.append(p_ids + a_ids)
        masks.append([0] * len(p_ids) + [1] * len(a_ids))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m)
    return ids.to(device), attn.to(device), loss_mask.to(device)


def score_policy(model, tokenizer, rows: list[dict], max_new_tokens: int = 8, seed: int = 0) -> dict:
    """Mean task score of sampled (temperature 1, what RL starts from) and greedy answers."""
    import torch

    from hybridflow.rewards.synthetic import compute_score

    with torch.no_grad():
        prompts = [tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)["input_ids"] for r in rows]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as generate expects
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        out = {}
        torch.manual_seed(seed)
        for name, sample in (("sft_sampled_score", True), ("sft_greedy_score", False)):
            how = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0) if sample else dict(do_sample=False)
            gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, **how,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
            scores = [compute_score(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, rows, strict=True)]
            out[name] = sum(scores) / len(scores)
        return out


def supervised_warmstart(model_dir: Path, rows: list[dict], out_dir: Path, steps: int, batch_size: int = 64,
                         lr: float = 3e-3, seed: int = 0, label_smoothing: float = 0.0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    t0, losses = time.time(), []
    from tqdm import tqdm

    for _ in tqdm(range(steps), desc="warm-start SFT", unit="step", mininterval=2.0):
        idx = torch.randint(len(rows), (batch_size,), generator=g).tolist()
        ids, attn, loss_mask = _sft_batch(tok, [rows[i] for i in idx], "cpu")
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none",
                                              label_smoothing=label_smoothing)
        m = loss_mask[:, 1:].float()
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    scores = score_policy(model, tok, rows[:128])
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return {"sft_steps": steps, "sft_label_smoothing": label_smoothing,
            "sft_final_loss": losses[-1] if losses else None, "sft_s": time.time() - t0, **scores}


def prepare(out: str | Path, preset: str = "tiny", arch: str = "llama", sft_steps: int = DEMO_SFT_STEPS,
            train_size: int = 4096, test_size: int = 128, seed: int = 0, force: bool = False,
            alphabet: str = DEMO_ALPHABET, label_smoothing: float = DEMO_LABEL_SMOOTHING) -> dict:
    """Create (or reuse) data/{train,test}.parquet, base_model/ and sft_model/ under `out`."""
    from hybridflow.data.prep_synthetic import prepare as prep_data
    from hybridflow.models.tiny import save_tiny_model

    out = Path(out)
    key = {"preset": preset, "arch": arch, "sft_steps": sft_steps, "train_size": train_size,
           "test_size": test_size, "seed": seed, "alphabet": alphabet, "label_smoothing": label_smoothing,
           "version": 2}
    manifest = out / "manifest.json"
    if not force and manifest.is_file():
        cached = json.loads(manifest.read_text())
        if cached.get("key") == key:
            log.info("demo assets in %s are up to date", out)
            return cached
    out.mkdir(parents=True, exist_ok=True)
    prep_data(out / "data", train_size=train_size, test_size=test_size, seed=seed, alphabet=alphabet)
    base = save_tiny_model(out / "base_model", preset=preset, arch=arch, seed=seed)
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "data" / "train.parquet").to_pylist()
    info = supervised_warmstart(base, rows, out / "sft_model", steps=sft_steps, seed=seed,
                                label_smoothing=label_smoothing)
    result = {"key": key, **info, "model": str(out / "sft_model"), "train": str(out / "data" / "train.parquet"),
              "test": str(out / "data" / "test.parquet")}
    manifest.write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo_assets")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--sft-steps", type=int, default=DEMO_SFT_STEPS)
    ap.add_argument("--alphabet", default=DEMO_ALPHABET, help="characters of the strings to reverse")
    ap.add_argument("--label-smoothing", type=float, default=DEMO_LABEL_SMOOTHING,
                    help="SFT label smoothing: higher keeps the warm-start less sure of its answers")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(2)
    info = prepare(a.out, a.preset, a.arch, a.sft_steps, force=a.force, alphabet=a.alphabet,
                   label_smoothing=a.label_smoothing)
    print(json.dumps({k: v for k, v in info.items() if k != "key"}))


if __name__ == "__main__":
    main()
