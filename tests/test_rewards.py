"""Rule rewards on hand-written cases, and a RewardManager that survives raising and hanging scorers."""

import time

import numpy as np
import pytest
import torch

from hybridflow.config.schema import CustomRewardConfig
from hybridflow.rewards import gsm8k_lenient, manager, math_answer, synthetic
from hybridflow.rewards.manager import RewardManager, scores_to_token_level
from hybridflow.rewards.user_fn import load_reward_fn

# ---------------------------------------------------------- gsm8k_lenient (verl's rules: test_rewards_gsm8k_verl.py)


@pytest.mark.parametrize(
    "text,strict,flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        ("Total: #### $1,234.50.", "1234.50", "1234.50"),
        ("#### -3", "-3", "-3"),
        ("first 5, then 12 apples.", None, "12"),
        ("#### 1 wait, no: #### 2", "2", "2"),
        ("no numbers", None, None),
        ("costs $.5 each", None, ".5"),
    ],
)
def test_gsm8k_lenient_extraction(text, strict, flexible):
    assert gsm8k_lenient.extract_solution(text, "strict") == strict
    assert gsm8k_lenient.extract_solution(text, "flexible") == flexible


def test_gsm8k_lenient_score():
    assert gsm8k_lenient.compute_score("so #### 72", "72") == 1.0
    assert gsm8k_lenient.compute_score("so #### 72.00", "72") == 1.0  # same number
    assert gsm8k_lenient.compute_score("so #### 5,000", "5000") == 1.0
    assert gsm8k_lenient.compute_score("the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k_lenient.compute_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k_lenient.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_lenient.compute_score("nothing", "72", format_score=0.1) == 0.0
    assert gsm8k_lenient.compute_score("#### 72", "72", score=2.0) == 2.0
    with pytest.raises(ValueError, match="unknown gsm8k extraction method 'loose'"):
        gsm8k_lenient.extract_solution("#### 1", "loose")


# ---------------------------------------------------------------- MATH


def test_last_boxed_handles_nesting_and_forms():
    text = r"first \boxed{1} then $\boxed{\frac{\sqrt{3}}{2}}$."
    assert math_answer.last_boxed(text) == r"\frac{\sqrt{3}}{2}"
    assert math_answer.last_boxed(r"so $\boxed 5$") == "5"
    assert math_answer.last_boxed(r"\fbox{x+1}") == "x+1"
    assert math_answer.last_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced
    assert math_answer.last_boxed("the answer is 5") is None


@pytest.mark.parametrize(
    "a,b",
    [
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        (r"\dfrac{1}{2}", r"\frac12"),
        (r"\tfrac{3}{4}", "3/4"),
        ("0.5", r"\frac{1}{2}"),
        (".5", "0.5"),
        (r"-\frac{3}{4}", "-0.75"),
        (r"10\%", "10"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"5 \text{ cm}^2", "5"),
        (r"12\text{ inches}", "12"),
        (r"\text{(A)}", "(A)"),
        ("x = 5", "5"),
        (r"\$1,000", "1000"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt3}{2}"),
        ("12.", "12"),
        (r"3\!\cdot\!5", r"3\cdot5"),
        (r"x \rightarrow 2", r"x\rightarrow2"),  # \right removal must not eat \rightarrow
    ],
)
def test_math_equivalent(a, b):
    assert math_answer.is_equiv(a, b)
    assert math_answer.is_equiv(b, a)


@pytest.mark.parametrize(
    "a,b",
    [
        (r"\frac{1}{3}", "0.333"),  # exact rationals only
        ("3", "4"),
        ("1,2", "12"),  # a list is not a thousands separator
        (r"\sqrt{2}", r"\sqrt{3}"),
        ("x+1", "x-1"),
        (None, "1"),
        (None, None),
    ],
)
def test_math_not_equivalent(a, b):
    assert not math_answer.is_equiv(a, b)


def test_math_score():
    assert math_answer.compute_score(r"Thus $\boxed{\dfrac{3}{4}}$.", r"\frac34") == 1.0
    assert math_answer.compute_score(r"\boxed{4}", r"The area is $\boxed{4}$.") == 1.0  # boxed reference
    assert math_answer.compute_score(r"\boxed{5}", "4") == 0.0
    assert math_answer.compute_score("4", "4") == 0.0  # no box, no credit


# ---------------------------------------------------------------- synthetic reverse task


def test_reverse_score_is_graded():
    assert synthetic.compute_score("k9a3", "k9a3") == 1.0
    assert synthetic.compute_score(" k9a3\nmore text", "k9a3") == 1.0
    assert synthetic.compute_score("k9a3</s><pad>", "k9a3") == 1.0
    assert synthetic.compute_score("k9a0", "k9a3") == 0.75
    assert synthetic.compute_score("k9a", "k9a3") == 0.75  # missing char
    assert synthetic.compute_score("k9a3x", "k9a3") == 0.8  # an extra char: never 1.0
    assert synthetic.compute_score("3a9k", "k9a3") == 0.0
    assert synthetic.compute_score("", "k9a3") == 0.0
    assert synthetic.make_prompt("3a9k") == "reverse: 3a9k"


# ---------------------------------------------------------------- user functions


def _write(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_load_reward_fn_and_its_errors(tmp_path):
    path = _write(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"
                  "not_a_fn = 3\n")
    assert load_reward_fn(path, "score")("x", "y", "z", None) == 0.5
    with pytest.raises(AttributeError, match=r"my_reward.py' has no function 'compute_score'; it defines: \['score'\]"):
        load_reward_fn(path, "compute_score")
    with pytest.raises(TypeError, match="'not_a_fn' in custom reward file .*my_reward.py' is a int"):
        load_reward_fn(path, "not_a_fn")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward_fn(str(tmp_path / "missing.py"), "score")
    broken = _write(tmp_path, "import not_a_real_module_xyz\n", "broken.py")
    with pytest.raises(ImportError, match="broken.py' failed: ModuleNotFoundError"):
        load_reward_fn(broken, "score")


# ---------------------------------------------------------------- manager


def test_manager_dispatches_on_data_source():
    mgr = RewardManager()
    scores, metrics = mgr.score(
        responses=["#### 72", r"so \boxed{\frac12}", "k9a0", r"\boxed{0.5}", "#### 1"],
        ground_truths=["72", "0.5", "k9a3", r"\frac{1}{2}", "2"],
        data_sources=["openai/gsm8k", "lighteval/MATH", "hybridflow/reverse", "DigitalLearningGmbH/MATH-lighteval",
                      "openai/gsm8k"],
    )
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, np.array([1.0, 1.0, 0.75, 1.0, 0.0], dtype=np.float32))
    assert metrics["reward/num_errors"] == 0 and metrics["reward/num_timeouts"] == 0
    assert metrics["reward/mean"] == pytest.approx(3.75 / 5)


def test_manager_unknown_source_fails_before_scoring(monkeypatch):
    calls = []
    monkeypatch.setitem(manager.BUILTIN_SCORERS, "openai/gsm8k", lambda *a: calls.append(a) or 1.0)
    mgr = RewardManager()
    with pytest.raises(ValueError, match=r"data_source \['my/dataset'\]; known: .*openai/gsm8k"):
        mgr.score(["#### 1", "x"], ["1", "x"], ["openai/gsm8k", "my/dataset"])
    assert calls == []  # nothing was scored
    mgr.score(["#### 1"], ["1"], ["openai/gsm8k"])
    assert len(calls) == 1  # the patch is live, so the check above means something
    with pytest.raises(ValueError, match="differ in length"):
        mgr.score(["a"], ["a", "b"], ["openai/gsm8k"])


@pytest.mark.serial  # timing: 0.5 s timeouts, 3 s for all
def test_user_function_overrides_all_and_failures_stay_per_sample(tmp_path):
    path = _write(tmp_path, (
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str == 'raise':\n"
        "        raise RuntimeError('boom')\n"
        "    if solution_str == 'sleep':\n"
        "        time.sleep(30)\n"
        "    if solution_str == 'nan':\n"
        "        return float('nan')\n"
        "    if solution_str == 'dict':\n"
        "        return {'score': 0.25, 'acc': True}\n"
        "    return float(solution_str == ground_truth) + extra_info['bonus']\n"
    ))
    mgr = RewardManager.from_config(CustomRewardConfig(path=path, timeout_s=0.5), num_workers=2)
    responses = ["a", "raise", "sleep", "b", "nan", "sleep", "dict", "c"]
    start = time.monotonic()
    scores, metrics = mgr.score(
        responses,
        ground_truths=["a", "x", "x", "x", "x", "x", "x", "c"],
        data_sources=["unknown/source"] * 8,  # the user function takes every source
        extra_infos=[{"bonus": 0.5}] * 8,
    )
    elapsed = time.monotonic() - start
    np.testing.assert_array_equal(scores, np.array([1.5, 0, 0, 0.5, 0, 0, 0.25, 1.5], dtype=np.float32))
    assert metrics["reward/num_errors"] == 2  # raise + nan
    assert metrics["reward/num_timeouts"] == 2
    # Two sleepers, two workers: each waits its own 0.5 s, others keep flowing; far from 30 s.
    assert elapsed < 3.0


@pytest.mark.serial  # timing: 0.2 s timeouts, 1.4 s for all
def test_all_samples_hanging_still_returns():
    mgr = RewardManager(compute_score=lambda *a: time.sleep(60), timeout_s=0.2, num_workers=4)
    start = time.monotonic()
    scores, metrics = mgr.score(["a"] * 8, ["a"] * 8, ["s"] * 8)
    assert time.monotonic() - start < 0.2 * 2 + 1.0  # two waves of four
    assert metrics["reward/num_timeouts"] == 8 and not scores.any()


def test_scores_to_token_level():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 1, 0]])
    out = scores_to_token_level(np.array([0.5, 1.0, -1.0, 2.0]), mask)
    expected = torch.zeros(4, 5)
    expected[0, 2], expected[1, 4], expected[2, 0], expected[3, 3] = 0.5, 1.0, -1.0, 2.0
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"rows \[1\] have no valid response token"):
        scores_to_token_level([1.0, 1.0], torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"\(3,\) scores for a response_mask of 2 rows"):
        scores_to_token_level([1.0, 1.0, 1.0], torch.tensor([[1, 0], [1, 1]]))
