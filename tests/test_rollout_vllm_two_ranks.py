"""Two processes (torchrun, gloo), one in-process vLLM engine per rank, against HF greedy in fp32.

The ranks run tests/rollout_scripts/two_rank_vllm.py: t_g=2 (one replica over both ranks) on vLLM's
shared-memory TP communicator where this machine's vLLM has it (test_reshard_vllm_sync.py's MoE cases run TP-2
engines with it off on every machine), then in the same processes t_g=1 with vLLM data_parallel_size=2 (each rank
its own slice, gathered). Both ranks must end with identical outputs, equal to HF transformers greedy decoding.
"""

import os
from pathlib import Path

import pytest
import torch
from rank_launch import torchrun
from rollout_scripts.reference import hf_greedy, make_prompts

pytest.importorskip("vllm")

from hybridflow.models.tiny import build_tokenizer, save_tiny_model  # noqa: E402
from hybridflow.rollout.vllm_engine import cpu_shm_supported  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "rollout_scripts"
REPO = Path(__file__).resolve().parents[1]
R = 16  # the script's response length


@pytest.mark.slow
def test_two_ranks_tp2_and_two_replicas_equal_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    model = save_tiny_model(tmp_path / "model", preset="tiny", arch="llama")
    new = save_tiny_model(tmp_path / "new", preset="tiny", arch="llama", seed=11)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = torchrun(SCRIPTS / "two_rank_vllm.py", 2, [str(model), str(new), str(out_dir)], env=env, cwd=SCRIPTS,
                    timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]

    tok = build_tokenizer()
    prompts = make_prompts(tok)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf_new = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    want, want_new = hf_greedy(hf, prompts, R), hf_greedy(hf_new, prompts, R)

    # (num_replicas, replica_rank, tp_rank) as vLLM built them.
    assert [r["tp2_layout"] for r in ranks] == [(1, 0, 0), (1, 0, 1)]
    assert [r["dp2_layout"] for r in ranks] == [(2, 0, 0), (2, 1, 0)]
    assert [r["dp2_rows"] for r in ranks] == [5, 4]  # uneven slices of 9 prompts
    assert [r["dp2_one_prompt_rows"] for r in ranks] == [1, 0]  # replica 1 idle but took part
    for r, saved in enumerate(ranks):
        assert saved["tp2_greedy"].tolist() == want, f"rank {r}, t_g=2"
        assert saved["tp2_new_weights_greedy"].tolist() == want_new, f"rank {r}, t_g=2 after load_weights"
        assert saved["dp2_greedy"].tolist() == want, f"rank {r}, t_g=1 x 2 replicas (gathered)"
        assert saved["dp2_one_prompt"].tolist() == want[:1], f"rank {r}, one prompt on two replicas"
        assert saved["dp2_uids"] == [f"u{i}" for i in range(len(prompts))]
    for saved in ranks:
        assert saved["world_sum_after_shutdown"] == 3.0  # 1 + 2: the default group still works
        # The shared-memory path runs exactly where vLLM's CPU build has it (AVX-512/AMX; never on AVX2-only), and
        # its segment names are gone while the engine runs.
        assert saved["tp2_shm_active"] == cpu_shm_supported()
        assert saved["tp2_shm_names"] == []
        assert saved["tp2_broadcast_buffer_named"] is False  # mapped by both ranks, named by neither
    # Each TP rank's own output (before gathering) is the same: the script gives the two ranks
    # different global RNG states before sampling, so this holds only because the rollout seeds
    # every call itself (without that, the ranks draw different tokens).
    assert torch.equal(ranks[0]["tp2_greedy_local"], ranks[1]["tp2_greedy_local"])
    assert torch.equal(ranks[0]["tp2_greedy_logp_local"], ranks[1]["tp2_greedy_logp_local"])
    assert torch.equal(ranks[0]["tp2_sampled_local"], ranks[1]["tp2_sampled_local"])
