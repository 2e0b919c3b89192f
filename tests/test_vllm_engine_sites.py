"""Every vLLM engine in the repository is built by hybridflow.rollout.vllm_engine.build_llm: the rollout, the test
scripts, the benchmarks and launch/. An engine built anywhere else would use vLLM's default shared-memory segment
names on AVX-512/AMX machines and leave them in /dev/shm for the next engine to collide with (EEXIST)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE_CLASSES = {"LLM", "AsyncLLM", "LLMEngine", "AsyncLLMEngine"}
THE_PLACE = REPO / "hybridflow" / "rollout" / "vllm_engine.py"


def engine_constructions(source: str) -> list[int]:
    """Line numbers of `vllm.LLM(...)`-like calls: through the vllm module (or an alias of it), or a name imported
    from vllm (`from vllm import LLM as X`), including the classmethod constructors (`LLMEngine.from_engine_args`)."""
    tree = ast.parse(source)
    modules, classes = {"vllm"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            classes |= {a.asname or a.name for a in node.names if a.name in ENGINE_CLASSES}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr.startswith("from_"):
            f = f.value  # LLMEngine.from_engine_args(...)
        if isinstance(f, ast.Name) and f.id in classes:
            lines.append(node.lineno)
        elif isinstance(f, ast.Attribute) and f.attr in ENGINE_CLASSES:
            root = f.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                lines.append(node.lineno)
    return lines


def test_the_finder_sees_each_spelling():
    assert engine_constructions("import vllm\nllm = vllm.LLM(model='m')\n") == [2]
    assert engine_constructions("from vllm import LLM as Engine\nx = Engine(model='m')\n") == [2]
    assert engine_constructions("import vllm.entrypoints.llm as v\nx = v.LLM(model='m')\n") == [2]
    assert engine_constructions("from vllm import LLMEngine\nx = LLMEngine.from_engine_args(a)\n") == [2]
    assert engine_constructions("from vllm import SamplingParams\nx = SamplingParams(n=1)\nLLM = 3\n") == []


def test_no_engine_is_built_outside_build_llm():
    files = [p for top in ("hybridflow", "megatron_workers", "launch", "tests") for p in (REPO / top).rglob("*.py")]
    assert THE_PLACE in files and len(files) > 100
    assert engine_constructions(THE_PLACE.read_text()), "build_llm itself must construct the engine"
    texts = {p: p.read_text() for p in files if p != THE_PLACE}
    maybe = {p: t for p, t in texts.items() if "vllm" in t and "LLM" in t}  # only these can build one: parse them
    elsewhere = {str(p.relative_to(REPO)): lines for p, t in maybe.items() if (lines := engine_constructions(t))}
    assert not elsewhere, f"vLLM engines built outside hybridflow/rollout/vllm_engine.build_llm: {elsewhere}"
