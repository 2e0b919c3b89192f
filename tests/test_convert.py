"""Checkpoint conversion (megatron_workers.convert) and actor export (hybridflow.trainer.export).

- HF -> Megatron dist checkpoint at TP2 -> HF is bit-exact (same keys, torch.equal on every tensor) for the
  tiny Llama (GQA) and a tiny Qwen2 (qkv bias, tied embeddings); at TP2 each rank read only part of the HF
  bytes; the output loads with transformers.
- Re-layout TP2/PP1 -> TP1/PP2 (relayout, and reading a TP2 checkpoint at TP1/PP2 directly): the exported
  tensors are bit-exact, and HF transformers' log-probs on a fixed batch equal the original's within 1e-6.
- Export of a real 1-step GRPO run (Megatron TP2 actor, vLLM rollout, greedy validation after the last step
  dumped by the trainer): HF transformers' greedy generate and plain vLLM (in-process, fp32) on the dumped
  prompt ids give the dumped response ids.
- Bad input fails fast (before torchrun / any process group) naming the path or key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "mcore_scripts"))
from train_common import hf_state, run_torchrun  # noqa: E402

from hybridflow.trainer import export  # noqa: E402
from megatron_workers import convert  # noqa: E402

# Same near-tie rule as test_e2e_validation: two fp32 implementations may pick different tokens only where
# the reference's top-2 logits are closer than this before the first differing token.
TIE = 1e-4
RESPONSE_LENGTH = 8  # configs/grpo_tiny_cpu.yaml: rollout.response_length


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("convert")
    return {"root": root,
            "llama": save_tiny_model(root / "llama", preset="tiny", arch="llama", seed=1),
            "qwen2": save_tiny_model(root / "qwen2", preset="tiny", arch="qwen2", seed=2, tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def converted(models):
    """All conversions in one 2-process torchrun; returns the output dirs and each step's timings."""
    r = models["root"]
    steps = [
        f"hf-to-mcore --hf {models['llama']} --out {r / 'llama_tp2'} --tp 2",
        f"mcore-to-hf --mcore {r / 'llama_tp2'} --out {r / 'llama_tp2_hf'}",
        f"relayout --mcore {r / 'llama_tp2'} --out {r / 'llama_pp2'} --tp 1 --pp 2",
        f"mcore-to-hf --mcore {r / 'llama_pp2'} --out {r / 'llama_pp2_hf'}",
        f"hf-to-mcore --hf {models['qwen2']} --out {r / 'qwen2_tp2'} --tp 2",
        f"mcore-to-hf --mcore {r / 'qwen2_tp2'} --out {r / 'qwen2_tp2_hf'}",
        f"mcore-to-hf --mcore {r / 'qwen2_tp2'} --out {r / 'qwen2_pp2_hf'} --tp 1 --pp 2",
    ]
    t = time.perf_counter()
    stdout = run_torchrun("convert_steps.py", 2, steps, timeout=400)
    timings = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("STEP ")]
    assert len(timings) == len(steps), stdout[-3000:]
    print(f"\nconversions ({time.perf_counter() - t:.1f} s with torchrun and imports):")
    for s in timings:
        print(f"  tp={s['tp']} pp={s['pp']} {s['cmd'].split()[0]}: " + ", ".join(
            f"{k}={v:.2f}" for k, v in s["seconds"].items() if k != "hf_bytes_read"))
    return {"root": r, "timings": timings}


def _assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_mcore_tp2_hf_round_trip_is_bit_exact(models, converted, arch):
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, mcore, back = models[arch], converted["root"] / f"{arch}_tp2", converted["root"] / f"{arch}_tp2_hf"
    original = hf_state(src)
    if arch == "qwen2":  # the case the converter must not break: tied embeddings (no lm_head) and qkv biases
        assert "lm_head.weight" not in original and "model.layers.0.self_attn.q_proj.bias" in original
    _assert_same_state(original, hf_state(back))
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())

    # It really is a Megatron TP2 checkpoint: layout file, Megatron names, vocab padded for TP2 (128 * 2).
    assert json.loads((mcore / "hybridflow_layout.json").read_text())["tp"] == 2
    meta = FileSystemReader(str(mcore)).read_metadata().state_dict_metadata
    assert tuple(meta["embedding.word_embeddings.weight"].size) == (256, 64)
    assert any(k.startswith("decoder.layers.") and "linear_qkv" in k for k in meta)
    # ... written by ranks that each read only their slices (replicated norms are read by both)
    record = json.loads((mcore / convert.CONVERT_FILE).read_text())
    assert record["tp"] == 2 and record["source"] == str(src)
    total = sum(t.numel() * t.element_size() for t in original.values())
    read = record["seconds"]["hf_bytes_read"]
    assert 0.5 * total < read < 0.7 * total, (read, total)

    model = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)  # loads with no missing keys
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    tok = AutoTokenizer.from_pretrained(back)
    assert tok("hi")["input_ids"] == AutoTokenizer.from_pretrained(src)("hi")["input_ids"]


def _hf_logprobs(model_dir: Path) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) of a fixed batch, HF transformers, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (4, 12), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.slow
@pytest.mark.parametrize("arch, out", [("llama", "llama_pp2"), ("qwen2", "qwen2_pp2")])
def test_relayout_tp2_to_tp1_pp2_keeps_weights_and_logprobs(models, converted, arch, out):
    root = converted["root"]
    if arch == "llama":  # the mcore -> mcore command wrote a TP1/PP2 checkpoint
        assert json.loads((root / out / "hybridflow_layout.json").read_text())["tp"] == 1
        assert json.loads((root / out / "hybridflow_layout.json").read_text())["pp"] == 2
    exported = root / f"{out}_hf"
    assert json.loads((exported / convert.CONVERT_FILE).read_text())["pp"] == 2  # read at TP1/PP2
    _assert_same_state(hf_state(models[arch]), hf_state(exported))
    ref, got = _hf_logprobs(models[arch]), _hf_logprobs(exported)
    assert ref.shape == (4, 11) and ref.max() < 0
    assert (got - ref).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------- export of a trained run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 1-step GRPO run (TP2 actor) that checkpoints and validates greedily after its last step."""
    from test_e2e_trainer import _cmd, _run

    from hybridflow.trainer.warmstart import prepare

    root = tmp_path_factory.mktemp("export")
    # 80 warm-start steps: greedy answers vary (see test_e2e_validation), so the comparison sees real tokens
    assets = prepare(root / "assets", sft_steps=80, train_size=64, test_size=8)
    run = root / "run"
    _run(_cmd("grpo_tiny_cpu.yaml", run, f"actor_rollout_ref.model.path={assets['model']}",
              f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['test']}]",
              "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              "actor_rollout_ref.rollout.n=2", "trainer.total_training_steps=1", "trainer.save_freq=1",
              "trainer.test_freq=1", f"trainer.validation_data_dir={root / 'val_dump'}"), root / "train.log")
    dump = [json.loads(x) for x in (root / "val_dump" / "step_1.jsonl").read_text().splitlines()]
    return {"run": run, "model": Path(assets["model"]), "dump": dump, "root": root}


@pytest.fixture(scope="module")
def exported(trained_run):
    out = trained_run["root"] / "exported"
    t = time.perf_counter()
    record = export.main([str(trained_run["run"]), "--out", str(out)])
    print(f"\nexport (torchrun x{record['tp'] * record['pp']}): {time.perf_counter() - t:.1f} s")
    return out, record


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=RESPONSE_LENGTH, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.scores]
        out.append({"ids": gen.sequences[0, len(ids):].tolist(), "gaps": gaps})
    return out


def _vllm_greedy(model_dir: Path, prompts: list[list[int]], work: Path) -> list[list[int]]:
    (work / "prompts.json").write_text(json.dumps(prompts))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(TESTS / "rollout_scripts" / "vllm_greedy_dir.py"), str(model_dir),
                           str(work / "prompts.json"), str(RESPONSE_LENGTH), str(work / "vllm_out.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((work / "vllm_out.json").read_text())


@pytest.mark.own_ray  # the trained_run fixture runs the trainer, which starts a Ray of its own
@pytest.mark.slow
def test_export_of_a_trained_run_generates_what_the_trainer_generated(trained_run, exported):
    out, record = exported
    assert record["step"] == 1 and (record["tp"], record["pp"]) == (2, 1)  # the actor's saved layout
    trained = hf_state(out)
    start = hf_state(trained_run["model"])
    assert sorted(trained) == sorted(start)
    # the export holds the trained weights, not a copy of the starting model
    assert max((trained[k] - start[k]).abs().max().item() for k in start) > 1e-5

    dump = trained_run["dump"]
    prompts, expected = [d["prompt_ids"] for d in dump], [d["response_ids"] for d in dump]
    assert len(dump) == 8 and len({tuple(e) for e in expected}) > 1  # varied responses: a mix-up would show
    assert sum(len(e) for e in expected) > len(expected)  # not all an immediate eos

    vllm_ids = _vllm_greedy(out, prompts, trained_run["root"])
    assert vllm_ids == expected  # the same engine (vLLM, fp32, t_g=1) on the same weights: exact

    hf = _hf_greedy(out, prompts)
    differ = 0
    for i, (h, e) in enumerate(zip(hf, expected, strict=True)):
        if h["ids"] != e:
            first = next((k for k, (a, b) in enumerate(zip(h["ids"], e)) if a != b), min(len(h["ids"]), len(e)))
            assert min(h["gaps"][: first + 1]) < TIE, (i, h["ids"], e, h["gaps"])
            differ += 1
    assert differ <= 1, f"{differ} of {len(hf)} HF greedy responses differ from the trainer's"


# --------------------------------------------------------------------------- bad input: fast, before torchrun


def _fails(fn, argv: list[str], *needles: str) -> None:
    t = time.perf_counter()
    with pytest.raises(SystemExit) as err:
        fn(argv)
    message = str(err.value.code)
    assert time.perf_counter() - t < 10, "a bad-input check should not need processes"
    for needle in needles:
        assert needle in message, message


@pytest.mark.bad_input
def test_missing_hf_dir_is_named(tmp_path):
    missing = tmp_path / "no_such_model"
    _fails(convert.main, ["hf-to-mcore", "--hf", str(missing), "--out", str(tmp_path / "o")], str(missing))


@pytest.mark.bad_input
def test_hf_dir_without_config_or_safetensors(tmp_path, models):
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(convert.main, ["hf-to-mcore", "--hf", str(empty), "--out", str(tmp_path / "o")],
           str(empty / "config.json"))
    only_cfg = tmp_path / "only_config"
    only_cfg.mkdir()
    (only_cfg / "config.json").write_text((models["llama"] / "config.json").read_text())
    _fails(convert.main, ["hf-to-mcore", "--hf", str(only_cfg), "--out", str(tmp_path / "o")],
           str(only_cfg), "model.safetensors")


@pytest.mark.bad_input
def test_tp_not_dividing_heads_or_world_size(tmp_path, models):
    llama = models["llama"]  # 4 heads, 2 kv heads, 2 layers
    _fails(convert.main, ["hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "o"), "--tp", "3"],
           "tp=3 does not divide num_attention_heads=4", str(llama / "config.json"))
    _fails(convert.main, ["hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "o"), "--pp", "3"],
           "pp=3 does not divide num_hidden_layers=2")
    # a valid layout, but this process is a world of one
    _fails(convert.main, ["hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "o"), "--tp", "2"],
           "world size 1 != tp*pp = 2*1", "--nproc-per-node 2")


@pytest.mark.bad_input
def test_mcore_dir_that_is_not_a_checkpoint(tmp_path):
    step = tmp_path / "global_step_3"
    (step / "actor").mkdir(parents=True)
    _fails(convert.main, ["mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "o")],
           str(step), "metadata.json", "actor/")


@pytest.mark.bad_input
def test_export_without_a_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    partial = run / "checkpoints" / ".tmp_global_step_2"  # a run killed while writing its first checkpoint
    partial.mkdir(parents=True)
    (run / "checkpoints" / "global_step_1").mkdir()  # no COMPLETE marker
    _fails(export.main, [str(run), "--out", str(tmp_path / "hf")], str(run), "no complete checkpoint", "COMPLETE")
    _fails(export.main, [str(run / "checkpoints" / "global_step_1"), "--out", str(tmp_path / "hf")],
           "global_step_1", "incomplete checkpoint")


@pytest.mark.slow
@pytest.mark.bad_input
def test_mcore_to_hf_with_the_wrong_hf_config(tmp_path, models, converted):
    mcore = converted["root"] / "llama_tp2"  # a Llama checkpoint read with the Qwen2's config
    _fails(convert.main, ["mcore-to-hf", "--mcore", str(mcore), "--out", str(tmp_path / "o"),
                          "--hf-config", str(models["qwen2"])],
           "decoder.layers.self_attention.linear_qkv.weight", "(2, 256, 64)", str(models["qwen2"] / "config.json"))
