"""The project's synthetic task: reverse a short string ("reverse: 3a9k" -> "k9a3").

A tiny character-level model learns it on CPU in minutes, so end-to-end RL runs
can show a rising reward without a GPU. The score is graded (the fraction of
positions right) rather than 0/1, so even a nearly random policy gets a signal.
"""

from __future__ import annotations

DATA_SOURCE = "hybridflow/reverse"
PROMPT_PREFIX = "reverse: "
# The answer ends at the first of these; what follows is ignored (the eos string shows up
# when responses are decoded with skip_special_tokens=False).
ANSWER_END = ("\n", "</s>")


def make_prompt(text: str) -> str:
    return PROMPT_PREFIX + text


def read_answer(solution_str: str) -> str:
    """The response up to the first newline or eos, without surrounding spaces."""
    end = len(solution_str)
    for marker in ANSWER_END:
        at = solution_str.find(marker)
        if at >= 0:
            end = min(end, at)
    return solution_str[:end].strip()


def compute_score(solution_str: str, ground_truth: str) -> float:
    """Fraction of positions matching, over the longer of answer and truth: 1.0 only for an exact match.

    Dividing by the longer length penalises both missing and extra characters.
    """
    answer, truth = read_answer(solution_str), str(ground_truth)
    longest = max(len(answer), len(truth))
    if longest == 0:
        return 1.0
    return sum(a == t for a, t in zip(answer, truth)) / longest
