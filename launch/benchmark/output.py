"""How an ablation ends: its table, then one JSON line (the last line printed), also written to --out if given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(rendered: str, result: dict, out: str | None) -> int:
    print(rendered)
    line = json.dumps(result, sort_keys=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(line + "\n")
    print(line, flush=True)
    return 0
