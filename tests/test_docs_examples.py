"""Every example in the docs is checked: YAML blocks load, command lines parse (docs/index.md, "About these docs").
How they are found and checked: tests/docs_examples.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from docs_examples import (
    REPO,
    SHELL_LANGS,
    Block,
    Command,
    check_command,
    check_kind,
    check_yaml_block,
    collect,
    pages,
    read_page,
)

pytestmark = pytest.mark.docs

FOUND = collect()
COMMANDS = list(FOUND["commands"].values())
YAML_BLOCKS = [b for b in FOUND["blocks"] if b.lang in ("yaml", "yml")]


def _id(cmds: list[Command]) -> str:
    return f"{cmds[0].page}:{cmds[0].line}:{cmds[0].target}"


def test_markers_are_well_formed():
    assert not FOUND["problems"], "\n".join(FOUND["problems"])


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=lambda b: f"{b.page}:{b.line}")
def test_yaml_block_loads(block):
    if block.skip:
        pytest.skip(f"{block.page}:{block.line}: {block.skip}")
    check_yaml_block(block)


@pytest.mark.parametrize("cmds", COMMANDS, ids=_id)
def test_command_parses(cmds):
    check_command(cmds)


def test_summary_per_page(capsys):
    """What was found where, how the commands are checked, what was skipped; the known examples must be among it."""
    rows = {path.relative_to(REPO).as_posix(): dict.fromkeys(("yaml", "shell blocks", "commands", "skipped"), 0)
            for path in pages()}
    for b in FOUND["blocks"]:
        rows[b.page]["yaml"] += b.lang in ("yaml", "yml")
        rows[b.page]["shell blocks"] += b.lang in SHELL_LANGS
        rows[b.page]["skipped"] += b.skip is not None
    for cmds in COMMANDS:
        for page in {c.page for c in cmds}:
            rows[page]["commands"] += 1
    kinds = Counter(check_kind(cmds[0]) for cmds in COMMANDS)
    skipped = sum(r["skipped"] for r in rows.values())
    with capsys.disabled():
        print(f"\ndocs examples: {len(YAML_BLOCKS)} YAML blocks, {len(COMMANDS)} distinct command lines ("
              + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + f"); {skipped} blocks skipped "
              "(<!-- docs-test: skip (reason) -->)")
        for page, r in rows.items():
            print(f"  {page:<24} " + ", ".join(f"{k} {v}" for k, v in r.items()))
    assert {"docs/index.md", "ARCHITECTURE.md", "README.md", "launch/README.md"} <= set(rows)
    texts = {c[0].text for c in COMMANDS}
    assert ("python -m hybridflow.trainer.main --config configs/ppo_tiny_cpu.yaml actor_rollout_ref.actor.optim.lr=1e-5"
            " trainer.total_training_steps=100") in texts
    assert any(b.page == "docs/async.md" for b in YAML_BLOCKS)


# --------------------------------------------------------------------------- the checker on pages made here

PAGE = """# A page

Run `python -m launch.plan configs/recipes/qwen2_7b_grpo_1node.yaml
--gpu h100` or `hybridflow <command> ARGS`.

```yaml
# base: configs/grpo_tiny_cpu.yaml
actor_rollout_ref: {rollout: {n: 4}}
```

<!-- docs-test: skip (an excerpt) -->
```yaml
nothing: here
```

```bash
make demo   # = python -m hybridflow.trainer.warmstart --out runs/x
ssh node1 'cd ~/hf && RAY_ADDRESS=<ip>:6379 python -m launch.cluster status' && echo done
.venv/bin/python -m launch.submit --address http://HEAD:8265 -- --config configs/ppo_tiny_cpu.yaml \\
    trainer.nnodes=2 ...
torchrun --nproc-per-node 4 -m megatron_workers.convert hf-to-mcore --hf HF_DIR --out OUT
```
"""


def _page(tmp_path, text: str) -> tuple[list[Block], list[Command], list[str]]:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "page.md").write_text(text)
    return read_page(tmp_path / "docs" / "page.md", tmp_path)


def test_reading_a_page(tmp_path):
    blocks, commands, problems = _page(tmp_path, PAGE)
    assert not problems
    assert [(b.line, b.lang, b.skip) for b in blocks] == [(6, "yaml", None), (12, "yaml", "an excerpt"),
                                                          (16, "bash", None)]
    found = [(c.line, c.program, c.target, c.args) for c in commands]
    assert found == [
        (3, "python", "launch.plan", ["configs/recipes/qwen2_7b_grpo_1node.yaml", "--gpu", "h100"]),  # over 2 lines
        (17, "python", "hybridflow.trainer.warmstart", ["--out", "runs/x"]),  # in a comment
        (18, "python", "launch.cluster", ["status"]),  # inside ssh's quotes, up to &&
        (19, "python", "launch.submit", ["--address", "http://HEAD:8265", "--", "--config", "configs/ppo_tiny_cpu.yaml",
                                         "trainer.nnodes=2", "..."]),  # continued over two lines
        (21, "python", "megatron_workers.convert", ["hf-to-mcore", "--hf", "HF_DIR", "--out", "OUT"])]
    nested = commands[3].nested
    assert [(c.target, c.args) for c in nested] == [
        ("hybridflow.trainer.main", ["--config", "configs/ppo_tiny_cpu.yaml", "trainer.nnodes=2", "..."])]
    assert [check_kind(c) for c in commands] == ["parsed", "parsed", "parsed", "synopsis", "synopsis"]
    check_yaml_block(blocks[0])
    for cmd in [*commands, *nested]:
        check_command([cmd])


BAD_EXAMPLES = {  # a page's text -> what the failure must say
    "yaml, unknown key": (
        "```yaml\n# base: configs/grpo_tiny_cpu.yaml\n\nactor_rollout_ref:\n  rollout: {nn: 4}\n```\n",
        r"docs/page.md:5: the YAML block at line 1 does not load onto configs/grpo_tiny_cpu.yaml: unknown config key "
        r"'actor_rollout_ref.rollout.nn'; did you mean 'actor_rollout_ref.rollout.n'"),
    "yaml, no base": ("```yaml\n# base: configs/nope.yaml\na: 1\n```\n",
                      r"docs/page.md:1: `# base: configs/nope.yaml` names no file"),
    "yaml, syntax": ("```yaml\ndata: [\n```\n", r"docs/page.md:1: the YAML block does not parse"),
    "stale flag": ("\n`python -m launch.plan configs/recipes/qwen2_7b_grpo_1node.yaml --gpus h100`\n",
                   r"docs/page.md:2: .* does not parse .*unrecognized arguments: --gpus"),
    "stale flag, continued line": ("```bash\npython -m launch.cluster stop \\\n   --grace 1 --force\n```\n",
                                   r"docs/page.md:2: .*unrecognized arguments: --force"),
    "synopsis, stale option": ("`python -m launch.benchmark CONFIG [--warm-up 10]`",
                               r"docs/page.md:1: .* has no option --warm-up"),
    "synopsis, no such subcommand": ("`python -m launch.cluster {head,start}`",
                                     r"docs/page.md:1: .*: start is not a subcommand of launch.cluster"),
    "unknown override": ("`python -m hybridflow.trainer.main --config configs/ppo_tiny_cpu.yaml trainer.total_steps=3`",
                         r"docs/page.md:1: .*its config does not load: unknown config key 'trainer.total_steps'"),
    "unknown override, synopsis": (
        "`python -m hybridflow.trainer.main --config configs/ppo_tiny_cpu.yaml trainer.total_steps=3 ...`",
        r"docs/page.md:1: .*its config does not load: unknown config key 'trainer.total_steps'"),
    "no such config": ("`python -m launch.plan configs/recipes/nope.yaml`",
                       r"docs/page.md:1: .*the config configs/recipes/nope.yaml does not exist"),
    "no such entry point": ("`python -m hybridflow.nope --x`",
                            r"docs/page.md:1: `python -m hybridflow.nope` is not an entry point"),
    "no such module": ("`python -m nopenope`", r"docs/page.md:1: `python -m nopenope`: no such module"),
    "no such command": ("`hybridflow trian --config c.yaml`", r"docs/page.md:1: `hybridflow trian` is no command"),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("name", BAD_EXAMPLES)
def test_a_bad_example_fails_naming_its_line(tmp_path, name):
    text, needle = BAD_EXAMPLES[name]
    blocks, commands, problems = _page(tmp_path, text)
    yaml_blocks = [b for b in blocks if b.lang == "yaml"]
    assert not problems and len(yaml_blocks) + len(commands) == 1
    with pytest.raises(AssertionError, match="(?s)" + needle):
        if yaml_blocks:
            check_yaml_block(yaml_blocks[0])
        else:
            check_command(commands)


@pytest.mark.bad_input
def test_a_marker_needs_a_reason_and_a_fence(tmp_path):
    _, _, problems = _page(tmp_path, "<!-- docs-test: skip -->\n```yaml\na: 1\n```\n\n<!-- docs-test: skip (x) -->\n"
                                     "\n```yaml\nb: 2\n```\n")
    assert problems == [
        "docs/page.md:1: a docs-test marker reads `<!-- docs-test: skip (reason) -->`, with a reason; got "
        "'<!-- docs-test: skip -->'",
        "docs/page.md:6: a docs-test marker must be on the line right before a fence"]


def test_pages_are_globbed(tmp_path):
    (tmp_path / "docs" / "deep").mkdir(parents=True)
    (tmp_path / "launch").mkdir()
    for name in ("docs/index.md", "docs/deep/new.md", "README.md", "launch/README.md", "TOP.md"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "docs" / "arch.md").write_text('--8<-- "TOP.md"\n')
    assert [p.relative_to(tmp_path).as_posix() for p in pages(tmp_path)] == [
        "README.md", "TOP.md", "docs/arch.md", "docs/deep/new.md", "docs/index.md", "launch/README.md"]
