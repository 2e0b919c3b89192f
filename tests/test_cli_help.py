"""Every `python -m` entry point answers --help, and the `hybridflow` command reaches the main ones.

Entry points are discovered, not listed: under the packages setup.py installs (hybridflow, megatron_workers,
launch), every `__main__.py` (its package runs) and every module with a top-level
`if __name__ == "__main__":` (read with ast, so a docstring that mentions the guard does not count). A new
entry point is covered without touching this file. Worker-side scripts (the reward sandbox child, the
torchrun watchdog) are entry points too and answer --help like the rest; tests/ is not searched (its scripts
are test fixtures run by the tests themselves).

Each must exit 0 and print argparse's usage followed by a description whose first line says what the
command does (not a command line). The subprocesses run a few at a time, each with a timeout.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridflow import cli

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("hybridflow", "megatron_workers", "launch")
HELP_TIMEOUT_S = 120  # the heaviest import torch before parsing (benchmarks, convert): ~2 s alone on 2 cores
WORKERS = 3
SECTION_HEADERS = ("options:", "optional arguments:", "positional arguments:")


def _has_main_guard(path: Path) -> bool:
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            t = node.test
            names = [t.left, *t.comparators]
            if (len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
                    and any(isinstance(n, ast.Name) and n.id == "__name__" for n in names)
                    and any(isinstance(n, ast.Constant) and n.value == "__main__" for n in names)):
                return True
    return False


def discover_entry_points(root: Path = REPO) -> list[str]:
    """Dotted names `python -m` accepts: packages with a __main__.py, modules with a __main__ guard."""
    found = set()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__main__":
                found.add(".".join(parts[:-1]))
            elif parts[-1] != "__init__" and _has_main_guard(path):
                found.add(".".join(parts))
    return sorted(found)


ENTRY_POINTS = discover_entry_points()


def _run_help(module: str) -> dict:
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=HELP_TIMEOUT_S, stdin=subprocess.DEVNULL)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, e.stdout or "", f"timed out after {HELP_TIMEOUT_S} s"
    return {"rc": rc, "out": out if isinstance(out, str) else out.decode(), "err": err,
            "s": time.perf_counter() - t0}


@pytest.fixture(scope="module")
def help_runs() -> dict[str, dict]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        runs = dict(zip(ENTRY_POINTS, pool.map(_run_help, ENTRY_POINTS), strict=True))
    slowest = sorted(runs.items(), key=lambda kv: -kv[1]["s"])[:5]
    print(f"\n--help of {len(runs)} entry points: {time.perf_counter() - t0:.1f} s wall ({WORKERS} at a time); "
          "slowest " + ", ".join(f"{m} {r['s']:.1f} s" for m, r in slowest))
    return runs


def help_description(text: str) -> str:
    """The first line after argparse's usage block ('' if none): where a one-line description goes."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lower().startswith("usage:")), None)
    if start is None:
        return ""
    i = start
    while i < len(lines) and lines[i].strip():  # the usage block ends at the first blank line
        i += 1
    rest = [line.strip() for line in lines[i:] if line.strip()]
    return rest[0] if rest else ""


def test_discovery_finds_the_known_entry_points():
    for module in ("hybridflow.trainer.main", "hybridflow.trainer.export", "hybridflow.trainer.warmstart",
                   "hybridflow.cli", "megatron_workers.convert", "launch.torchrun_ray", "launch.cluster",
                   "launch.cluster.status", "launch.plan", "launch.benchmark", "launch.sweep", "launch.submit",
                   "launch.torchrun_ray.watchdog", "launch.grafana.make_dashboard", "launch.bench_actor"):
        assert module in ENTRY_POINTS, module
    # dist_ckpt's docstring mentions the guard; it has none, so it is no entry point
    assert "megatron_workers.dist_ckpt" not in ENTRY_POINTS
    for command in cli.COMMANDS.values():  # every `hybridflow` command is also a python -m entry point
        assert command.module in ENTRY_POINTS, command.module


def test_help_description_reads_the_line_after_usage():
    assert help_description("usage: x [-h]\n       [--y Y]\n\nDoes a thing.\n\noptions:\n") == "Does a thing."
    assert help_description("usage: x [-h]\n\noptions:\n  -h\n") == "options:"
    assert help_description("no usage here") == ""


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_answers_help(module, help_runs):
    run = help_runs[module]
    where = f"python -m {module} --help: rc={run['rc']}\n{run['out'][-1500:]}\n{run['err'][-1500:]}"
    assert run["rc"] == 0, where
    assert "usage:" in run["out"].lower(), where
    description = help_description(run["out"])
    assert description and description.lower() not in SECTION_HEADERS, f"no one-line description: {where}"
    assert not description.lstrip("`").startswith(("python ", "torchrun ")), (
        f"the description should say what the command does, not show a command line: {description!r}")


# --------------------------------------------------------------------------- the `hybridflow` command


def _console_scripts() -> dict[str, str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            kw = {k.arg: k.value for k in node.keywords}
            scripts = ast.literal_eval(kw["entry_points"])["console_scripts"]
            return dict(tuple(part.strip() for part in s.split("=", 1)) for s in scripts)
    raise AssertionError("no setup() call in setup.py")


def test_setup_declares_the_hybridflow_console_script():
    target = _console_scripts()["hybridflow"]
    assert target == "hybridflow.cli:main"
    module, _, func = target.partition(":")
    assert getattr(__import__(module, fromlist=[func]), func) is cli.main


def test_setup_packages_what_the_commands_import():
    from setuptools import find_packages

    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    packages_expr = next(k.value for k in call.keywords if k.arg == "packages")
    include = ast.literal_eval(next(k.value for k in packages_expr.keywords if k.arg == "include"))
    packaged = set(find_packages(where=str(REPO), include=include))
    for command in cli.COMMANDS.values():
        module = command.main.partition(":")[0]
        assert module.rpartition(".")[0] in packaged, f"{module} is not in setup.py's packages"


def test_hybridflow_help_lists_every_command_one_line_each(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hybridflow")
    for name, command in cli.COMMANDS.items():
        lines = [line for line in out.splitlines() if line.split()[:1] == [name]]
        assert len(lines) == 1 and command.summary in lines[0] and command.module in lines[0], (name, out)


def test_hybridflow_help_imports_no_heavy_module():
    code = ("import sys; from hybridflow import cli; cli.build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'ray', 'megatron', 'vllm') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_each_command_help_through_the_dispatcher(name, capsys):
    argv_before = list(sys.argv)
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out.lower() and help_description(out), out
    assert sys.argv == argv_before  # restored after the command


@pytest.mark.bad_input
@pytest.mark.parametrize("argv, needle", [([], "a command is required"), (["nope"], "unknown command 'nope'"),
                                          (["--bogus"], "unrecognized arguments")])
def test_dispatcher_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_dispatcher_forwards_argv_unchanged(tmp_path, monkeypatch):
    (tmp_path / "fake_cmd.py").write_text(
        "import sys\nseen = []\n"
        "def main(argv=None):\n"
        "    seen.append((list(argv), list(sys.argv)))\n"
        "    return 7 if '--fail' in argv else None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command("fake_cmd", "fake_cmd:main", "a test command"))
    import fake_cmd

    args = ["--nnodes", "2", "-h2", "--", "train.py", "--help", "x=1"]
    assert cli.main(["fake", *args]) == 0  # None from main is success
    assert fake_cmd.seen[-1] == (args, ["hybridflow fake", *args])
    assert cli.main(["fake", "--fail"]) == 7  # an int is the exit code


def test_launch_readme_lists_every_command():
    text = (REPO / "launch" / "README.md").read_text()
    for name, command in cli.COMMANDS.items():
        row = f"| `hybridflow {name}` | {command.summary} | `python -m {command.module}` |"
        assert row in text, f"launch/README.md's Commands table lacks or differs from: {row}"
