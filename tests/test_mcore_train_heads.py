"""Critic values, critic gradients and reward-model scores against a plain PyTorch reference head.

One torchrun spawn at TP2 x PP2 with sequence parallel (the head gathers the sequence first)
runs CriticWorker.compute_values, CriticWorker.update_critic and RewardModelWorker.compute_rm_score.
The reference is the HF model's final hidden states times the same hidden->1 weight:
the critic's freshly initialised head, and the reward model's `score.weight` from its checkpoint.
The grad norm of the critic update checks the head's backward under SP (a reduce-scatter of
identical gradients would scale it by tp).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from train_common import make_rl_batch, run_torchrun  # noqa: E402
from train_heads import critic_inputs  # noqa: E402

from megatron_workers.heads import last_token_scores, response_values  # noqa: E402


def test_last_token_scores_and_response_values_by_hand():
    # prompt length 3, response length 3; row 0: full response, row 1: 1 response token, row 2: empty response
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]])
    values = torch.arange(18, dtype=torch.float32).view(3, 6)
    scores = last_token_scores(values, mask, response_length=3)
    assert torch.equal(scores, torch.tensor([[0.0, 0.0, 5.0], [9.0, 0.0, 0.0], [14.0, 0.0, 0.0]]))
    assert torch.equal(response_values(values, 3), values[:, 2:5])
    with pytest.raises(ValueError, match="rows \\[0\\]"):
        last_token_scores(values[:1], torch.zeros(1, 6, dtype=torch.long), 3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("heads")
    model = save_tiny_model(root / "llama", preset="tiny", arch="llama")
    rm = root / "rm"
    shutil.copytree(model, rm)  # an HF reward model: the same body plus a `score` head
    state = load_file(str(rm / "model.safetensors"))
    state["score.weight"] = torch.randn(1, state["model.norm.weight"].shape[0],
                                        generator=torch.Generator().manual_seed(9)) * 0.5
    save_file(state, str(rm / "model.safetensors"), metadata={"format": "pt"})
    out = root / "heads.pt"
    run_torchrun("train_heads.py", 4, ["--model", str(model), "--rm", str(rm), "--out", str(out),
                                       "--tp", "2", "--pp", "2", "--sp"])
    return torch.load(out), model, state["score.weight"]


@pytest.mark.slow
def test_values_scores_and_critic_grad_match_reference(run):
    from transformers import AutoModel

    from hybridflow.algorithms import compute_value_loss

    result, model_dir, score_weight = run
    body = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_rl_batch(body.config.vocab_size, seed=11)
    r, mask = batch["responses"].shape[1], batch["response_mask"]
    hidden = body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"]).last_hidden_state

    head = torch.nn.Parameter(result["head"].clone())
    values = (hidden @ head.T)[..., 0][:, -r - 1 : -1] * mask
    assert (values - result["values"]).abs().max() < 1e-5
    assert result["values"].abs().max() > 1e-3  # a real signal, not zeros

    scores = (hidden @ score_weight.T)[..., 0].detach()
    last = (batch["attention_mask"] * torch.arange(batch["attention_mask"].shape[1])).argmax(dim=1)
    expected = torch.zeros(len(last), r)
    for i, pos in enumerate(last.tolist()):
        expected[i, pos - (batch["input_ids"].shape[1] - r)] = scores[i, pos]
    assert (expected - result["rm_scores"]).abs().max() < 1e-5 * max(1.0, expected.abs().max().item())
    assert ((result["rm_scores"] != 0).sum(dim=1) == 1).all()

    data = critic_inputs(batch)
    vf_loss, clipfrac = compute_value_loss(vpreds=values, returns=data["returns"], values=data["values"],
                                           response_mask=mask, cliprange_value=0.5, loss_agg_mode="token-mean")
    vf_loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in [*body.parameters(), head])).item()
    metrics = result["metrics"]
    assert metrics["critic/vf_loss"] == pytest.approx(vf_loss.item(), rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipfrac.item(), rel=1e-6) and clipfrac > 0
    assert metrics["critic/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert metrics["critic/lr"] == 1e-3
