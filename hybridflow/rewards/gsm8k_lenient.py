"""A lenient GSM8K reward (data_source "gsm8k_lenient"): the model's final number, compared as a number.

Not verl's scorer: `hybridflow.rewards.gsm8k` is, and it scores "openai/gsm8k". This one
forgives what verl does not: any whitespace after `####` ('####18'), a dollar sign
('#### $1,234.50'), a trailing period ('#### 18.') and a different spelling of the same
number ('#### 18.00' for 18, '.5' for 0.5), and it reads the whole text rather than its
last 300 characters. Use it to score a model fairly on the number; use "openai/gsm8k"
when the figure must mean what it means in verl.

"strict" trusts only the `#### <number>` line that the prompt asks for, so a model
earns reward for the format as well as the number; "flexible" takes the last number
anywhere in the text (useful to evaluate models that were never taught the format).
"""

from __future__ import annotations

import re
from fractions import Fraction

DATA_SOURCE = "gsm8k_lenient"

# An optional sign and dollar sign, then digits with thousands commas and decimals, or '.5'.
_NUMBER = r"-?(?:\$\s*)?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)


def _clean(number: str) -> str:
    """'$1,234.50' -> '1234.50'; '-$ 3' -> '-3'."""
    text = number.replace(",", "").replace("$", "").replace(" ", "")
    return text.rstrip(".")


def extract_solution(text: str, method: str = "strict") -> str | None:
    """The final answer as a plain number string, or None when there is none."""
    if method == "strict":
        found = _STRICT.findall(text)
    elif method == "flexible":
        found = _ANY_NUMBER.findall(text)
    else:
        raise ValueError(f"unknown gsm8k extraction method {method!r}; use 'strict' or 'flexible'")
    return _clean(found[-1]) if found else None


def _same_number(a: str, b: str) -> bool:
    """Exact comparison, so '18' == '18.00' but '0.1' != '0.10000001'."""
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a == b


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` for the right number, `format_score` for a wrong one, 0 when no answer was found."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, _clean(str(ground_truth))) else format_score
