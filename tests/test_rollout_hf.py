"""Rollout output format, batch slicing over replicas, and the HF transformers rollout.

No vLLM here: the output keys are checked against hand-built tensors, and the HF rollout against
plain HF greedy decoding and teacher-forced log-probs from one forward pass.
"""

import numpy as np
import pytest
import torch
from rollout_scripts.reference import hf_greedy, make_prompts, teacher_forced_log_probs

from hybridflow.config.schema import RolloutConfig
from hybridflow.models.tiny import build_tokenizer, save_tiny_model
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingSettings, prompt_token_lists
from hybridflow.rollout.hf_rollout import HFRollout
from hybridflow.rollout.output import assemble_rollout_output, cut_at_stop
from hybridflow.rollout.replicas import gather_replica_outputs, replica_bounds, slice_for_replica

PAD = 0


def two_prompts(meta=None):
    # Row 0: prompt [5, 6] left-padded to 3; row 1: [7, 8, 9]. Positions given explicitly.
    return DataProto.from_dict(
        {"input_ids": torch.tensor([[PAD, 5, 6], [7, 8, 9]]),
         "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
         "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]])},
        {"uid": ["a", "b"]}, meta_info=meta or {"step": 3})


def test_assemble_output_matches_hand_built_tensors():
    # n=2: samples are rows a0, a1, b0, b1; response_length 4.
    responses = [[11, 2], [12, 13, 14, 15], [], [16]]
    log_probs = [[-0.5, -1.0], [-1, -2, -3, -4], [], [-0.25]]
    out = assemble_rollout_output(two_prompts(), responses, log_probs, n=2, response_length=4, pad_token_id=PAD)

    prompts = torch.tensor([[PAD, 5, 6], [PAD, 5, 6], [7, 8, 9], [7, 8, 9]])
    resp = torch.tensor([[11, 2, PAD, PAD], [12, 13, 14, 15], [PAD] * 4, [16, PAD, PAD, PAD]])
    rmask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert torch.equal(out.batch["prompts"], prompts)
    assert torch.equal(out.batch["responses"], resp)
    assert torch.equal(out.batch["response_mask"], rmask)
    assert torch.equal(out.batch["input_ids"], torch.cat([prompts, resp], 1))
    pmask = torch.tensor([[0, 1, 1]] * 2 + [[1, 1, 1]] * 2)
    assert torch.equal(out.batch["attention_mask"], torch.cat([pmask, rmask], 1))
    # Positions continue from the prompt's last position (1 for row a, 2 for row b), padding included.
    positions = torch.tensor([[0, 0, 1, 2, 3, 4, 5]] * 2 + [[0, 1, 2, 3, 4, 5, 6]] * 2)
    assert torch.equal(out.batch["position_ids"], positions)
    expected_lp = torch.tensor([[-0.5, -1.0, 0, 0], [-1, -2, -3, -4], [0, 0, 0, 0], [-0.25, 0, 0, 0]])
    assert torch.equal(out.batch["rollout_log_probs"], expected_lp)
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert out.meta_info == {"step": 3}


def test_assemble_output_derives_positions_without_position_ids():
    p = two_prompts()
    p.batch.pop("position_ids")
    out = assemble_rollout_output(p, [[1], [2]], [[0.0], [0.0]], n=1, response_length=2, pad_token_id=PAD)
    assert torch.equal(out.batch["position_ids"], torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]]))


def test_assemble_output_rejects_bad_sample_lists():
    with pytest.raises(ValueError, match="needs 4 samples"):
        assemble_rollout_output(two_prompts(), [[1]] * 3, [[0.0]] * 3, n=2, response_length=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="sample 1 has 5 tokens > response_length=4"):
        assemble_rollout_output(two_prompts(), [[1], [1] * 5], [[0.0], [0.0] * 5], n=1, response_length=4,
                                pad_token_id=PAD)


def test_prompt_token_lists_strips_left_padding_and_rejects_right_padding():
    assert prompt_token_lists(two_prompts()) == [[5, 6], [7, 8, 9]]
    bad = DataProto.from_dict({"input_ids": torch.tensor([[5, 6, PAD], [7, 8, 9]]),
                               "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    with pytest.raises(ValueError, match=r"rows \[0\] are not left-padded"):
        prompt_token_lists(bad)


def test_sampling_overrides_from_meta_info():
    base = SamplingSettings.from_config(RolloutConfig(n=4, temperature=0.7, response_length=8))
    greedy = base.with_overrides({"do_sample": False, "global_steps": 5})  # unrelated keys are ignored
    assert greedy.greedy and greedy.n == 1 and greedy.response_length == 8
    assert base.with_overrides({"do_sample": False, "n": 2}).n == 2
    assert base.with_overrides({"temperature": 0}).greedy
    with pytest.raises(ValueError, match="top_p=0"):
        base.with_overrides({"top_p": 0})


def test_cut_at_stop():
    assert cut_at_stop([4, 5, 2, 6, 2], {2}) == 3
    assert cut_at_stop([4, 5], {2}) == 2
    assert cut_at_stop([], {2}) == 0


@pytest.mark.parametrize("rows,replicas", [(8, 2), (9, 2), (3, 4), (10, 3)])
def test_slice_for_replica_covers_batch_in_order(rows, replicas):
    batch = DataProto.from_dict({"x": torch.arange(rows)}, {"uid": [f"u{i}" for i in range(rows)]})
    parts = [slice_for_replica(batch, r, replicas) for r in range(replicas)]
    sizes = [len(p) for p in parts]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
    assert torch.equal(gather_replica_outputs(parts).batch["x"], torch.arange(rows))
    assert replica_bounds(rows, replicas - 1, replicas)[1] == rows
    with pytest.raises(ValueError, match="outside"):
        replica_bounds(rows, replicas, replicas)


# ---- HF rollout on a tiny model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), preset="tiny", arch="llama")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, build_tokenizer()


def test_hf_rollout_greedy_matches_plain_generate_and_stops(tiny):
    _, model, tok = tiny
    prompts = make_prompts(tok, meta_info={"do_sample": False})
    R = 12
    plain = hf_greedy(model, prompts, R)
    # Pick a stop token that occurs mid-way in the first row's greedy output, so rows stop at
    # different points; the expected cut is computed by hand from the unstopped output.
    stop = plain[0][3]
    rollout = HFRollout(model, RolloutConfig(response_length=R, n=4, stop_token_ids=[stop], ignore_eos=True))
    out = rollout.generate_sequences(prompts)

    assert len(out) == len(prompts)  # do_sample=False -> n=1
    P = prompts.batch["input_ids"].shape[1]
    lengths = [row.index(stop) + 1 if stop in row else R for row in plain]
    assert len(set(lengths)) > 1, f"all rows stop at the same step {lengths}; the check would be weak"
    for i, (row, length) in enumerate(zip(plain, lengths)):
        expect = row[:length] + [PAD] * (R - length)
        assert out.batch["responses"][i].tolist() == expect, f"row {i}"
        assert out.batch["response_mask"][i].tolist() == [1] * length + [0] * (R - length), f"row {i}"
    assert torch.equal(out.batch["input_ids"], torch.cat([prompts.batch["input_ids"], out.batch["responses"]], 1))
    assert torch.equal(out.batch["attention_mask"][:, P:], out.batch["response_mask"])
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(out.batch["position_ids"][:, P:], last + torch.arange(1, R + 1))

    # The log-probs are the model's (temperature 1 for greedy), 0 after the stop token.
    ref = teacher_forced_log_probs(model, out)
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-5, rtol=0)
    assert (out.batch["rollout_log_probs"][out.batch["response_mask"] == 0] == 0).all()


def test_hf_rollout_sampling_keys_and_log_probs(tiny):
    _, model, tok = tiny
    prompts = make_prompts(tok, texts=["hi", "what is 2+2?", "0123"])
    rollout = HFRollout(model, RolloutConfig(response_length=10, n=3, temperature=0.7, seed=5))
    out = rollout.generate_sequences(prompts)
    assert len(out) == 9
    assert out.batch["responses"].shape == (9, 10) and out.batch["rollout_log_probs"].shape == (9, 10)
    assert list(out.non_tensor_batch["uid"]) == ["u0"] * 3 + ["u1"] * 3 + ["u2"] * 3
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    # The three samples of a prompt differ (sampling, not three copies of one draw).
    assert len({tuple(r) for r in out.batch["responses"][:3].tolist()}) > 1
    # Sampled with temperature 0.7 and no top-k/top-p: log-probs are log_softmax(logits / 0.7).
    ref = teacher_forced_log_probs(model, out, temperature=0.7)
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-5, rtol=0)
    # Same seed, same call index -> the same samples.
    again = HFRollout(model, RolloutConfig(response_length=10, n=3, temperature=0.7, seed=5))
    assert torch.equal(again.generate_sequences(prompts).batch["responses"], out.batch["responses"])


def test_hf_rollout_load_weights(tiny, tmp_path):
    path, _, tok = tiny
    other = save_tiny_model(tmp_path / "other", preset="tiny", arch="llama", seed=1)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    rollout = HFRollout(str(path), RolloutConfig(response_length=8))
    prompts = make_prompts(tok, meta_info={"do_sample": False})
    rollout.load_weights(load_file(other / "model.safetensors").items())
    ref_model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    got = rollout.generate_sequences(prompts).batch["responses"].tolist()
    assert got == hf_greedy(ref_model, prompts, 8)
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        rollout.load_weights([("nope", torch.zeros(1))])


def test_hf_rollout_empty_batch(tiny):
    _, model, tok = tiny
    prompts = make_prompts(tok)[0:0]
    out = HFRollout(model, RolloutConfig(response_length=5, n=2)).generate_sequences(prompts)
    assert len(out) == 0 and out.batch["responses"].shape == (0, 5)
    assert isinstance(out.non_tensor_batch["uid"], np.ndarray)


def test_hf_rollout_from_a_path_is_one_replica(tiny):
    path, _, _ = tiny
    rollout = HFRollout(str(path), RolloutConfig(name="hf", response_length=4))
    assert (rollout.replica_rank, rollout.num_replicas, rollout.is_replica_leader) == (0, 1, True)


def test_unlink_segment_removes_only_that_ranks_name(tmp_path, monkeypatch):
    from hybridflow.rollout import vllm_launch

    monkeypatch.setattr(vllm_launch, "SHM_DIR", str(tmp_path))
    names = ["hybridflow-abc-tp:0-[0-1]-cpushm_0", "hybridflow-abc-tp:0-[0-1]-cpushm_1",
             "hybridflow-xyz-tp:0-[0-1]-cpushm_0", "other_0"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert vllm_launch.unlink_segment("hybridflow-abc-tp:0-[0-1]-cpushm", 0)
    assert not vllm_launch.unlink_segment("hybridflow-abc-tp:0-[0-1]-cpushm", 0)  # gone already: no error
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
