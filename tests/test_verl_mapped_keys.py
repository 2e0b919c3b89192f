"""verl keys whose meaning we have, wired to the real behaviour: the reward manager (naive, and DAPO's overlong
penalty), validation generations to the console and trackers, and the LR decay style. (The vLLM engine keys are
in tests/test_verl_compat.py and tests/test_rollout_vllm.py; Megatron's fields in tests/test_megatron_overrides.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.config.load import ConfigError, load_config
from hybridflow.rewards import overlong

DAPO = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True", "+reward_model.reward_kwargs.max_resp_len=10"]


def test_dapo_overlong_penalty_by_hand():
    # max_resp_len 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10, on past it
    lengths = [3, 6, 7, 8, 10, 12]
    assert overlong.overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.5]
    assert overlong.overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.75]
    rm = load_config(None, DAPO).reward_model
    scores, metrics = overlong.shape_scores(rm, 32, [1.0, 1.0, 0.0], [6, 8, 12])
    assert scores.tolist() == [1.0, 0.5, -1.5]
    assert metrics == {"reward/overlong_reward": pytest.approx(-2.0 / 3), "reward/overlong": pytest.approx(2 / 3)}
    naive = load_config(None, []).reward_model  # verl's default manager: scores as the scorer returns them
    assert overlong.shape_scores(naive, 32, [1.0, 0.0], [40, 50]) == (pytest.approx(np.array([1.0, 0.0])), {})


def test_the_trainer_reward_stage_applies_the_manager():
    """RayPPOTrainer.rule_scores, run on a real batch with the built-in GSM8K scorer: the DAPO penalty by each
    response's length (attention mask), on the last valid token."""
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.protocol import DataProto
    from hybridflow.rewards.manager import RewardManager
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer

    tok = build_tokenizer()
    texts = ["#### 5", "the answer #### 5"]  # 6 and 17 characters: one token each
    width = 20
    responses = torch.full((2, width), tok.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False)
        responses[i, :len(ids)], mask[i, :len(ids)] = torch.tensor(ids), 1
    prompt = torch.ones(2, 3, dtype=torch.long)
    batch = DataProto.from_dict({"responses": responses, "response_mask": mask,
                                 "attention_mask": torch.cat([prompt, mask], 1)},
                                {"ground_truth": ["5", "5"], "data_source": ["openai/gsm8k"] * 2})
    cfg = load_config(None, [*DAPO, "+reward_model.reward_kwargs.max_resp_len=16",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=8"])
    trainer = SimpleNamespace(cfg=cfg, reward_fn=RewardManager(), tokenizer=tok)
    trainer.response_texts = lambda b: RayPPOTrainer.response_texts(trainer, b)
    scores, metrics = RayPPOTrainer.rule_scores(trainer, batch)
    # both answers are right (1.0); 17 tokens against a free length of 16 - 8 = 8: -(17 - 8) / 8 = -1.125
    assert scores.sum(-1).tolist() == [1.0, 1.0 - 1.125]
    assert scores[1, 16] == pytest.approx(-0.125) and metrics["reward/overlong"] == 0.5


@pytest.mark.bad_input
@pytest.mark.parametrize("overrides, match", [
    (["reward_model.reward_manager=prime"], r"'reward_model.reward_manager=prime' is refused.*instead: "),
    (["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
      "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4"],
     r"overlong_buffer_cfg.enable=true is DAPO's penalty: set reward_model.reward_manager=dapo"),
    ([*DAPO, "+reward_model.reward_kwargs.overlong_buffer_cfg.len=0"], r"overlong_buffer_cfg.len=0 must be between 1"),
    ([*DAPO, "+reward_model.reward_kwargs.max_resp_len=3"], r"overlong_buffer_cfg.len=4 must be between 1 and "
                                                            r"reward_model.reward_kwargs.max_resp_len=3"),
])
def test_reward_manager_keys_are_checked(overrides, match):
    try:
        rm = load_config(None, overrides).reward_model
    except ConfigError as e:
        assert __import__("re").search(match, str(e)), str(e)
        return
    with pytest.raises(ValueError, match=match):
        overlong.check(rm, 32)


def test_val_generations_are_picked_as_verl_picks_them():
    from hybridflow.trainer.validation import pick_generations

    inputs = [f"q{i}" for i in range(10)]
    outputs = [f"a{i}" for i in range(10)]
    picked = pick_generations(inputs, outputs, range(10), 3)
    assert len(picked) == 3 and all(p == (f"q{s}", f"a{s}", float(s)) for p, s in ((p, int(p[2])) for p in picked))
    # the same samples in any order give the same pick (sorted by input before the fixed-seed shuffle)
    shuffled = list(reversed(range(10)))
    assert pick_generations([inputs[i] for i in shuffled], [outputs[i] for i in shuffled], shuffled, 3) == picked
    order = sorted(zip(inputs, outputs, map(float, range(10))))
    np.random.RandomState(42).shuffle(order)  # verl's _maybe_log_val_generations
    assert picked == order[:3]
    assert pick_generations(inputs, outputs, range(10), 0) == []


def test_val_generations_reach_the_console_and_the_text_trackers(tmp_path, capsys):
    from hybridflow.trainer.tracking import Tracking, read_jsonl

    tracker = Tracking(["console", "jsonl", "tensorboard"], tmp_path, "p", "e", total_steps=2)
    samples = [("what is 2+3?", "#### 5", 1.0), ("a | b", "x\ny", 0.0)]
    tracker.log_generations(samples, step=2)
    tracker.log_generations([], step=3)  # nothing picked: nothing written
    tracker.finish()
    err = capsys.readouterr().err
    assert "[prompt] what is 2+3?" in err and "[response] #### 5" in err and "[score] 1.0" in err
    assert read_jsonl(tmp_path / "val_generations.jsonl") == [
        {"step": 2, "input": "what is 2+3?", "output": "#### 5", "score": 1.0},
        {"step": 2, "input": "a | b", "output": "x\ny", "score": 0.0}]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    text = events.Tensors("val/generations/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| what is 2+3? | #### 5 | 1 |" in text and "a \\| b" in text and "x<br>y" in text


@pytest.mark.bad_input
def test_log_val_generations_must_not_be_negative():
    from hybridflow.config.checks import trainer_keys

    with pytest.raises(ValueError, match=r"trainer.log_val_generations=-1 must be >= 0"):
        trainer_keys(load_config(None, ["trainer.log_val_generations=-1"]).trainer)


def test_lr_decay_style_is_verls_name_for_the_schedule():
    from megatron_workers.optimizer import LRSchedule

    optim = load_config(None, ["actor_rollout_ref.actor.optim.lr_decay_style=cosine",
                               "actor_rollout_ref.actor.optim.lr=1.0",
                               "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
                               "actor_rollout_ref.actor.optim.total_training_steps=4"]).actor_rollout_ref.actor.optim
    schedule = LRSchedule.from_optim_config(optim)
    assert schedule.style == "cosine"  # lr_scheduler stays at its default, constant: verl's name wins
    assert [schedule.lr_at(k) for k in range(5)] == pytest.approx([1.0, 0.5 + 0.5 * np.cos(np.pi / 4), 0.5,
                                                                   0.5 + 0.5 * np.cos(3 * np.pi / 4), 0.0])
    plain = load_config(None, ["critic.optim.lr_scheduler=linear", "critic.optim.total_training_steps=4"]).critic.optim
    assert plain.lr_decay_style is None and LRSchedule.from_optim_config(plain).style == "linear"
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.optim.lr_decay_style=inverse_square_root' is "
                                          r"refused.*instead: \*.optim.lr_decay_style=constant, linear or cosine"):
        load_config(None, ["actor_rollout_ref.actor.optim.lr_decay_style=inverse_square_root"])


def test_a_dapo_script_loads_with_verls_reward_keys():
    path = "tests/data/verl_overrides/grpo_trainer.run_qwen3moe-30b_megatron_96gb.txt"
    lines = [line for line in open(path).read().splitlines() if line.startswith("+reward_model")]
    rm = load_config(None, ["reward_model.reward_manager=dapo", *lines]).reward_model
    buffer = rm.reward_kwargs.overlong_buffer_cfg
    assert (buffer.enable, buffer.len, buffer.penalty_factor, buffer.log) == (True, 4096, 1.0, False)
    assert rm.reward_kwargs.max_resp_len == 8192
    json.dumps(buffer.__dict__)  # plain values, as the run's config.yaml keeps them


@pytest.mark.slow
def test_use_dist_checkpointing_starts_the_roles_from_the_dist_checkpoint(tmp_path):
    """verl's use_dist_checkpointing: an HF model converted to a dist checkpoint at TP2 starts the actor and the
    critic's body at TP1 x PP2, although model.path names another model of the same shape (tied embeddings:
    the checkpoint has no output layer, the critic's untied body takes the embedding)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
    from train_common import run_torchrun

    from hybridflow.models.tiny import save_tiny_model

    a = save_tiny_model(tmp_path / "a", preset="tiny", arch="qwen2", seed=1, tie_word_embeddings=True,
                        num_hidden_layers=2)
    b = save_tiny_model(tmp_path / "b", preset="tiny", arch="qwen2", seed=2, tie_word_embeddings=True,
                        num_hidden_layers=2)
    out = run_torchrun("dist_ckpt_start.py", 2, ["--hf-a", str(a), "--hf-b", str(b), "--ckpt", str(tmp_path / "ckpt")],
                       timeout=300)
    results = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    for rank in results:  # each pipeline stage holds half the layers
        assert rank["same_names"] and rank["actor_equals_a"] and rank["critic_body_equals_a"], rank
        assert rank["actor_differs_from_b"] > 0 and rank["critic_has_head"], rank


@pytest.mark.bad_input
def test_use_dist_checkpointing_needs_a_dist_checkpoint(tmp_path):
    from hybridflow.config.checks import dist_checkpoints

    key = "actor_rollout_ref.actor.megatron"
    cfg = load_config(None, [f"{key}.use_dist_checkpointing=True", f"{key}.dist_checkpointing_path={tmp_path}"])
    with pytest.raises(FileNotFoundError, match=rf"{key}.use_dist_checkpointing=true: {key}.dist_checkpointing_path="
                                                rf"'{tmp_path}' is not a Megatron dist checkpoint \(no metadata.json"):
        dist_checkpoints(cfg)
    (tmp_path / "metadata.json").write_text("{}")
    dist_checkpoints(cfg)
    cfg = load_config(None, [f"{key}.use_dist_checkpointing=True"])
    with pytest.raises(FileNotFoundError, match=r"dist_checkpointing_path=None is not"):
        dist_checkpoints(cfg)
