"""GSM8K scores must equal verl's: hand-reasoned cases from verl/utils/reward_score/gsm8k.py (volcengine/verl).

verl's rules, which every expectation below is reasoned from (not from our output):
  * it reads only solution_str[-300:] (Python str characters);
  * strict: the last match of '#### ' (one plain space) + '-'? + one or more of [0-9 . ,], then ',' removed;
  * flexible: the last match of '-'? + [0-9 . ,]+ anywhere, kept as written, skipping a lone '.';
    if every match is a lone '.', the answer is '.' (its loop variable keeps the last one it looked at);
  * answer None -> 0; answer == ground_truth (string equality) -> score; otherwise -> format_score;
  * default_compute_score calls it for "openai/gsm8k" with method 'strict', format_score 0.0, score 1.0.
"""

import numpy as np
import pytest

from hybridflow.rewards import gsm8k, gsm8k_lenient, manager
from hybridflow.rewards.manager import RewardManager

FS = 0.1  # a format_score that tells "parsed but wrong" (FS) apart from "nothing parsed" (0.0)
R, W, N = 1.0, FS, 0.0  # right, wrong answer found, no answer found

PAD = "x" * 294  # no digits, dots or commas: it only moves the 300-character window

CASES = [
    # (solution_str, ground_truth, strict, flexible, why)
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72", R, R, "the marker and the last number are both 72"),
    ("#### -5", "-5", R, R, "an optional leading '-' belongs to the number"),
    ("####72", "72", N, R, "strict needs '#### ' with a space; flexible sees 72"),
    ("####  72", "72", N, R, "two spaces: after '#### ' comes a space, not a digit"),
    ("####\t72", "72", N, R, "a tab is not the one plain space strict wants"),
    ("####\n72", "72", N, R, "nor is a newline"),
    ("#### $72", "72", N, R, "'$' is not in [0-9.,], so strict finds nothing; flexible's token is 72"),
    ("#### +72", "72", N, R, "'+' is no sign to verl; flexible's token is 72"),
    ("##### 72", "72", R, R, "'#### 72' starts at the second '#'"),
    ("#### 72.", "72", W, W, "the trailing '.' is part of the token: '72.' != '72'"),
    ("#### 72.00", "72", W, W, "strings, not numbers: '72.00' != '72'"),
    ("#### 072", "72", W, W, "a leading zero makes another string"),
    ("#### .5", "0.5", W, W, "'.5' != '0.5'"),
    ("#### 0.5", "0.5", R, R, "the same string"),
    ("#### 1,234", "1234", R, W, "strict drops commas; flexible keeps '1,234'"),
    ("#### 1,234", "1,234", W, R, "a ground truth with a comma can never match strict's comma-free answer"),
    ("#### -1,000", "-1000", R, W, "sign kept, comma dropped by strict only"),
    ("#### 1,2,3,4", "1234", R, W, "strict drops every comma, wherever it is"),
    ("#### 72,", "72", R, W, "strict: '72,' -> '72'; flexible keeps '72,'"),
    ("#### ,72", "72", R, W, "strict: ',72' -> '72'; flexible keeps ',72'"),
    ("#### 72 dollars", "72", R, R, "the token ends at the space"),
    ("#### 72\nThat is all.", "72", R, R, "flexible skips the full stop, a lone '.' token"),
    ("The answer is 72.", "72", N, W, "no marker; flexible's token is '72.'"),
    ("The answer is 72 .", "72", N, R, "the lone '.' is skipped and 72 is the last number"),
    ("The answer is 72...", "72", N, W, "'72...' is one token; only a lone '.' is skipped"),
    ("Answer: **72**", "72", N, R, "no marker; the only token is 72"),
    ("So 7 in all, right?", "7", N, W, "the lone ',' is a token, and only '.' is skipped, so ',' is the answer"),
    ("first #### 10 then #### 72", "72", R, R, "strict takes the last marker"),
    ("#### 72 no wait #### 10", "72", W, W, "the last marker says 10"),
    ("#### 7 2", "72", W, W, "strict reads '7'; flexible's last token is '2'"),
    ("#### 72-3", "72", R, W, "strict's token stops at '-'; flexible's last token is '-3'"),
    ("#### - 72", "72", N, R, "'-' must touch the digits; flexible finds 72"),
    ("#### --72", "72", N, W, "strict: '-' then '-' is no number; flexible's token is '-72'"),
    ("#### \u221272", "-72", N, W, "U+2212 minus is not '-': flexible reads '72'"),
    ("#### \uff17\uff12", "72", N, N, "full-width digits are not [0-9]"),
    ("#### 1e3", "1000", W, W, "no exponents: strict reads '1', flexible '3'"),
    ("#### 72", "72 ", W, W, "the ground truth is not stripped"),
    ("Total: $1,200.", "1200", N, W, "flexible keeps comma and full stop: '1,200.'"),
    ("the change is -3", "-3", N, R, "flexible keeps the sign"),
    ("5 - 3 = 2", "2", N, R, "a '-' followed by a space is no token; the last number is 2"),
    ("", "72", N, N, "nothing at all"),
    ("no numbers here", "72", N, N, "no token of [0-9.,]"),
    ("I don't know.", "72", N, W, "the only token is '.', so flexible answers '.': format_score, not 0"),
    ("Hmm, not sure", "72", N, W, "the only token is ',', an answer"),
    ("#### .", "72", W, W, "strict does not skip '.': an answer, wrong"),
    ("#### ,", "72", W, W, "strict's answer is '' once the comma is dropped: not None, so wrong, not absent"),
    # the 300-character window
    ("#### 72" + PAD[:293], "72", R, R, "300 characters: read whole"),
    ("#### 72" + PAD, "72", N, R, "301 characters: the first '#' is cut, '### 72' is no marker"),
    ("#### 72" + "\u00e9" * 293, "72", R, R, "300 characters but 593 UTF-8 bytes: the window counts characters"),
    ("1234" + " " * 298, "1234", N, W, "302 characters: the window starts inside the number, at '34'"),
    ("1234" + " " * 298, "34", N, R, "so flexible answers '34'"),
    ("#### 72\n" + "x" * 400, "72", N, N, "the answer lies before the last 300 characters"),
    ("step 1: 5 apples. " * 50 + "#### 72", "72", R, R, "a long solution whose marker is in the window"),
]


@pytest.mark.parametrize("text,truth,strict,flexible,why", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_matches_verl_in_both_modes(text, truth, strict, flexible, why):
    assert gsm8k.compute_score(text, truth, method="strict", format_score=FS) == strict, why
    assert gsm8k.compute_score(text, truth, method="flexible", format_score=FS) == flexible, why
    # verl's defaults (format_score 0.0, score 1.0): only a right answer scores
    assert gsm8k.compute_score(text, truth) == (1.0 if strict == R else 0.0), why
    assert gsm8k.compute_score(text, truth, method="flexible") == (1.0 if flexible == R else 0.0), why


def test_enough_cases_of_each_kind():
    assert len(CASES) >= 40
    for column in (2, 3):
        assert {case[column] for case in CASES} == {R, W, N}


@pytest.mark.parametrize(
    "text,strict,flexible",
    [
        ("#### 1,234", "1234", "1,234"),  # strict removes commas, flexible does not
        ("I don't know.", None, "."),  # only lone dots: the answer is '.'
        ("Hmm, no", None, ","),
        ("#### ,", "", ","),
        ("#### 72\nThat is all.", "72", "72"),
        ("It is 3 . Then 4.", None, "4."),  # the last token '4.' keeps its dot (only a lone '.' is skipped)
        ("#### 72" + PAD, None, "72"),
    ],
)
def test_extracted_strings(text, strict, flexible):
    assert gsm8k.extract_solution(text, "strict") == strict
    assert gsm8k.extract_solution(text, "flexible") == flexible


def test_format_score_and_score():
    # nothing parsed -> 0 whatever format_score is; parsed but wrong -> format_score; right -> score
    assert gsm8k.compute_score("no answer", "72", format_score=0.5) == 0.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.5) == 0.5
    assert gsm8k.compute_score("#### 72", "72", format_score=0.5, score=2.0) == 2.0
    assert gsm8k.compute_score("#### 71", "72") == 0.0  # default format_score is 0.0
    assert gsm8k.compute_score("the answer is 72", "72") == 0.0  # default method is strict
    assert gsm8k.compute_score("the answer is 72", "72", method="flexible") == 1.0
    assert type(gsm8k.compute_score("no answer", "72")) is float  # verl returns int 0; its dispatcher makes it float


@pytest.mark.bad_input
def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown gsm8k extraction method 'loose'"):
        gsm8k.compute_score("#### 1", "1", method="loose")
    with pytest.raises(TypeError, match="ground_truth must be a str such as '72', got int 72"):
        gsm8k.compute_score("#### 72", 72)
    with pytest.raises(TypeError, match="solution must be a str, got NoneType"):
        gsm8k.compute_score(None, "72")
    assert gsm8k.compute_score("#### 72", np.str_("72")) == 1.0  # numpy strings from parquet columns are str


def test_manager_routes_default_source_to_verl_and_lenient_to_lenient():
    assert manager.BUILTIN_SCORERS["openai/gsm8k"] is gsm8k.compute_score
    assert manager.BUILTIN_SCORERS["gsm8k_lenient"] is gsm8k_lenient.compute_score
    # '$' after the marker: verl's strict finds no answer (0); the lenient scorer reads 72.00 == 72 (1)
    text = "The total is #### $72.00."
    scores, metrics = RewardManager().score([text, text, "#### 72", "#### 72"], ["72"] * 4,
                                            ["openai/gsm8k", "gsm8k_lenient", "openai/gsm8k", "gsm8k_lenient"])
    np.testing.assert_array_equal(scores, np.array([0.0, 1.0, 1.0, 1.0], dtype=np.float32))
    assert metrics["reward/num_errors"] == 0


def test_manager_counts_a_non_string_ground_truth_as_an_error():
    scores, metrics = RewardManager().score(["#### 72"], [72], ["openai/gsm8k"])
    assert scores.tolist() == [0.0] and metrics["reward/num_errors"] == 1
