"""The agent demo's task: answer with a key's secret value, which only the `lookup` tool knows.

The prompt names a key ("key: qzr"); the value is three digits from a hash of the key, so no policy can
compute it and a tiny model cannot memorise it for held-out keys: a guess is right 1 time in 1000. The tool
(configs/tools/lookup.py, run in the sandbox) returns the value. The score is 1 when the response's last
assistant turn is exactly the value, else 0.
"""

from __future__ import annotations

import hashlib

DATA_SOURCE = "hybridflow/lookup"
PROMPT_PREFIX = "key: "


def make_prompt(key: str) -> str:
    return PROMPT_PREFIX + key


def secret(key: str) -> str:
    """The value of `key`: three digits of its SHA-256 (configs/tools/lookup.py computes the same; a test checks)."""
    return f"{int(hashlib.sha256(key.encode()).hexdigest(), 16) % 1000:03d}"


def final_answer(solution_str: str) -> str:
    """The text after the last tool call's closing parenthesis (the compact format's `@lookup(key)`), or the
    whole response when it made none, up to a newline or an end-of-sequence string, stripped."""
    tail = solution_str.rsplit(")", 1)[-1]
    for marker in ("\n", "</s>"):
        tail = tail.split(marker, 1)[0]
    return tail.strip()


def compute_score(solution_str: str, ground_truth: str) -> float:
    return 1.0 if final_answer(solution_str) == str(ground_truth) else 0.0
