"""The driver's wiring without Ray: reward-model stage and modes, ref group routing, rollout dumps, validation.

RayPPOTrainer.step runs on plain Python stand-ins for the worker groups that record which group
served which call; the end-to-end runs (tests/test_e2e_reward_split.py) check the real workers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.config.load import load_config
from hybridflow.protocol import DataProto
from hybridflow.rewards.manager import RewardManager, combine_with_rm
from hybridflow.trainer import metrics as M

R = 3  # response width of the fake rollout


class FakeGroup:
    """A worker group stand-in: the methods the driver calls, each logged as (group name, method)."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def _log(self, method: str) -> None:
        self.calls.append((self.name, method))

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self._log("generate_sequences")
        n = 2
        rows = prompts.repeat(n, interleave=True)
        b = len(rows)
        lengths = torch.tensor([1 + i % R for i in range(b)])  # 1, 2, 3, 1, ... valid response tokens
        response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
        responses = torch.where(response_mask.bool(), 10 + torch.arange(b)[:, None] % 7, torch.zeros(b, R).long())
        out = {"prompts": rows.batch["input_ids"], "responses": responses, "response_mask": response_mask,
               "input_ids": torch.cat([rows.batch["input_ids"], responses], 1),
               "attention_mask": torch.cat([rows.batch["attention_mask"], response_mask], 1),
               "rollout_log_probs": -0.5 * response_mask.float()}
        return DataProto.from_dict(out, dict(rows.non_tensor_batch), dict(prompts.meta_info))

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        self._log("compute_ref_log_prob")
        return DataProto.from_dict({"ref_log_prob": -0.25 * data.batch["response_mask"].float()})

    def compute_rm_score(self, data: DataProto) -> DataProto:
        from megatron_workers.heads import last_token_scores

        self._log("compute_rm_score")
        per_position = data.batch["input_ids"].float() / 100.0
        return DataProto.from_dict({"rm_scores": last_token_scores(per_position, data.batch["attention_mask"], R)})

    def update_actor(self, data: DataProto) -> DataProto:
        self._log("update_actor")
        return DataProto(meta_info={"metrics": {"actor/pg_loss": 0.0}})

    def compute_values(self, data: DataProto) -> DataProto:
        self._log("compute_values")
        return DataProto.from_dict({"values": torch.zeros_like(data.batch["response_mask"], dtype=torch.float32)})

    def update_critic(self, data: DataProto) -> DataProto:
        self._log("update_critic")
        return DataProto(meta_info={"metrics": {"critic/vf_loss": 0.0}})


def _config(tmp_path, *overrides: str):
    return load_config(None, [f"trainer.default_local_dir={tmp_path / 'run'}", "algorithm.adv_estimator=grpo",
                              "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=true",
                              "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                              "data.max_prompt_length=6", "critic.enable=false", *overrides])


def _trainer(cfg, groups: dict, reward_fn):
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer

    dataset = [{"input_ids": [1, 20 + i, 21 + i], "raw_prompt": f"p{i}", "data_source": "fake", "ground_truth": str(i),
                "extra_info": {}, "index": i} for i in range(4)]
    sampler = ResumableSampler(len(dataset), cfg.data.train_batch_size, seed=0, shuffle=False)
    Path(cfg.trainer.default_local_dir).mkdir(parents=True)  # the data trace goes there
    return RayPPOTrainer(cfg, build_tokenizer(), dataset, sampler, reward_fn, groups["actor"], None,
                         ref=groups.get("ref"), reward_model=groups.get("rm"))


def _length_reward(source, response, truth, extra):
    return float(len(response))


def _step(trainer) -> tuple[dict, list[dict]]:
    trainer.global_step = 1
    metrics = trainer.step()
    dump = Path(trainer.cfg.trainer.rollout_data_dir) / "step_1.jsonl"
    return metrics, [json.loads(line) for line in dump.read_text().splitlines()]


def test_split_ref_group_serves_the_ref_and_rm_adds_to_rule_scores(tmp_path):
    calls = []
    groups = {name: FakeGroup(name, calls) for name in ("actor", "ref", "rm")}
    cfg = _config(tmp_path, "reward_model.reward_mode=add", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")
    metrics, records = _step(_trainer(cfg, groups, RewardManager(compute_score=_length_reward)))
    assert calls == [("actor", "generate_sequences"), ("rm", "compute_rm_score"), ("ref", "compute_ref_log_prob"),
                     ("actor", "update_actor")]
    assert "timing_s/rm" in metrics and "timing_s/ref" in metrics
    assert len(records) == 4
    for r in records:
        # the fake RM scores the last valid token's id / 100; the rule scores the response's text length
        assert r["rm_score"] == pytest.approx(r["response_ids"][-1] / 100.0)
        assert r["score"] == pytest.approx(len(r["response"]) + r["rm_score"])
        assert r["prompt_ids"][0] == 1 and r["prompt"].startswith("<s>")
    assert metrics["critic/rm_score/mean"] == pytest.approx(np.mean([r["rm_score"] for r in records]))
    assert metrics["critic/score/mean"] == pytest.approx(np.mean([r["score"] for r in records]))


def test_replace_mode_never_calls_the_rule_scorer_and_colocated_ref_is_the_actor(tmp_path):
    def no_rule(*args):
        raise AssertionError("the rule scorer must not run with reward_mode=replace")

    calls = []
    groups = {"actor": FakeGroup("actor", calls), "rm": FakeGroup("rm", calls)}
    cfg = _config(tmp_path, f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")  # replace is the default
    metrics, records = _step(_trainer(cfg, groups, RewardManager(compute_score=no_rule)))
    assert ("actor", "compute_ref_log_prob") in calls
    assert "reward/num_errors" not in metrics  # no rule scoring happened (an error would score 0 and count)
    assert all(r["score"] == pytest.approx(r["rm_score"]) for r in records)


def test_critic_warmup_holds_the_actor_back_as_verl_does(tmp_path):
    """trainer.critic_warmup=3 over 4 steps: verl updates the actor when critic_warmup <= global_step (steps count
    from 1), so steps 1 and 2 train only the critic and steps 3 and 4 both; the critic trains at every step."""
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.trainer.ppo_trainer import RayPPOTrainer

    calls = []
    actor, critic = FakeGroup("actor", calls), FakeGroup("critic", calls)
    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path / 'run'}", "algorithm.adv_estimator=gae",
                             "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             "data.max_prompt_length=6", "trainer.critic_warmup=3"])
    dataset = [{"input_ids": [1, 20 + i], "raw_prompt": f"p{i}", "data_source": "fake", "ground_truth": "x",
                "extra_info": {}, "index": i} for i in range(8)]
    Path(cfg.trainer.default_local_dir).mkdir(parents=True)
    trainer = RayPPOTrainer(cfg, build_tokenizer(), dataset, ResumableSampler(8, 2, seed=0, shuffle=False),
                            RewardManager(compute_score=_length_reward), actor, critic)
    updates = {}
    for step in range(1, 5):
        trainer.global_step = step
        calls.clear()
        metrics = trainer.step()
        updates[step] = [method for _, method in calls if method.startswith("update_")]
        assert ("timing_s/update_actor" in metrics) == (step >= 3) and "critic/vf_loss" in metrics
        assert ("actor/pg_loss" in metrics) == (step >= 3)
    assert updates == {1: ["update_critic"], 2: ["update_critic"], 3: ["update_critic", "update_actor"],
                       4: ["update_critic", "update_actor"]}


def test_combine_with_rm_rule():
    rule = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    rm = torch.tensor([[0.0, -0.25], [2.0, 0.0]])
    assert torch.equal(combine_with_rm(None, rm, "replace"), rm)
    assert torch.equal(combine_with_rm(rule, rm, "add"), rule + rm)
    with pytest.raises(ValueError, match="reward_model.reward_mode='max'"):
        combine_with_rm(rule, rm, "max")
    batch = DataProto.from_dict({"response_mask": torch.ones(2, 2), "attention_mask": torch.ones(2, 4),
                                 "token_level_scores": rule, "token_level_rewards": rule, "rm_scores": rm,
                                 "advantages": rule, "returns": rule})
    m = M.data_metrics(batch, use_critic=False)
    assert m["critic/rm_score/mean"] == pytest.approx(0.875) and m["critic/rm_score/min"] == -0.25


# ---------------------------------------------------------------- validation and pools

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model, save_tiny_reward_model

    root = tmp_path_factory.mktemp("models")
    policy = save_tiny_model(root / "policy")
    data = root / "train.parquet"
    data.write_bytes(b"")  # validate only checks that it exists
    return policy, save_tiny_reward_model(root / "rm", body_from=policy), data


def _validate(model_dirs, *overrides: str):
    from hybridflow.trainer.main import validate

    policy, _, data = model_dirs
    cfg = load_config(None, [f"actor_rollout_ref.model.path={policy}", f"data.train_files=[{data}]", *overrides])
    validate(cfg)
    return cfg


def test_reward_model_config_errors_name_the_key(model_dirs, tmp_path):
    _, rm, _ = model_dirs
    with pytest.raises(FileNotFoundError, match=r"reward_model.model.path='' has no config.json.*--reward-model"):
        _validate(model_dirs, "reward_model.enable=true")
    with pytest.raises(FileNotFoundError, match="reward_model.model.path=.* has no config.json"):
        _validate(model_dirs, "reward_model.enable=true", f"reward_model.model.path={tmp_path}")
    with pytest.raises(ValueError, match="reward_model.reward_mode='sum'"):
        _validate(model_dirs, "reward_model.enable=true", f"reward_model.model.path={rm}",
                  "reward_model.reward_mode=sum")
    with pytest.raises(ValueError, match=r"reward_model.megatron tp\*pp\*cp=4\*1\*1"):
        _validate(model_dirs, "reward_model.enable=true", f"reward_model.model.path={rm}",
                  "reward_model.megatron.tensor_model_parallel_size=4")
    with pytest.raises(ValueError, match="reward_model.megatron: tp=4 does not divide num_key_value_heads=2"):
        _validate(model_dirs, "reward_model.enable=true", f"reward_model.model.path={rm}", "trainer.n_gpus_per_node=4",
                  "reward_model.megatron.tensor_model_parallel_size=4")
    _validate(model_dirs, "reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.reward_mode=add")
    _validate(model_dirs, f"reward_model.model.path={tmp_path}")  # disabled: not looked at


def test_placement_checks(model_dirs):
    with pytest.raises(ValueError, match="trainer.placement='spread'"):
        _validate(model_dirs, "trainer.placement=spread")
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name=sglang' is refused"):  # at load, before Ray
        _validate(model_dirs, "actor_rollout_ref.rollout.name=sglang")
    mismatch = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",  # by default it follows the actor's
                "actor_rollout_ref.actor.use_kl_loss=true"]
    with pytest.raises(ValueError, match=r"ref.megatron \(tp, pp, vpp, cp\)=\(1, 1, 1, 1\) must equal"):
        _validate(model_dirs, *mismatch)
    _validate(model_dirs, *mismatch, "trainer.placement=standalone")  # its own processes: any layout that fits
    with pytest.raises(ValueError, match=r"shares the actor's pool 'actor_ref'.*\(1, 1, 1, 1\) must equal"):
        _validate(model_dirs, *mismatch, "trainer.placement=split")  # the paper's split: ref with the actor
    with pytest.raises(ValueError, match=r"critic.megatron tp\*pp\*cp=4"):
        _validate(model_dirs, "critic.enable=true", "critic.megatron.tensor_model_parallel_size=4")
    with pytest.raises(ValueError, match=r"actor_rollout_ref.ref.megatron tp\*pp\*cp=4"):
        _validate(model_dirs, *mismatch, "trainer.placement=standalone",
                  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4")


def test_presets_place_roles_as_the_paper_within_the_local_cpu_budget(model_dirs):
    from hybridflow.trainer.main import make_pools

    roles = ["actor_rollout", "ref", "critic", "reward_model"]
    standalone = make_pools(_validate(model_dirs, "trainer.placement=standalone"), roles)
    assert len({id(p) for p in standalone.values()}) == 4 and all(p.max_colocate == 1 for p in standalone.values())
    split = make_pools(_validate(model_dirs, "trainer.placement=split"), roles)
    assert split["actor_rollout"] is split["ref"] and split["critic"] is split["reward_model"]
    assert split["actor_rollout"] is not split["critic"]
    # the ref on the actor's pool runs in the actor's processes: one group per bundle there, two on critic_rm
    assert (split["actor_rollout"].max_colocate, split["critic"].max_colocate) == (1, 2)
    colocated = make_pools(_validate(model_dirs), roles)
    assert len({id(p) for p in colocated.values()}) == 1 and colocated["critic"].max_colocate == 3
    # main.py starts a local cluster with max(16, cores) logical CPUs: every layout must fit on a 2-core box.
    for pools in (standalone, split, colocated):
        reserved = sum(p.cpus_per_proc * p.max_colocate * p.world_size for p in {id(p): p for p in pools.values()}
                       .values())
        assert reserved <= 16, reserved


class NoRolloutLogProbs(FakeGroup):
    """A rollout with actor_rollout_ref.rollout.calculate_log_probs=false: no rollout_log_probs in its output."""

    seen: dict = {}

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        out = super().generate_sequences(prompts)
        out.batch.pop("rollout_log_probs")
        return out

    def compute_log_prob(self, data: DataProto) -> DataProto:
        self._log("compute_log_prob")
        mask = data.batch["response_mask"].float()
        return DataProto.from_dict({"old_log_probs": -0.5 * mask, "entropys": mask})

    def update_actor(self, data: DataProto) -> DataProto:
        self.seen = {"keys": set(data.batch), "on_policy": data.meta_info.get("old_log_prob_from_update")}
        return super().update_actor(data)


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_without_rollout_log_probs_the_update_is_its_own_old_policy_unless_the_reward_needs_one(tmp_path,
                                                                                                kl_in_reward):
    from hybridflow.trainer.ppo_trainer import skips_old_log_prob

    calls = []
    actor = NoRolloutLogProbs("actor", calls)
    cfg = _config(tmp_path, "actor_rollout_ref.rollout.calculate_log_probs=false",
                  f"algorithm.use_kl_in_reward={str(kl_in_reward).lower()}")
    metrics = _trainer(cfg, {"actor": actor}, RewardManager(compute_score=_length_reward)).step()
    assert skips_old_log_prob(cfg) is not kl_in_reward
    if kl_in_reward:  # the KL penalty reads old log-probs before the update: the pass runs, as verl's would
        assert calls == [("actor", "generate_sequences"), ("actor", "compute_log_prob"),
                         ("actor", "compute_ref_log_prob"), ("actor", "update_actor")]
        assert "old_log_probs" in actor.seen["keys"] and not actor.seen["on_policy"]
        assert "actor/reward_kl_penalty" in metrics
    else:  # one on-policy update: its own forward is the old policy, and there is no rollout/old mismatch
        assert ("actor", "compute_log_prob") not in calls
        assert "old_log_probs" not in actor.seen["keys"] and actor.seen["on_policy"]
        assert not any(k.startswith("rollout/logprob_diff") for k in metrics)
    assert "rollout_log_probs" not in actor.seen["keys"]
