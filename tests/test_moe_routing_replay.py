"""MoE routing replay (verl's R3): the rollout records each token's experts, training routes to exactly those.

Two halves, each against HF transformers:
- Training side (torchrun, tests/mcore_scripts/moe_replay.py): ActorRolloutRefWorker.compute_log_prob with
  actor.router_replay.mode=R3 on a batch whose `routed_experts` are random experts. The reference is HF with its
  routers forced to the same experts (gate weights: the router's own probabilities of them, as HF computes them):
  log-probs within 1e-5, while the same weights routing by themselves give other log-probs (and HF's own).
- Rollout side (one process): HFRollout with rollout.enable_rollout_routing_replay records, for every prompt and
  response token it fed, the experts each layer chose; an HF teacher-forced forward over the finished sequences
  routes the same tokens to the same experts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "mcore_scripts"
sys.path.insert(0, str(SCRIPTS))

from moe_replay import random_routing  # noqa: E402
from train_common import make_rl_batch, run_torchrun  # noqa: E402

from hybridflow.models.tiny import save_tiny_model  # noqa: E402
from hybridflow.rollout.moe_routing import moe_router_modules  # noqa: E402

pytestmark = pytest.mark.moe
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay_models")
    return {arch: save_tiny_model(root / arch, arch=arch, seed=4) for arch in ("qwen3_moe", "qwen2_moe")}


def hf_response_logprobs(model_dir: Path, forced: torch.Tensor | None) -> torch.Tensor:
    """HF's log-probs of make_rl_batch's responses; forced (rows, cols, layers, k): every router takes these
    experts (-1: experts 0..k-1, as the engine fills unrecorded tokens), weighted as the HF router weighs them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    norm = bool(model.config.norm_topk_prob)
    batch = make_rl_batch(model.config.vocab_size)
    if forced is not None:
        k = forced.shape[-1]
        forced = torch.where(forced >= 0, forced.long(), torch.arange(k))
        for layer, gate in enumerate(moe_router_modules(model)):
            def force(module, args, output, layer=layer):
                logits, scores, _ = output
                chosen = forced[:, :, layer].reshape(-1, k)  # HF routes (rows * cols) tokens, row-major
                probs = (torch.softmax(logits.float().gather(1, chosen), dim=-1) if norm
                         else torch.softmax(logits.float(), dim=-1).gather(1, chosen))
                return logits, probs.to(scores.dtype), chosen
            gate.register_forward_hook(force)
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return logp[:, -r:] * batch["response_mask"]


# (arch, nproc, script args)
CASES = {
    "qwen3_moe": ("qwen3_moe", 1, []),
    "qwen3_moe_ep2": ("qwen3_moe", 2, ["--ep", "2"]),
    "qwen2_moe_tp2_sp": ("qwen2_moe", 2, ["--tp", "2", "--sp"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_replayed_training_routes_exactly_as_recorded(case, models, tmp_path):
    arch, nproc, args = CASES[case]
    out = tmp_path / "replay.json"
    run_torchrun("moe_replay.py", nproc, ["--model", str(models[arch]), "--out", str(out), *args])
    result = json.loads(out.read_text())
    replayed, natural = torch.tensor(result["R3"]), torch.tensor(result["disabled"])
    routed = torch.tensor(result["routed"], dtype=torch.int16)
    mask = make_rl_batch(2**10)["response_mask"].bool()  # the mask does not depend on the vocab
    forced_ref = hf_response_logprobs(models[arch], routed)
    natural_ref = hf_response_logprobs(models[arch], None)
    # the recorded routing is the one in the batch
    cfg = json.loads((models[arch] / "config.json").read_text())
    batch = make_rl_batch(cfg["vocab_size"])
    assert torch.equal(routed, random_routing(batch, cfg["num_hidden_layers"], 8, 2))
    err_replay = (replayed - forced_ref)[mask].abs().max().item()
    err_natural = (natural - natural_ref)[mask].abs().max().item()
    moved = (replayed - natural)[mask].abs().max().item()
    print(f"{case}: replayed vs HF forced {err_replay:.2e}, own routing vs HF {err_natural:.2e}, "
          f"replay moved log-probs by up to {moved:.3f}")
    assert err_replay < TOL and err_natural < TOL
    assert moved > 100 * TOL  # the forced experts are not the ones the model picks: replay really routed


def test_the_hf_rollout_records_the_experts_it_routed_each_token_to(models):
    """Greedy generation in fp32 with recording on; a teacher-forced HF forward over the finished rows (no KV
    cache) routes every recorded token to the same experts. Off by one column, or one layer, the sets differ
    for most tokens (8 experts, top-2: 28 possible pairs)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.config.schema import RolloutConfig
    from hybridflow.protocol import DataProto
    from hybridflow.rollout.hf_rollout import HFRollout

    model_dir = models["qwen3_moe"]
    cfg = RolloutConfig(name="hf", n=2, response_length=6, temperature=1.0, enable_rollout_routing_replay=True)
    rollout = HFRollout(str(model_dir), cfg)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_rl_batch(vocab, batch=3, prompt_len=5, response_len=1)
    p = 5
    data = DataProto.from_dict({k: prompts[k][:, :p] for k in ("input_ids", "attention_mask")},
                               meta_info={"do_sample": False})
    out = rollout.generate_sequences(data)
    routed = out.batch["routed_experts"]
    rows, cols = out.batch["input_ids"].shape
    assert routed.shape == (rows, cols, 2, 2) and routed.dtype == torch.int16

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    seen = []
    for gate in moe_router_modules(model):
        gate.register_forward_hook(lambda m, a, o: seen.append(o[2].view(rows, cols, -1)))
    mask = out.batch["attention_mask"]
    with torch.no_grad():
        model(input_ids=out.batch["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    own = torch.stack(seen, dim=2)  # (rows, cols, layers, k)
    recorded = routed >= 0
    last = cols - 1 - mask.flip(1).argmax(dim=1)
    valid = mask.bool().clone()
    valid[torch.arange(rows), last] = False  # a row's last token is sampled, never fed: not recorded
    assert recorded.all(-1).all(-1)[valid].all()  # every fed token recorded, every layer
    same = (own.sort(-1).values == routed.long().sort(-1).values).all(-1)  # (rows, cols, layers)
    agree = same[valid].float().mean().item()
    print(f"recorded routing equals the teacher-forced forward's on {agree:.4f} of (token, layer)")
    assert agree > 0.99
