"""Shared by the Megatron tests and their torchrun worker: test models, the padded batch, the HF reference.

Kept free of megatron imports so pytest can use it without paying megatron's import time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PARITY_WORKER = Path(__file__).resolve().parent / "parity_worker.py"


def save_llama_vocab300(out_dir, tie: bool = False, seed: int = 0, sharded: bool = True) -> Path:
    """A tiny Llama whose vocab (300) straddles the TP=2 shard boundary (padded 512, 256 rows per rank).

    sharded: saved in ~200 KB shards with an index, so loading goes through model.safetensors.index.json.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=5000.0, tie_word_embeddings=tie, architectures=["LlamaForCausalLM"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        # HF initialises norms to 1; random norms catch a swapped input/post-attention norm.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    out = Path(out_dir)
    model.save_pretrained(out, max_shard_size="200KB" if sharded else "10GB")
    return out


def load_hf_state(model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, single-file or sharded."""
    import json

    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    state = {}
    for fname in files:
        state.update(load_file(str(model_dir / fname)))
    return state


def save_tiny_qwen2(out_dir, tie: bool = True, seed: int = 1) -> Path:
    """The project's tiny Qwen2 (q/k/v biases), tied embeddings, random biases and norms."""
    from safetensors.torch import load_file, save_file

    from hybridflow.models.tiny import save_tiny_model

    out = save_tiny_model(out_dir, preset="tiny4l", arch="qwen2", seed=seed, tie_word_embeddings=tie)
    path = out / "model.safetensors"
    state = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith("bias"):
            state[name] = torch.randn(t.shape, generator=gen) * 0.1
        elif "norm" in name:
            state[name] = torch.rand(t.shape, generator=gen) + 0.5
    save_file(state, str(path), metadata={"format": "pt"})
    return out


def make_batch(vocab_size: int, seed: int = 0, batch: int = 4, seq: int = 13):
    """Variable-length rows: left-padded, right-padded, both, and full; pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :4] = 0  # left padding (a prompt)
    mask[1, -5:] = 0  # right padding (a short response)
    mask[2, :2] = 0  # left and right padding (prompt + response)
    mask[2, -3:] = 0
    ids = ids * mask  # padding positions hold the pad id 0
    return ids, mask


def hf_reference(model_dir, input_ids, attention_mask, dtype=torch.float32):
    """HF transformers log p(token k | tokens < k) and the entropy of that distribution, [b, s-1], fp32
    (from logits computed in `dtype`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    token_lp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    # compare where the predicted token and the one before it are both real
    valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    return token_lp.float(), entropy.float(), valid


def hf_grad_norm(model_dir, input_ids, attention_mask) -> tuple[float, float]:
    """(total grad L2 norm, loss) of loss = mean over predicted real tokens of -log p, in HF transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    loss = -(logp * valid).sum() / valid.sum()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return norm.item(), loss.item()


def run_parity_worker(nproc: int, out: Path, *args: str, timeout: int = 120) -> dict:
    """parity_worker.py on `nproc` local ranks through train_common.run_torchrun (the preloaded launch server,
    tests/rank_launch.py); its JSON result (pytest.fail with the workers' output tail if it fails)."""
    import pytest
    from train_common import run_torchrun

    try:
        run_torchrun(PARITY_WORKER.name, nproc, ["--out", str(out), *args], timeout=timeout)
    except RuntimeError as e:
        pytest.fail(str(e))
    if not out.is_file():
        pytest.fail(f"parity_worker.py x{nproc} exited 0 without writing {out}")
    return json.loads(out.read_text())


def assert_matches_hf(case: str, hf_dir: Path, result: dict, tol: float, train: bool) -> None:
    """A parity worker's result against HF transformers on the same weights: per-token log-probs and entropy of
    make_batch within `tol` (padding and first tokens exactly 0); with `train`, the one step's loss and grad norm."""
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    ids, mask = make_batch(vocab)
    ref_lp, ref_ent, valid = hf_reference(hf_dir, ids, mask)
    lp, ent = torch.tensor(result["logprobs"]), torch.tensor(result["entropy"])
    lp_err = (lp - ref_lp)[valid].abs().max().item()
    ent_err = (ent - ref_ent)[valid].abs().max().item()
    print(f"{case}: logprob max err {lp_err:.2e}, entropy max err {ent_err:.2e}, times {result['times']}")
    assert lp_err < tol and ent_err < tol
    assert not lp[~valid].any() and not ent[~valid].any()  # padding / first tokens are zero
    if train:
        ref_norm, ref_loss = hf_grad_norm(hf_dir, ids, mask)
        norm, loss = result["train"]
        print(f"{case}: grad norm {norm:.7f} vs HF {ref_norm:.7f}, loss {loss:.7f} vs HF {ref_loss:.7f}")
        assert abs(loss - ref_loss) < tol and abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm)
