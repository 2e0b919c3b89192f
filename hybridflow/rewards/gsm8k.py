"""GSM8K rule reward (data_source "openai/gsm8k") that scores exactly as verl's `gsm8k.compute_score`.

A GSM8K score from verl and one from here must be the same number, so this follows
verl's rules (verl/utils/reward_score/gsm8k.py, called by `default_compute_score` with
method "strict", format_score 0.0, score 1.0), quirks included:

- Only the last 300 characters (str characters, not bytes or tokens) are read.
- A number is a run of ASCII digits, '.' and ',' with an optional leading '-'.
  No '+', no '$', no exponent, no Unicode digits or minus.
- strict: the last `#### <number>` with exactly one plain space after '####'
  ('####18', '####  18', '#### $18' find nothing). Commas are removed ('#### 1,234'
  gives '1234'); a trailing '.' stays ('#### 18.' gives '18.').
- flexible: the last number anywhere, as written: commas stay ('1,234') and so
  does a trailing period ('is 18.' gives '18.'). A lone '.' is skipped; if every
  number is a lone '.', the answer is '.'.
- The answer is compared as a string with ground_truth: '18.00', '18.' and '018'
  are all wrong for '18'.
- No answer found: 0.0, whatever format_score is. Found but wrong: format_score.
  Right: score.

The lenient scorer of earlier versions is `hybridflow.rewards.gsm8k_lenient`
(data_source "gsm8k_lenient"); it compares numbers, so it can score higher. For
example 'The total is #### $18.00.' against '18': 1.0 there, 0.0 here (strict finds
no number after '#### ' because of the '$'; flexible finds '18.00.').
"""

from __future__ import annotations

import re

DATA_SOURCE = "openai/gsm8k"
METHODS = ("strict", "flexible")

# verl reads the tail only (to keep its regexes fast on long generations); an answer before it is not seen.
TAIL_CHARS = 300

_NUMBER = r"-?[0-9.,]+"  # [0-9], not \d: \d would also match Arabic-Indic and other Unicode digits
_MARKED = re.compile("#### (" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)


def extract_solution(text: str, method: str = "strict") -> str | None:
    """The answer string verl would compare with the ground truth, or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"unknown gsm8k extraction method {method!r}; use 'strict' or 'flexible'")
    if not isinstance(text, str):
        raise TypeError(f"gsm8k solution must be a str, got {type(text).__name__}")
    tail = text[-TAIL_CHARS:]
    if method == "strict":
        marked = _MARKED.findall(tail)
        return marked[-1].replace(",", "") if marked else None
    numbers = _ANY.findall(tail)
    if not numbers:
        return None
    # Skip a sentence's full stop, matched as a number on its own; when there is nothing else, '.' it is.
    return next((n for n in reversed(numbers) if n != "."), ".")


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the answer string equals ground_truth, `format_score` if it differs, 0 when none was found."""
    if not isinstance(ground_truth, str):
        # verl would compare a str with it, never equal: every sample silently wrong. Say so instead.
        raise TypeError(f"gsm8k ground_truth must be a str such as '72', got {type(ground_truth).__name__} "
                        f"{ground_truth!r}")
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
