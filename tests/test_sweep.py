"""launch.sweep: the --space parser and the results table (pure), then one real sweep on CPU.

The real sweep: `python -m launch.sweep` over the tiny PPO (real Ray Tune, Ray, Megatron, critic; 1 process
per trial, HF rollout, 2 steps), lr=grid(1e-5, 1e-3, -1.0): two trials finish, the third fails its config
check inside the trial and is an ERROR row while the others run on. The cluster is made exactly two trials
big (trainer.ray.num_cpus=4, a trial reserves 2 CPUs), so the sweep only finishes if each trial's worker
groups run inside the trial's own placement group: a trainer making its own placement groups would wait
for CPUs that Tune already holds. The table (made from the trials' own metrics.jsonl) is checked against
what Tune received from each step (its progress.csv, the other path out of the trainer), best.yaml is loaded
with the trainer's config loader, and --resume restores the finished sweep without running any trial again.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.sweep.results import best_of, best_row, first_line, render_markdown, table_rows
from launch.sweep.space import Dim, SpaceError, override, parse_dim, parse_space

REPO = Path(__file__).resolve().parents[1]
LR = "actor_rollout_ref.actor.optim.lr"


def _valid(key: str) -> bool:
    from hybridflow.config.load import is_valid_key

    return is_valid_key(key)


def test_space_specs_parse_to_dims_and_tune_objects():
    dims = parse_space([f"{LR}=loguniform(1e-6,1e-4)", "algorithm.kl_ctrl.kl_coef=choice(0.001, 0.01)",
                        "data.train_batch_size=randint(8,33)", "algorithm.adv_estimator=grid(gae,grpo)",
                        "critic.optim.lr=uniform(1e-4,1e-3)"], _valid)
    assert dims[0] == Dim(LR, "loguniform", (1e-6, 1e-4))  # 1e-6 is a float, though YAML 1.1 reads a string
    assert dims[1].args == (0.001, 0.01) and dims[2].args == (8, 33) and dims[3].args == ("gae", "grpo")
    lo = dims[0].to_tune()
    draws = [lo.sample() for _ in range(2000)]
    assert all(1e-6 <= x <= 1e-4 for x in draws)
    # log-uniform: half the draws below the geometric middle 1e-5 (a uniform draw: 9%)
    assert 0.45 < sum(x < 1e-5 for x in draws) / len(draws) < 0.55
    assert dims[1].to_tune().categories == [0.001, 0.01]
    assert dims[3].to_tune() == {"grid_search": ["gae", "grpo"]}
    ints = dims[2].to_tune()
    assert all(8 <= ints.sample() < 33 for _ in range(50))


def test_overrides_load_back_as_the_same_values():
    from hybridflow.config.load import load_config

    cfg = load_config(None, [override(LR, 1e-05), override("algorithm.adv_estimator", "grpo"),
                             override("data.train_batch_size", 16), override("data.shuffle", False)])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-05 and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.train_batch_size == 16 and cfg.data.shuffle is False


@pytest.mark.bad_input
@pytest.mark.parametrize("spec, message", [
    (f"{LR}~loguniform(1e-6,1e-4)", "is not KEY=KIND(ARGS)"),
    (f"{LR}=normal(0,1)", f"unknown kind 'normal' for {LR}"),
    (f"{LR}=loguniform(1e-6)", f"loguniform takes 2 bounds (low,high) for {LR}, got 1"),
    (f"{LR}=loguniform(0,1e-4)", f"loguniform needs 0 < low for {LR}"),
    (f"{LR}=uniform(1e-3,1e-4)", f"uniform needs low < high for {LR}"),
    (f"{LR}=uniform(a,1)", f"uniform takes numbers, got 'a' for {LR}"),
    ("data.train_batch_size=randint(8,16.5)", "randint takes integers, got 16.5 for data.train_batch_size"),
    ("algorithm.kl_ctrl.kl_coef=choice()", "choice needs at least one value for algorithm.kl_ctrl.kl_coef"),
    ("algorithm.kl_ctrl.kl_coef=choice(0.1,0.1)", "choice lists a value twice"),
    ("algorithm.kl_ctrl.kl_coef=grid(0.1,,0.2)", "an empty value"),
])
def test_bad_specs_name_the_spec_and_the_key(spec, message):
    with pytest.raises(SpaceError) as e:
        parse_dim(spec)
    assert message in str(e.value) and repr(spec) in str(e.value)


@pytest.mark.bad_input
def test_space_keys_are_checked_against_the_schema():
    with pytest.raises(SpaceError, match=r"actor_rollout_ref\.actor\.optim\.learning_rate is not a config key"):
        parse_space(["actor_rollout_ref.actor.optim.learning_rate=choice(1e-5)"], _valid)
    with pytest.raises(SpaceError, match=f"{LR} is swept twice"):
        parse_space([f"{LR}=choice(1e-5)", f"{LR}=grid(1e-4)"], _valid)
    with pytest.raises(SpaceError, match="no --space given"):
        parse_space([], _valid)


@pytest.mark.bad_input
def test_values_are_checked_against_the_config_loader_before_any_trial():
    from launch.sweep.run import check_space

    with pytest.raises(SpaceError, match=r"value 'many'.*data\.train_batch_size"):
        check_space(None, [], [parse_dim("data.train_batch_size=choice(8,many)")])
    with pytest.raises(SpaceError, match=r"'trainer\.ray' is a section of keys"):
        check_space(None, [], [parse_dim("trainer.ray=choice(1)")])


def test_table_best_and_status_by_hand():
    step = lambda s, v: {"training/global_step": s, "m": v}
    trials = [{"trial": "a", "overrides": {LR: 1e-5}, "history": [step(1, 0.2), step(2, 0.5), step(3, 0.4)]},
              {"trial": "b", "overrides": {LR: 1e-3}, "history": [step(1, 0.7)], "error": None},
              {"trial": "c", "overrides": {LR: -1.0}, "history": [], "error": "ValueError: lr must be >= 0"},
              {"trial": "d", "overrides": {LR: 1e-4}, "history": [{"training/global_step": 3}]}]
    rows = table_rows(trials, "m", "max", total_steps=3)
    assert [(r["best"], r["best_step"], r["steps"], r["status"]) for r in rows] == [
        (0.5, 2, 3, "DONE"), (0.7, 1, 1, "STOPPED"), (None, None, 0, "ERROR"), (None, None, 3, "DONE")]
    assert best_row(rows, "max")["trial"] == "b"
    assert best_row(table_rows(trials, "m", "min", 3), "min")["trial"] == "a"  # min over a's steps is 0.2
    assert best_of([step(1, 0.3), step(2, 0.3)], "m", "max") == (0.3, 1)  # the first of equals
    md = render_markdown(rows, "m", "max").splitlines()
    assert md[0].startswith("| trial | overrides | best m (max)") and "b **best**" in md[3]
    assert "ERROR: ValueError: lr must be >= 0" in md[4]
    assert best_row(table_rows(trials[2:3], "m", "max", 3), "max") is None
    long = table_rows([{**trials[2], "error": "E" * 500}], "m", "max", 3)
    assert "E" * 160 + "..." in render_markdown(long, "m", "max") and long[0]["error"] == "E" * 500


def test_first_line_unwraps_a_ray_task_error():
    from ray.exceptions import RayTaskError

    cause = ValueError("actor_rollout_ref.actor.optim.lr=-1.0 must be >= 0\nmore detail")
    wrapped = RayTaskError("run_trial", "Traceback ...\nValueError: ...", cause)
    assert first_line(wrapped) == "ValueError: actor_rollout_ref.actor.optim.lr=-1.0 must be >= 0"
    assert first_line(None) is None


# ---------------------------------------------------------------------------------------------- the real sweep
TINY = ("data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", "trainer.save_freq=-1",
        "trainer.total_training_steps=2", "trainer.logger=[jsonl]", "trainer.ray.object_store_memory=268435456",
        "trainer.ray.timeout_s=180", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1", "critic.megatron.tensor_model_parallel_size=1",
        # two trials' bundles (1 CPU for the trial's driver, 1 for its colocated actor+critic process) and no more
        "trainer.ray.num_cpus=4")
METRIC = "actor/grad_norm"  # differs between the two lrs at step 2 (the scores of 2 tiny steps tie)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from hybridflow.trainer.warmstart import prepare

    tmp = tmp_path_factory.mktemp("sweep")
    assets = prepare(tmp / "assets", sft_steps=2, train_size=256, test_size=16)
    out = tmp / "sweep"
    cmd = [sys.executable, "-m", "launch.sweep", "--config", str(REPO / "configs" / "ppo_tiny_cpu.yaml"),
           f"actor_rollout_ref.model.path={assets['model']}", f"data.train_files=[{assets['train']}]", *TINY,
           "--space", f"{LR}=grid(1e-5,1e-3,-1.0)", "--metric", METRIC, "--mode", "max", "--sweep-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    return out, proc.stdout


@pytest.mark.own_ray  # the sweep fixture runs Ray Tune (a local Ray of its own, in a subprocess)
@pytest.mark.slow
def test_two_trials_finish_a_bad_one_errors_and_the_table_lists_them(sweep):
    out, stdout = sweep
    rows = list(csv.DictReader(open(out / "results.csv")))
    by_lr = {float(r[LR]): r for r in rows}
    assert sorted(by_lr) == [-1.0, 1e-5, 1e-3]
    for lr in (1e-5, 1e-3):
        assert by_lr[lr]["status"] == "DONE" and by_lr[lr]["steps"] == "2"
    assert by_lr[-1.0]["status"] == "ERROR" and "actor_rollout_ref.actor.optim.lr" in by_lr[-1.0]["error"]
    for lr, r in by_lr.items():  # the printed table names every trial with its override
        assert f"| {r['trial']}" in stdout and f"{LR}={lr:.6g}" in stdout
    # each trial trained in a run directory of its own, named after it
    assert {p.name for p in (out / "trials").iterdir() if (p / "metrics.jsonl").is_file()} == {
        by_lr[1e-5]["trial"], by_lr[1e-3]["trial"]}


@pytest.mark.own_ray  # the sweep fixture runs Ray Tune (a local Ray of its own, in a subprocess)
@pytest.mark.slow
def test_best_is_the_max_of_the_trials_own_metrics_and_reloads(sweep):
    from hybridflow.config.load import load_config

    out, _ = sweep
    result = json.loads((out / "results.json").read_text())
    finished = [t for t in result["trials"] if t["status"] == "DONE"]
    # reference: what each step reported to Tune (Tune's progress.csv), not the trainer's metrics.jsonl
    own = {}
    for t in finished:
        reported = list(csv.DictReader(open(out / t["trial"] / "progress.csv")))
        assert [float(r["training/global_step"]) for r in reported] == [1.0, 2.0]  # every step was reported
        own[t["trial"]] = max(float(r[METRIC]) for r in reported)
    for t in finished:
        assert t["best"] == pytest.approx(own[t["trial"]], rel=1e-12)
    assert len(set(own.values())) == 2, own  # the two lrs really differ, so the choice below means something
    best_trial = max(own, key=own.get)
    assert result["best"] == best_trial
    best_lr = next(t["overrides"][LR] for t in finished if t["trial"] == best_trial)
    cfg = load_config(out / "best.yaml")  # what `python -m hybridflow.trainer.main --config best.yaml` loads
    assert cfg.actor_rollout_ref.actor.optim.lr == best_lr
    assert cfg.trainer.total_training_steps == 2 and cfg.actor_rollout_ref.rollout.name == "hf"  # the base overrides
    assert not cfg.trainer.default_local_dir.startswith(str(out / "trials"))  # not a trial's run directory


@pytest.mark.own_ray  # the sweep fixture runs Ray Tune (a local Ray of its own, in a subprocess)
@pytest.mark.slow
def test_resume_restores_the_sweep_without_rerunning_finished_trials(sweep):
    out, _ = sweep
    before = {p.name: (p / "metrics.jsonl").read_text() for p in (out / "trials").iterdir()
              if (p / "metrics.jsonl").is_file()}
    table = (out / "results.md").read_text()
    proc = subprocess.run([sys.executable, "-m", "launch.sweep", "--resume", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "results.md").read_text() == table
    assert {p.name: (p / "metrics.jsonl").read_text() for p in (out / "trials").iterdir()
            if (p / "metrics.jsonl").is_file()} == before


@pytest.mark.bad_input
def test_resume_of_a_directory_that_is_no_sweep(tmp_path):
    from launch.sweep.run import run_sweep

    with pytest.raises(FileNotFoundError, match="no sweep.json there"):
        run_sweep(resume=str(tmp_path))


def _spec(tmp_path, space: list[str], metric: str = "critic/score/mean", overrides=()):
    from launch.sweep.run import sweep_spec

    return sweep_spec(None, list(overrides), space, tmp_path / "sweep", metric, "max", 1, "fifo", 1, 2, 0, None)


@pytest.mark.bad_input
def test_a_space_that_changes_the_pools_or_a_multi_node_trial_is_refused_before_any_trial(tmp_path):
    from launch.sweep.run import prepare

    with pytest.raises(ValueError, match=r"change a trial's pools.*trainer\.n_gpus_per_node=1.*n_gpus_per_node=2"):
        prepare(_spec(tmp_path, ["trainer.n_gpus_per_node=choice(1,2)"]))
    with pytest.raises(ValueError, match=r"trainer\.nnodes=2: a sweep trial runs on one node"):
        prepare(_spec(tmp_path, [f"{LR}=choice(1e-5)"], overrides=["trainer.nnodes=2"]))
    with pytest.raises(ValueError, match=r"--metric val-core/x/reward/mean@1 is a validation metric.*test_freq > 0"):
        prepare(_spec(tmp_path, [f"{LR}=choice(1e-5)"], "val-core/x/reward/mean@1",
                      ["data.val_files=[]", "trainer.test_freq=-1"]))
    with pytest.raises(ValueError, match="--mode 'best': choose max or min"):
        from launch.sweep.run import sweep_spec

        sweep_spec(None, [], [f"{LR}=choice(1e-5)"], tmp_path, "m", "best", 1, "fifo", 1, 2, 0, None)
    assert not (tmp_path / "sweep").exists()  # nothing was started or written
