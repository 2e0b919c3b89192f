"""Virtual pipeline (interleaved schedule), PP2 x VPP2 on a 4-layer Llama, through ActorRolloutRefWorker.

- log-probs within 1e-5 of HF transformers;
- one PPO update equal (1e-5) to the same update at PP1;
- a checkpoint saved at PP2 x VPP2 resumes at PP1 (another layout), and the next update there equals the
  VPP run's own next update;
- the 3D-HybridEngine over the interleaved chunks: the generation shards are the model's weights, and each
  rank receives exactly the bytes of the parameters its stage does not hold, with the stage -> layer map
  written out here by hand (rank 0: layers 0 and 2, rank 1: layers 1 and 3) rather than taken from our code.
Two launches: 2 processes (PP2 x VPP2), then 1 (PP1).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from train_common import make_rl_batch, run_torchrun  # noqa: E402

# PP2 x VPP2 on 4 layers: chunk v of stage p holds layer v*2 + p
OWN_LAYERS = {0: {0, 2}, 1: {1, 3}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("vpp")
    model = save_tiny_model(root / "llama4", preset="tiny4l", arch="llama")
    ckpt, vpp, pp1 = root / "ckpt", root / "vpp.pt", root / "pp1.pt"
    run_torchrun("vpp_steps.py", 2, ["--model", str(model), "--ckpt", str(ckpt), "--out", str(vpp),
                                     "--pp", "2", "--vpp", "2"], timeout=240)
    run_torchrun("vpp_steps.py", 1, ["--model", str(model), "--ckpt", str(ckpt), "--out", str(pp1)], timeout=240)
    return model, torch.load(vpp), torch.load(pp1), ckpt


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_vpp_log_probs_match_hf(runs):
    from transformers import AutoModelForCausalLM

    model_dir, vpp, _, _ = runs
    assert vpp["chunks"] == 2
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_rl_batch(hf.config.vocab_size)
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"]).logits[:, :-1]
    ref = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0][:, -r:]
    mask = batch["response_mask"].bool()
    assert (vpp["log_prob"] - ref)[mask].abs().max().item() < 1e-5


@pytest.mark.slow
def test_vpp_update_equals_pp1_and_resumes_at_pp1(runs):
    _, vpp, pp1, ckpt = runs
    assert pp1["chunks"] == 1
    assert json.loads((ckpt / "hybridflow_layout.json").read_text())["vpp"] == 2
    assert vpp["step1"]["actor/grad_norm"] == pytest.approx(pp1["step1"]["actor/grad_norm"], rel=1e-6)
    assert _max_diff(vpp["step1_params"], pp1["step1_params"]) < 1e-5
    # the update moved the weights (lr 2e-3), so the equality above is not trivial
    assert _max_diff(vpp["step1_params"], vpp["step2_params"]) > 1e-4
    # resume at PP1 from the VPP checkpoint (weights + optimizer state), then the same second update
    assert pp1["extra"] == {"step": 1}
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
        assert pp1["step2"][key] == pytest.approx(vpp["step2"][key], rel=1e-6), key
    assert _max_diff(vpp["step2_params"], pp1["step2_params"]) < 1e-5


def _on_stage(name: str, rank: int) -> bool:
    m = re.match(r"decoder\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) in OWN_LAYERS[rank]
    return {"embedding.word_embeddings.weight": 0, "decoder.final_layernorm.weight": 1,
            "output_layer.weight": 1}[name] == rank


@pytest.mark.slow
def test_hybrid_engine_over_interleaved_chunks(runs):
    from megatron_workers.hf_io import read_hf_config
    from megatron_workers.hf_mapping import hf_to_mcore_full

    model_dir, vpp, _, _ = runs
    hf_config = read_hf_config(model_dir)
    vocab = hf_config["vocab_size"]
    full = hf_to_mcore_full(vpp["step2_params"], hf_config, tp=1)  # the weights the engine resharded
    for rank, cases in enumerate(vpp["reshard_all"]):
        for case in cases:
            shards, t_g = case["shards"], case["t_g"]
            where = f"rank {rank} t_g={t_g}"
            assert set(shards) == set(full), where
            if t_g == 1:  # every rank gets the whole model (vocab rows: the real ones)
                for name, shard in shards.items():
                    assert torch.equal(shard[:vocab], full[name][:vocab]), (where, name)
            # bytes: exactly what the rank's stage does not hold (t = 1 holds every TP slice of its layers)
            foreign = sum(s.numel() * s.element_size() for n, s in shards.items() if not _on_stage(n, rank))
            assert case["bytes_recv"] == foreign == case["expected_recv_bytes"], where
