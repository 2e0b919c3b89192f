"""Weight sync into vLLM: the per-shard layout conversion, the lazy full-shaped buffers, and a real
2-process Megatron -> HybridEngine -> vLLM (CPU, external_launcher) run against HF transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hybridflow.parallel.dims import GenerationDims, ParallelDims
from hybridflow.resharding.planner import ParamSpec, plan_resharding
from hybridflow.resharding.vllm_layout import VllmShardConverter

ROOT = Path(__file__).resolve().parents[1]
CFG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 8,
       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
       "intermediate_size": 6, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _plan(t_g: int):
    """t=1 training (one rank per replica holds everything), so generation shards are plain slices."""
    specs = [
        ParamSpec("decoder.layers.0.self_attention.linear_qkv.weight", (16, 8), 4, True, 0, 1, 0),
        ParamSpec("decoder.layers.0.mlp.linear_fc1.weight", (12, 8), 4, True, 0, 2, 0),
        ParamSpec("decoder.layers.0.self_attention.linear_proj.weight", (8, 8), 4, True, 1, 1, 0),
        ParamSpec("output_layer.weight", (128, 8), 4, True, 0, 1, 0, valid_size=100, gen_pad_multiple=64),
    ]
    return plan_resharding(ParallelDims(tp=1, dp=t_g), GenerationDims(tp=t_g), specs)


def test_vllm_local_layout_matches_hf_heads_by_hand():
    """qkv_proj = [q heads of the rank; its kv heads], gate_up = [gate_r; up_r], vocab rows padded to 64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    gate, up, o = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(8, 8, generator=g)
    lm = torch.randn(100, 8, generator=g)
    # Megatron qkv: per query group (2 groups of 2 q heads, head_dim 2): [q_g0 (4 rows); k_g0 (2); v_g0 (2)], ...
    mqkv = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    plan = _plan(2)
    rank1 = VllmShardConverter(plan, CFG, rank=1)  # generation TP rank 1 of 2
    shards = {
        "decoder.layers.0.self_attention.linear_qkv.weight": mqkv[8:16],  # group 1
        "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate[3:6], up[3:6]]),
        "decoder.layers.0.self_attention.linear_proj.weight": o[:, 4:8],
        "output_layer.weight": lm[64:100],  # vLLM: pad 100 -> 128, 64 rows per rank
    }
    local = dict(rank1.vllm_local([shards]))
    assert torch.equal(local["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q[4:8], k[2:4], v[2:4]]))
    assert torch.equal(local["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate[3:6], up[3:6]]))
    assert torch.equal(local["model.layers.0.self_attn.o_proj.weight"], o[:, 4:8])
    assert torch.equal(local["lm_head.weight"], torch.cat([lm[64:100], torch.zeros(28, 8)]))

    full = dict(rank1.full_shaped([shards], poison=float("nan")))
    assert torch.equal(full["model.layers.0.self_attn.q_proj.weight"][4:8], q[4:8])
    assert full["model.layers.0.self_attn.q_proj.weight"][:4].isnan().all()
    assert torch.equal(full["model.layers.0.mlp.up_proj.weight"][3:6], up[3:6])
    assert torch.equal(full["model.layers.0.self_attn.o_proj.weight"][:, 4:8], o[:, 4:8])
    assert full["lm_head.weight"].shape == (100, 8) and torch.equal(full["lm_head.weight"][64:], lm[64:])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_slices_invert_mcore_shards(tp):
    """hf_mapping.hf_slices_from_mcore_shard puts every Megatron TP shard back where HF has it (qwen2: biases)."""
    from megatron_workers import hf_mapping

    cfg = {**CFG, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 4,
           "intermediate_size": 8}
    g = torch.Generator().manual_seed(tp)
    shapes = {"model.embed_tokens.weight": (100, 8), "lm_head.weight": (100, 8), "model.norm.weight": (8,),
              "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
              "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (8, 8),
              "model.layers.0.self_attn.v_proj.weight": (8, 8), "model.layers.0.self_attn.q_proj.bias": (8,),
              "model.layers.0.self_attn.k_proj.bias": (8,), "model.layers.0.self_attn.v_proj.bias": (8,),
              "model.layers.0.self_attn.o_proj.weight": (8, 8), "model.layers.0.mlp.gate_proj.weight": (8, 8),
              "model.layers.0.mlp.up_proj.weight": (8, 8), "model.layers.0.mlp.down_proj.weight": (8, 8)}
    hf = {k: torch.randn(v, generator=g) for k, v in shapes.items()}
    read = hf_mapping.dict_reader(hf)
    covered = {k: torch.zeros(v, dtype=torch.bool) for k, v in shapes.items()}
    for name in hf_mapping.mcore_param_names(cfg):
        for r in range(tp):
            shard = hf_mapping.mcore_shard_from_hf(name, read, cfg, r, tp)
            rows = None
            if hf_mapping.describe(name, cfg).kind == hf_mapping.VOCAB:  # Megatron's padded split, real rows only
                per = shard.shape[0]
                rows = (min(r * per, 100), min((r + 1) * per, 100))
                shard = shard[: rows[1] - rows[0]]
            for sl in hf_mapping.hf_slices_from_mcore_shard(name, shard, cfg, r, tp, rows):
                assert tuple(sl.full_shape) == shapes[sl.hf_name]

                def region(t, sl=sl):
                    return t if sl.dim is None else t.narrow(sl.dim, sl.start, sl.stop - sl.start)

                assert torch.equal(sl.tensor, region(hf[sl.hf_name])), (name, r, sl.hf_name)
                region(covered[sl.hf_name]).fill_(True)
    assert all(m.all() for m in covered.values())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_full_shaped_buffers_commit_only_the_written_region():
    """The CPU path's premise: torch.empty of a large tensor commits only the pages written."""
    before = _rss_bytes()
    buf = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB
    buf[: 4 << 20].fill_(1)  # write 4 MiB
    grown = _rss_bytes() - before
    del buf
    assert grown < 24 << 20, f"RSS grew by {grown / 2**20:.1f} MiB for a 4 MiB region of a 64 MiB empty tensor"


def _sync_on_two_ranks(script: str, w0, w1, layout) -> list[dict]:
    """tests/reshard_scripts/<script> on 2 torchrun ranks (vLLM built on w0, synced to w1); its JSON lines."""
    from rank_launch import torchrun

    proc = torchrun(ROOT / "tests/reshard_scripts" / script, 2, [str(w0), str(w1), *map(str, layout)],
                    env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=900)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-5000:])
    return lines


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,tied,layout",
    [
        ("llama", False, (1, 2, 2)),  # t=1, p=2 -> t_g=2: stages gathered, then split (t_g > t)
        ("qwen2", True, (2, 1, 1)),  # t=2 -> t_g=1 in 2 vLLM replicas; q/k/v biases; tied lm_head
    ],
    ids=["llama-pp2-tg2", "qwen2-tied-tp2-tg1"],
)
def test_megatron_to_vllm_sync_matches_hf(tmp_path, arch, tied, layout):
    """vLLM reads only its region (NaN elsewhere) and then generates exactly what HF does with the new weights."""
    from hybridflow.models.tiny import save_tiny_model

    extra = {"tie_word_embeddings": True} if tied else {}
    w0 = save_tiny_model(tmp_path / "w0", arch=arch, seed=0, **extra)
    w1 = save_tiny_model(tmp_path / "w1", arch=arch, seed=1, **extra)
    lines = _sync_on_two_ranks("check_vllm_sync.py", w0, w1, layout)
    for r in lines[0]["ranks"]:
        # vLLM started from other weights (tiny random models may still agree on greedy tokens)
        assert not r["before_equals_reference"] or r["max_logprob_diff_before"] > 1e-2, r
        assert r["after_equals_reference"] and r["unpoisoned_equals_reference"], r
        assert r["max_logprob_diff"] < 1e-3, r
        assert r["sync"]["bytes_recv"] == r["sync"]["expected_recv_bytes"], r


@pytest.mark.slow
@pytest.mark.moe
@pytest.mark.parametrize(
    "arch,layout",
    [
        ("qwen3_moe", (1, 1, 1, 2)),  # EP2 (4 experts a rank) -> t_g=1: each engine gets the other rank's experts
        ("qwen2_moe", (1, 1, 2, 2)),  # EP2 -> t_g=2: half of every expert; the shared expert stays local
        ("mixtral", (2, 1, 1, 1)),  # TP2 SP, experts split over ETP2 -> t_g=1 in 2 replicas
    ],
    ids=["qwen3moe-ep2-tg1", "qwen2moe-ep2-tg2", "mixtral-tp2-etp2-tg1"],
)
def test_megatron_moe_to_vllm_sync_matches_megatron(tmp_path, arch, layout):
    """Experts through the HybridEngine into VLLMRollout (CPU reload + expert re-pack): with NaN outside each rank's
    region vLLM's greedy tokens equal HF's for the new weights and its log-probs Megatron's within 1e-5 (fp32);
    every rank receives exactly the plan's lower bound."""
    from hybridflow.models.tiny import save_tiny_model

    w0 = save_tiny_model(tmp_path / "w0", arch=arch, seed=3)
    w1 = save_tiny_model(tmp_path / "w1", arch=arch, seed=11)
    lines = _sync_on_two_ranks("check_vllm_sync_moe.py", w0, w1, layout)
    for r in lines[0]["ranks"]:
        assert not r["before_equals_reference"] or (r["max_logprob_diff_before_vs_megatron"] or 1) > 1e-2, r
        assert r["after_equals_reference"] and r["again_equals_after"], r
        assert r["max_logprob_diff_vs_megatron"] < 1e-5 and r["max_logprob_diff_unpoisoned_vs_megatron"] < 1e-5, r
        assert r["sync"]["bytes_recv"] == r["sync"]["expected_recv_bytes"] > 0, r
        assert r["shm_active"] is False, r  # cpu_shm_allreduce=False: gloo TP collectives on every CPU type
