"""verl's example scripts against our loader, and the generated tables of docs/verl.md ("Coming from verl").

`classify_lines` loads a script's override lines with `hybridflow.config.load` and sorts each into accepted, ignored
(a verl_compat rule drops it), refused (with what to write instead) or unknown; `fixture_counts` does so for every
script under tests/data/verl_overrides. The page's tables (defaults that differ from verl's, verl keys that are not
ours: hybridflow/config/verl_compat.py's DIFFERENCES and RULES; the scripts' counts) come from here:
`python -m hybridflow.config.verl_scripts --write` rewrites them, and tests/test_verl_compat.py keeps the page
equal to them. Apart from verl_compat, which the loader consults, so that the loader does not import itself back.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from omegaconf import OmegaConf

from hybridflow.config.load import ConfigError, load_config, to_dict
from hybridflow.config.verl_compat import DIFFERENCES, markdown_cell, markdown_table

# The page that shows both tables (a checkout's docs/; not part of an installed package).
PAGE = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
# verl's own example command lines, expanded (tests/data/verl_overrides/expand.py); the page counts their keys.
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "data" / "verl_overrides"
CLASSES = ("accepted", "ignored", "refused", "unknown")


def differences_table() -> str:
    """DIFFERENCES as the markdown table in docs/verl.md, with our defaults read from the schema."""
    ours = OmegaConf.create(to_dict(load_config()))
    rows = ["| key | verl default | default here | what differs |", "|---|---|---|---|"]
    for d in DIFFERENCES:
        value = OmegaConf.select(ours, d.key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        rows.append(f"| `{d.key}` | `{d.verl}` | `{value}` | {markdown_cell(d.note)} |")
    return "\n".join(rows)


def read_fixture(path: Path) -> tuple[dict[str, str], list[str]]:
    """(header fields: source, commit, model, ...; the override lines) of one fixture file."""
    text = Path(path).read_text()
    header = dict(m.groups() for m in re.finditer(r"^# ([\w-]+): (.+)$", text, re.M))
    return header, [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


_KEY_IN = {  # the key each kind of load_config problem names
    "refused": re.compile(r"verl key '([^'=]+)="),
    "unknown": re.compile(r"unknown config key '([^']+)'|unknown Megatron \w+ field '[^']+' in '([^']+)'"),
    "accepted": re.compile(r"invalid value for config key '([^']+)'"),  # ours, with a value it cannot hold
}


def _key(line: str) -> str:
    return line.split("=", 1)[0].lstrip("+")


def classify_lines(lines: list[str]) -> dict[str, str]:
    """{line: accepted | ignored | refused | unknown}: what load_config does with each `key=value` override of one
    command line, from a few loads of the whole line (each problem names its key; each ignored key warns once).
    A key of ours whose value the loader cannot hold (e.g. an unset shell variable) counts as accepted."""
    out: dict[str, str] = {}
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("hybridflow.config.load")
    logger.addHandler(handler)
    try:
        pending = list(lines)
        while True:
            seen.clear()
            try:
                load_config(None, pending)
                break
            except ConfigError as e:
                named = {kind: {k for m in rx.finditer(str(e)) for k in m.groups() if k}
                         for kind, rx in _KEY_IN.items()}
                hit = {line: kind for line in pending for kind, keys in named.items() if _key(line) in keys}
                if not hit:
                    raise
                out.update(hit)
                pending = [line for line in pending if line not in hit]
    finally:
        logger.removeHandler(handler)
    warned = {m.removeprefix("ignoring verl key ").split(":", 1)[0].split("=", 1)[0] for m in seen
              if m.startswith("ignoring verl key ")}
    out.update({line: "ignored" if _key(line) in warned else "accepted" for line in pending})
    return out


def fixture_counts() -> dict[str, dict[str, int]]:
    """{fixture file name: {class: lines}} over every fixture (classify_lines of each)."""
    out = {}
    for path in sorted(FIXTURES.glob("*.txt")):
        lines = read_fixture(path)[1]
        classes = classify_lines(lines)
        out[path.name] = {c: sum(classes[line] == c for line in lines) for c in CLASSES}
    return out


def counts_table(counts: dict[str, dict[str, int]]) -> str:
    """The per-script counts (fixture_counts, or the test's) as the markdown table in docs/verl.md."""
    rows = ["| verl script (examples/...) | commit | model | overrides | accepted | ignored | refused | unknown |",
            "|---|---|---|---|---|---|---|---|"]
    total = dict.fromkeys(CLASSES, 0)
    for name, c in counts.items():
        header, lines = read_fixture(FIXTURES / name)
        rows.append(f"| `{header['source'].split('examples/', 1)[1]}` | {header['commit'][:8]} | "
                    f"{markdown_cell(header.get('model', ''))} | {len(lines)} | "
                    + " | ".join(str(c[k]) for k in CLASSES) + " |")
        total = {k: total[k] + c[k] for k in CLASSES}
    rows.append(f"| all {len(counts)} scripts | | | {sum(total.values())} | "
                + " | ".join(str(total[k]) for k in CLASSES) + " |")
    return "\n".join(rows)


def replace_tables(text: str, counts: dict[str, dict[str, int]] | None = None) -> str:
    """`text` with each generated table, found by its header row, replaced by the current one (whole rows only).
    counts: the fixtures' per-script counts (None: fixture_counts())."""
    lines = text.split("\n")
    counts = fixture_counts() if counts is None else counts
    for table in (differences_table(), markdown_table(), counts_table(counts)):
        rows = table.split("\n")
        if rows[0] not in lines:
            raise ValueError(f"no table with the header {rows[0]!r} to replace")
        start = end = lines.index(rows[0])
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        lines[start:end] = rows
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m hybridflow.config.verl_scripts",
        description="Print the verl tables (differing defaults, verl keys that are not ours, and the keys of verl's "
                    "example scripts by class) as markdown, or rewrite them in the docs page.",
        epilog=f"tests/test_verl_compat.py keeps {PAGE} equal to them.")
    ap.add_argument("--write", nargs="?", const=str(PAGE), metavar="PAGE",
                    help=f"replace the tables in PAGE (default {PAGE}) instead of printing them")
    args = ap.parse_args(argv)
    if args.write:
        page = Path(args.write)
        page.write_text(replace_tables(page.read_text()))
        print(f"wrote {page}")
    else:
        print(differences_table(), markdown_table(), counts_table(fixture_counts()), sep="\n\n")


if __name__ == "__main__":
    main()
