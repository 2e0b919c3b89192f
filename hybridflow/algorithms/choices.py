"""One check for "this config string must be one of these names", shared by the loss code and validate()."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def require_choice(key: str, value: str, choices: Sequence[str]) -> None:
    """Raise ValueError naming `key`, the bad value, the nearest valid name and every valid name."""
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown {key}={value!r}{hint}; valid: {', '.join(choices)}")
