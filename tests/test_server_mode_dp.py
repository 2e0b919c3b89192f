"""Server mode (rollout.mode=async) on vLLM data-parallel replicas: 2 replicas x t_g=2 on 4 processes.

tests/rollout_scripts/serve_dp_vllm.py drives the worker's ServingRole with ticks routed unevenly (one replica
idle while the other decodes, requests finishing at different steps, an interrupt, an abort, a bad request on one
replica). vLLM's data-parallel engines step as one collective, so a rank that stepped more or fewer times than
the others would hang its peers; here every tick must end with the same engine steps on all four ranks, and every
served token must equal HF greedy decoding in fp32 (the script's "free" mode, without the lockstep rule, hangs its
first tick: run it by hand to see the control fail).
"""

import os
from pathlib import Path

import pytest
import torch
from rank_launch import torchrun

pytest.importorskip("vllm")

from hybridflow.models.tiny import save_tiny_model  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "rollout_scripts"
REPO = Path(__file__).resolve().parents[1]


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=[model.config.vocab_size], pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_server_ticks_keep_two_tg2_replicas_in_lockstep_and_equal_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    model = save_tiny_model(tmp_path / "model", preset="tiny", arch="llama")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = torchrun(SCRIPTS / "serve_dp_vllm.py", 4, [str(model), str(out_dir)], env=env, cwd=SCRIPTS, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(4)]
    P, R, max_steps = ranks[0]["prompts"], ranks[0]["response_length"], ranks[0]["max_steps"]

    # (num_replicas, replica_rank, tp_rank) as vLLM built them, and the engine itself asks for lockstep
    assert [r["layout"] for r in ranks] == [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
    assert all(r["steps_in_lockstep"] for r in ranks)
    for phase in "ABCDE":
        steps = [[s for s, _ in r[phase]["steps"]] for r in ranks]
        assert steps[1:] == steps[:-1], f"phase {phase}: engine steps per tick differ across ranks: {steps}"
        # the TP ranks of a replica served the same
        assert ranks[0][phase]["done"] == ranks[1][phase]["done"] and ranks[2][phase]["done"] == ranks[3][phase]["done"]
    # A's first tick ends when a0 (3 tokens) finishes on replica 0, while replica 1, sent nothing, ran dummy steps
    assert ranks[0]["A"]["steps"][0] == (3, 0) and ranks[2]["A"]["steps"][0] == (3, 3)
    assert all(s <= max_steps for r in ranks for phase in "ABCDE" for s, _ in r[phase]["steps"])
    # B: replica 0 idle throughout, yet it stepped with replica 1 on every tick
    assert [i for _, i in ranks[0]["B"]["steps"]] == [s for s, _ in ranks[2]["B"]["steps"]]

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = {"a0": (P[0], 3), "a1": (P[1], 9), "a2": (P[2], 16), "a3": (P[3], 5), "b0": (P[4], 7), "b1": (P[5], 12),
            "c1": (P[1], 6), "d1": (P[3], 4), "d2": (P[4], 8), "e2": (P[1], 5), "e3": (P[5], 3)}
    served = {0: {}, 1: {}}
    for r in (0, 2):
        for phase in "ABCDE":
            served[ranks[r]["layout"][1]].update(ranks[r][phase]["done"])
    assert sorted(served[0]) == ["a0", "a1", "a2", "c1", "d1", "e2"]
    assert sorted(served[1]) == ["a3", "b0", "b1", "c0+", "d2", "e3"]
    for replica, done in served.items():
        for rid, d in done.items():
            assert d["weight_version"] == 1 and d["finish_reason"] == "length"
            if rid != "c0+":
                assert d["token_ids"] == _hf_greedy(hf, *want[rid]), (replica, rid)
    # C: interrupted on replica 0 after one tick (its greedy prefix), continued on replica 1 to the same greedy whole
    c0 = _hf_greedy(hf, P[0], R)
    cut = ranks[0]["C"]["cut"]
    assert [(x["request_id"], x["token_ids"]) for x in ranks[0]["C"]["partial"]] == [("c0", cut)]
    assert ranks[2]["C"]["partial"] == [] and cut == c0[: len(cut)] and 0 < len(cut) < R
    assert cut + served[1]["c0+"]["token_ids"] == c0
    # D: end_serving aborted replica 1's request in flight, replica 0 had none
    assert [r["D_end"]["rollout/aborted_requests"] for r in ranks] == [0.0, 0.0, 1.0, 1.0]
    # E: replica 0's too-long prompt fails there with vLLM's own error, and replica 1 stops in the same tick
    assert all("maximum context length" in r["E_error"] for r in ranks[:2]), [r["E_error"] for r in ranks]
    assert all("another replica" in r["E_error"] for r in ranks[2:]), [r["E_error"] for r in ranks]
