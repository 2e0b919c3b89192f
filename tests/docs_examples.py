"""The docs' examples, read and checked: the machinery of tests/test_docs_examples.py (docs/index.md, "About
these docs").

Pages are globbed: docs/**/*.md, README.md, launch/README.md and what a page includes (`--8<-- "ARCHITECTURE.md"`).
- A ```yaml block is loaded with load_config, merged onto the file its first line names (`# base: configs/x.yaml`)
  or onto the schema's defaults (the tiny default).
- A command is `python -m MODULE ...` (any python), `hybridflow COMMAND ...` or `torchrun ... -m MODULE ...`, in a
  shell or untagged block (comments too; `\\` continues a line) or in inline code. Wrapped commands are found too
  (sbatch, `ssh host '...'`, `ray job submit -- exec ...`), and so is what follows `--` in launch.submit (a trainer
  command line) and launch.torchrun_ray (`-m MODULE ...`). A command line found twice is checked once.
- A command of ours runs in this process until argparse has parsed its arguments, and is stopped there. With no
  arguments, `--help` must exit 0. A concrete command must parse, and its `config` / `overrides` (every tool of
  ours names them so) must load; a config under runs/ is written by an earlier command and is not loaded. A
  synopsis (a placeholder: `[opt]`, `{a,b}`, `a|b`, `<name>`, `...`, an ALL-CAPS word) is checked by name: each
  option and the subcommand must exist in the tool's parser, and its config and dotted key=value overrides load.
  A module not ours (`python -m pytest`) must import.
- `<!-- docs-test: skip (reason) -->` on the line right before a fence skips that block; the reason is required,
  and the skip is a pytest skip, so `-ra` lists it.
A failure names the page and line. 5-15 s on 2 cores, most of it the tools' imports (torch, megatron).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from test_cli_help import ENTRY_POINTS, PACKAGES

from hybridflow import cli
from hybridflow.config.load import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*docs-test:(.*?)-->\s*$")  # a line of its own (inline code may show one)
SKIP = re.compile(r"^\s*skip\s*\((.*\S.*)\)\s*$")
BASE = re.compile(r"^#\s*base:\s*(\S+)\s*$")
INCLUDE = re.compile(r'^--8<--\s+"([^"]+)"', re.M)
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "2>&1"}
PYTHON = re.compile(r"(^|/)python[\d.]*$")
MODULE = re.compile(r"^[A-Za-z_][\w.]*$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
OVERRIDE = re.compile(r"^\+{0,2}[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+=")
MADE_BY_A_RUN = ("runs/",)


def pages(root: Path = REPO) -> list[Path]:
    """The markdown the docs are made of: every docs page, the two READMEs, what a docs page includes."""
    found = sorted((root / "docs").rglob("*.md")) + [root / "README.md", root / "launch" / "README.md"]
    included = [root / inc for p in found for inc in INCLUDE.findall(p.read_text())]
    return sorted(set(found + included))


# --------------------------------------------------------------------------- finding the examples


@dataclass
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    text: str
    skip: str | None  # the marker's reason


@dataclass
class Command:
    page: str
    line: int
    program: str  # "python" (any python or torchrun's -m) or "hybridflow"
    target: str  # the module, or the hybridflow command
    args: list[str]
    nested: list[Command] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.program, self.target, *self.args)

    @property
    def text(self) -> str:
        head = f"python -m {self.target}" if self.program == "python" else f"hybridflow {self.target}"
        return " ".join([head, *map(shlex.quote, self.args)])


def read_page(path: Path, root: Path = REPO) -> tuple[list[Block], list[Command], list[str]]:
    """The fenced blocks, the commands (in shell blocks and inline code) and the marker problems of one page."""
    rel = path.relative_to(root).as_posix()
    lines = path.read_text().splitlines()
    blocks, commands, problems = [], [], []
    prose = list(lines)  # the page less its fenced blocks and markers, for the inline code spans
    pending: tuple[int, str | None] | None = None  # a marker waiting for its fence: (line, reason)
    i = 0
    while i < len(lines):
        line, n = lines[i], i + 1
        marker = MARKER.match(line)
        if marker:
            skip = SKIP.match(marker.group(1))
            if not skip:
                problems.append(f"{rel}:{n}: a docs-test marker reads `<!-- docs-test: skip (reason) -->`, with a "
                                f"reason; got {marker.group(0)!r}")
            pending = (n, skip.group(1).strip() if skip else None)
            prose[i] = ""
            i += 1
            continue
        fence = FENCE.match(line)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])), len(lines))
            skip = pending[1] if pending and pending[0] == n - 1 else None
            if pending and pending[0] != n - 1:
                problems.append(f"{rel}:{pending[0]}: a docs-test marker must be on the line right before a fence")
            pending = None
            block = Block(rel, n, fence.group(1).lower(), "\n".join(lines[i + 1:end]), skip)
            blocks.append(block)
            if block.lang in SHELL_LANGS and not skip:
                commands += shell_commands(block)
            prose[i:end + 1] = [""] * (min(end, len(lines) - 1) + 1 - i)
            i = end + 1
            continue
        if pending and line.strip():
            problems.append(f"{rel}:{pending[0]}: a docs-test marker must be on the line right before a fence")
            pending = None
        i += 1
    text = "\n".join(prose)
    for span in re.finditer(r"`([^`]+)`", text):  # a span may go on over a line break, not over a blank line
        if "\n\n" not in span.group(1):
            commands += commands_in(span.group(1).replace("\n", " "), rel, text.count("\n", 0, span.start()) + 1)
    return blocks, sorted(commands, key=lambda c: c.line), problems


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: `#` starts a comment at the start of a word, outside quotes."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k], line[k + 1:]
    return line, ""


def shell_commands(block: Block) -> list[Command]:
    found, code, start = [], "", None
    for k, line in enumerate(block.text.splitlines()):
        n = block.line + 1 + k
        part, comment = split_comment(line)
        found += commands_in(comment, block.page, n)
        start = n if start is None else start
        if part.rstrip().endswith("\\"):
            code += part.rstrip()[:-1] + " "
            continue
        found += commands_in(code + part, block.page, start)
        code, start = "", None
    return found


def _tokens(text: str) -> list[str]:
    """Shell words; a quoted word that holds a command (`ssh host 'cd x && python -m m'`) is split again."""
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote in prose
        words = text.split()
    out = []
    for w in words:
        out += _tokens(w) if " " in w and re.search(r"python[\d.]* -m |hybridflow ", w) else [w]
    return out


def commands_in(text: str, page: str, line: int) -> list[Command]:
    words = _tokens(text)
    found, k = [], 0
    while k < len(words):
        w = words[k]
        if PYTHON.search(w) and words[k + 1:k + 2] == ["-m"] and k + 2 < len(words):
            program, target, rest = "python", words[k + 2], k + 3
        elif w.rsplit("/", 1)[-1] == "torchrun" and "-m" in words[k + 1:]:
            m = words.index("-m", k + 1)
            program, target, rest = "python", words[m + 1] if m + 1 < len(words) else "", m + 2
        elif w.rsplit("/", 1)[-1] == "hybridflow" and k + 1 < len(words) and (k == 0 or words[k - 1] in OPERATORS):
            program, target, rest = "hybridflow", words[k + 1], k + 2
        else:
            k += 1
            continue
        end, depth = rest, 0
        while end < len(words) and (words[end] not in OPERATORS or depth > 0):
            depth += words[end].count("[") - words[end].count("]")
            end += 1
        if MODULE.match(target) and not PLACEHOLDER.match(target):  # `python -m <module>`, `-m MODULE`: none
            found.append(_with_nested(Command(page, line, program, target, words[rest:end])))
        k = end
    return found


def _with_nested(cmd: Command) -> Command:
    """launch.submit's `-- TRAINER ARGS` and launch.torchrun_ray's `-- -m MODULE ARGS` are commands too."""
    if "--" not in cmd.args:
        return cmd
    after = cmd.args[cmd.args.index("--") + 1:]
    if cmd.target == "launch.submit" or (cmd.program == "hybridflow" and cmd.target == "submit"):
        cmd.nested.append(Command(cmd.page, cmd.line, "python", "hybridflow.trainer.main", after))
    elif cmd.target in ("launch.torchrun_ray", "torchrun") and after[:1] == ["-m"] and len(after) > 1:
        cmd.nested.append(_with_nested(Command(cmd.page, cmd.line, "python", after[1], after[2:])))
    return cmd


def collect(root: Path = REPO) -> dict:
    blocks, commands, problems = [], [], []
    for path in pages(root):
        b, c, p = read_page(path, root)
        blocks += b
        problems += p
        for cmd in c:
            commands += [cmd, *_flatten(cmd.nested)]
    grouped: dict[tuple, list[Command]] = {}
    for cmd in commands:
        grouped.setdefault(cmd.key, []).append(cmd)
    return {"blocks": blocks, "commands": grouped, "problems": problems}


def _flatten(cmds: list[Command]) -> list[Command]:
    return [x for c in cmds for x in (c, *_flatten(c.nested))]


# --------------------------------------------------------------------------- checking a YAML block


def check_yaml_block(block: Block, root: Path = REPO) -> None:
    """Load the block with load_config, merged onto its base; errors name the page and line."""
    where = f"{block.page}:{block.line}"
    first = block.text.lstrip().splitlines()[:1]
    base = BASE.match(first[0]) if first else None
    try:
        data = OmegaConf.create(block.text)
    except yaml.YAMLError as e:  # its message has the line inside the block
        raise AssertionError(f"{where}: the YAML block does not parse: {e}") from None
    layers = [data]
    if base:
        base_path = root / base.group(1)
        assert base_path.is_file(), f"{where}: `# base: {base.group(1)}` names no file"
        layers.insert(0, OmegaConf.load(base_path))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "block.yaml"
        path.write_text(OmegaConf.to_yaml(OmegaConf.merge(*layers)))
        try:
            load_config(path)
        except ConfigError as e:
            message = str(e).replace(f" in {path}", "")
            raise AssertionError(f"{block.page}:{_key_line(block, message)}: the YAML block at line {block.line} does "
                                 f"not load{' onto ' + base.group(1) if base else ''}: {message}") from None


def _key_line(block: Block, message: str) -> int:
    """The page line of the failing key (the first block line naming its last part), else the fence's."""
    key = re.search(r"'([\w.]+)'", message)
    leaf = key.group(1).rsplit(".", 1)[-1] if key else None
    for k, line in enumerate(block.text.splitlines()):
        if leaf and re.search(rf"\b{re.escape(leaf)}\s*:", line):
            return block.line + 1 + k
    return block.line


# --------------------------------------------------------------------------- checking a command


class _Parsed(Exception):  # noqa: N818  (not an error: how a tool is stopped at its parse)
    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace | None):
        super().__init__()
        self.parser, self.namespace = parser, namespace


PARSE_METHODS = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")


@contextlib.contextmanager
def stopped_at_parse(parse: bool):
    """While active, a tool's first (outermost) argparse call raises _Parsed: after parsing (parse=True: argparse's
    own errors and --help exit as usual), or before it, with the parser only (parse=False)."""
    depth = 0
    originals = {name: getattr(argparse.ArgumentParser, name) for name in PARSE_METHODS}

    def wrap(original):
        def method(self, *args, **kwargs):
            nonlocal depth
            if depth == 0 and not parse:
                raise _Parsed(self, None)
            depth += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth -= 1
            if depth == 0:
                raise _Parsed(self, result[0] if isinstance(result, tuple) else result)
            return result

        return method

    try:
        for name, original in originals.items():
            setattr(argparse.ArgumentParser, name, wrap(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(argparse.ArgumentParser, name, original)


def run_to_parse(cmd: Command, args: list[str], parse: bool = True) -> tuple[_Parsed | int, str]:
    """Run the command (`python -m` through runpy, `hybridflow` through its dispatcher) in this process until it
    parses its arguments: (_Parsed, output), or (exit code, output) when argparse exited (--help, an error)."""
    saved = list(sys.argv)
    out = io.StringIO()
    try:
        with stopped_at_parse(parse), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
            if cmd.program == "hybridflow":
                cli.main([cmd.target, *args])
            else:
                sys.argv = [cmd.target, *args]
                runpy.run_module(cmd.target, run_name="__main__", alter_sys=True)
    except _Parsed as p:
        return p, out.getvalue()
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), out.getvalue() + (str(e.code) if e.code else "")
    finally:
        sys.argv = saved
    raise AssertionError(f"{cmd.text}: ran to the end without parsing its arguments with argparse")


def is_synopsis(args: list[str]) -> bool:
    return any(a == "..." or (a[:1] and a[:1] in "[{<") or (a.endswith(("]", "}")) and "=" not in a) or "|" in a
               or PLACEHOLDER.match(a) for a in args)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _takes_value(parser: argparse.ArgumentParser, option: str) -> bool:
    action = parser._option_string_actions.get(option)
    return action is not None and action.nargs != 0


def check_synopsis(cmd: Command, where: str) -> tuple[str | None, list[str]]:
    """The options, subcommand and overrides of a command with placeholders; returns (config, overrides)."""
    result, output = run_to_parse(cmd, cmd.args, parse=False)
    assert isinstance(result, _Parsed), f"{where}: `{cmd.text}` exited {result} before parsing:\n{output}"
    parser = result.parser
    words = [a if OVERRIDE.match(a) else a.strip("[]{}") for a in cmd.args if a != "..."]
    own = words[:words.index("--")] if "--" in words else words
    positional = [w for k, w in enumerate(own) if not w.startswith("-")
                  and not (k and own[k - 1].startswith("-") and "=" not in own[k - 1]
                           and _takes_value(parser, own[k - 1]))]
    subs = _subparsers(parser)
    if subs and positional:  # `python -m megatron_workers.convert ...` names none
        named = re.split(r"[,|]", positional[0])
        wrong = [n for n in named if n not in subs]
        assert not wrong, (f"{where}: `{cmd.text}`: {', '.join(wrong)} is not a subcommand of {cmd.target} "
                           f"({', '.join(subs)})")
        parser = subs[named[0]]
    for w in own:
        if w.startswith("-") and w != "--" and not PLACEHOLDER.match(w.lstrip("-")):
            for option in (o.split("=", 1)[0] for o in w.split("|")):
                assert option in parser._option_string_actions, (
                    f"{where}: `{cmd.text}`: {cmd.target} has no option {option}; its options: "
                    f"{', '.join(sorted(parser._option_string_actions))}")
    config = next((own[k + 1] for k, w in enumerate(own[:-1]) if w == "--config"), None) or next(
        (w for w in positional if w.endswith((".yaml", ".yml"))), None)
    return config, [w for w in positional if OVERRIDE.match(w)]


def check_kind(cmd: Command) -> str:
    """How a command is checked: module (not ours) | help (no arguments) | synopsis (placeholders) | parsed."""
    if cmd.program == "python" and cmd.target.split(".")[0] not in PACKAGES:
        return "module"
    if not cmd.args:
        return "help"
    return "synopsis" if is_synopsis(cmd.args) else "parsed"


def check_command(cmds: list[Command]) -> str:
    """Check one command line (the first of its duplicates); returns how: help | parsed | synopsis | module."""
    cmd = cmds[0]
    where = ", ".join(sorted({f"{c.page}:{c.line}" for c in cmds}))
    how = check_kind(cmd)
    if cmd.program == "hybridflow":
        assert cmd.target in cli.COMMANDS, (
            f"{where}: `hybridflow {cmd.target}` is no command (choose from {', '.join(cli.COMMANDS)})")
    elif how == "module":
        assert find_spec(cmd.target.split(".")[0]) and find_spec(cmd.target), (
            f"{where}: `python -m {cmd.target}`: no such module")
        return how
    else:
        assert cmd.target in ENTRY_POINTS, f"{where}: `python -m {cmd.target}` is not an entry point of ours"
    if how == "help":
        code, output = run_to_parse(cmd, ["--help"])
        assert code == 0 and "usage:" in output.lower(), f"{where}: `{cmd.text} --help` exited {code}:\n{output}"
        return how
    if how == "synopsis":
        config, overrides = check_synopsis(cmd, where)
    else:
        result, output = run_to_parse(cmd, cmd.args)
        assert isinstance(result, _Parsed), f"{where}: `{cmd.text}` does not parse (exit {result}):\n{output}"
        config = getattr(result.namespace, "config", None)
        overrides = getattr(result.namespace, "overrides", None) or []
    if config and (config.startswith(MADE_BY_A_RUN) or PLACEHOLDER.match(config)):
        config = None  # a run's output, or a placeholder: the overrides load onto the defaults
    if config:
        assert (REPO / config).is_file(), f"{where}: `{cmd.text}`: the config {config} does not exist"
    if config or overrides:
        try:
            load_config(REPO / config if config else None, overrides)
        except ConfigError as e:
            raise AssertionError(f"{where}: `{cmd.text}`: its config does not load: {e}") from None
    return how
