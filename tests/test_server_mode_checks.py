"""Server mode's and multi-turn's bad input fails before Ray starts, naming the key or the tool file
(hybridflow/config/server_mode_checks.py, called by preflight); no workers here."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config.load import load_config

pytestmark = pytest.mark.bad_input
REPO = Path(__file__).resolve().parents[1]
AGENT = ("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=true",
         "actor_rollout_ref.rollout.multi_turn.format=compact")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from hybridflow.data.lookup import make_lookup_rows
    from hybridflow.data.synthetic import write_parquet
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("server_mode_checks")
    write_parquet(make_lookup_rows(8, seed=0), root / "train.parquet")
    return {"root": root, "model": save_tiny_model(root / "policy"), "data": root / "train.parquet"}


def _validate(files, *overrides):
    from hybridflow.trainer.main import validate

    cfg = load_config(None, [f"actor_rollout_ref.model.path={files['model']}", f"data.train_files=[{files['data']}]",
                             *overrides])
    validate(cfg)
    return cfg


def _tools(files, name: str, text: str) -> str:
    path = files["root"] / name
    path.write_text(text)
    return f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"


def test_a_good_agent_config_passes(files):
    tools = f"actor_rollout_ref.rollout.multi_turn.tool_config_path={REPO}/configs/tools/lookup.py"
    cfg = _validate(files, *AGENT, tools)
    assert cfg.actor_rollout_ref.rollout.mode == "async"


def test_server_mode_takes_several_replicas_of_tg_above_one(files):
    """vLLM data-parallel replicas (2 of t_g=2 here) step in lockstep in server mode (tests/test_server_mode_dp.py)."""
    cfg = _validate(files, *AGENT, "trainer.n_gpus_per_node=4",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


@pytest.mark.parametrize("overrides, match", [
    (("actor_rollout_ref.rollout.multi_turn.enable=true",),
     r"multi_turn.enable=true needs the server mode: set actor_rollout_ref.rollout.mode=async"),
    ((*AGENT, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"),
     r"actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0 must be >= 1"),
    ((*AGENT, "actor_rollout_ref.rollout.response_length=8", "data.max_response_length=8",
      "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=16"),
     r"actor_rollout_ref.rollout.response_length=8 .* is smaller than one turn .*max_tokens_per_turn=16"),
    (("actor_rollout_ref.rollout.mode=asynch",),
     r"unknown actor_rollout_ref.rollout.mode='asynch' \(did you mean 'async'"),
    ((*AGENT[:2], "actor_rollout_ref.rollout.multi_turn.format=hermess"),
     r"unknown actor_rollout_ref.rollout.multi_turn.format='hermess'"),
    (("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.name=hf"),
     r"mode=async serves from vLLM's engine loop; actor_rollout_ref.rollout.name='hf'"),
    ((*AGENT, "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=0"),
     r"actor_rollout_ref.rollout.multi_turn.tool_timeout_s=0.0 must be > 0"),
    (("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.agent.max_steps_per_tick=0"),
     r"actor_rollout_ref.rollout.agent.max_steps_per_tick=0 must be >= 1"),
])
def test_bad_server_mode_keys_are_named(files, overrides, match):
    with pytest.raises(ValueError, match=match):
        _validate(files, *overrides)


def test_a_tool_file_that_does_not_import_is_named(files):
    bad = _tools(files, "broken_tools.py", "import no_such_module_here\n\ndef f(x: str) -> str:\n    '''f.'''\n")
    with pytest.raises(ValueError, match=r"broken_tools.py.*(No module named|no_such_module_here)"):
        _validate(files, *AGENT, bad)


def test_two_tools_of_one_name_are_named(files):
    one = files["root"] / "one.py"
    one.write_text("def lookup(key: str) -> str:\n    '''One lookup.'''\n    return key\n")
    yaml = _tools(files, "tools.yaml", f"tools:\n  - path: {one}\n    function: lookup\n"
                                       f"  - path: {one}\n    function: lookup\n")
    with pytest.raises(ValueError, match=r"tools.yaml: two tools named 'lookup'"):
        _validate(files, *AGENT, yaml)


def test_a_tool_without_a_docstring_is_named(files):
    bad = _tools(files, "nodoc.py", "def lookup(key: str) -> str:\n    return key\n")
    with pytest.raises(ValueError, match=r"nodoc.py.*lookup.*docstring"):
        _validate(files, *AGENT, bad)
