"""The tool registry: tools from a .py file and from a verl-style YAML, and every bad input named."""

from __future__ import annotations

import textwrap

import pytest

from hybridflow.agent.tools import ToolConfigError, load_tools

TOOLS_PY = '''
import json


def lookup(key: str, default: str = "none") -> str:
    """Look a key up in the table.

    Args:
        key: the key to look up
        default (str): what to answer when it is missing
    """
    return {"k7": "42"}.get(key, default)


def add(a: int, b: int) -> str:
    """Add two integers."""
    return json.dumps(a + b)


def _helper():
    return 1
'''


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_tools_from_a_python_file(tmp_path):
    tools = load_tools(_write(tmp_path, "tools.py", TOOLS_PY))
    assert sorted(tools.specs) == ["add", "lookup"]  # _helper is private; json is imported, not defined
    assert tools.specs["lookup"].schema() == {"type": "function", "function": {
        "name": "lookup", "description": "Look a key up in the table.",
        "parameters": {"type": "object", "required": ["key"], "properties": {
            "key": {"type": "string", "description": "the key to look up"},
            "default": {"type": "string", "description": "what to answer when it is missing"}}}}}
    assert tools.specs["add"].parameters["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}


def test_tools_from_a_yaml(tmp_path):
    (tmp_path / "lib").mkdir()
    _write(tmp_path / "lib", "tools.py", TOOLS_PY)
    config = _write(tmp_path, "tools.yaml", """
        tools:
          - path: lib/tools.py
            function: lookup
            config: {type: native}
          - path: lib/tools.py
            tool_schema:
              type: function
              function:
                name: add
                description: Sum of a and b.
          - path: lib/tools.py
            function: add
            tool_schema:
              function:
                name: plus
                parameters: {properties: {a: {type: number}, b: {type: number}}, required: [a, b]}
    """)
    tools = load_tools(config)
    assert sorted(tools.specs) == ["add", "lookup", "plus"]
    assert tools.specs["add"].description == "Sum of a and b."
    plus = tools.specs["plus"]
    assert (plus.function, plus.path) == ("add", str(tmp_path / "lib" / "tools.py"))
    assert plus.parameters == {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                               "required": ["a", "b"]}
    assert plus.description == "Add two integers."


@pytest.mark.bad_input
def test_a_tools_file_that_does_not_import_is_named(tmp_path):
    bad = _write(tmp_path, "broken_tools.py", "def f(:\n    pass\n")
    with pytest.raises(ToolConfigError, match=r"broken_tools\.py.*does not import: SyntaxError"):
        load_tools(bad)
    raising = _write(tmp_path, "raising_tools.py", "import no_such_module_xyz\n")
    with pytest.raises(ToolConfigError, match=r"raising_tools\.py.*ModuleNotFoundError.*no_such_module_xyz"):
        load_tools(raising)


@pytest.mark.bad_input
@pytest.mark.parametrize("body, error", [
    ("def lookup(key: str) -> str:\n    return key\n", r"function 'lookup'.*has no docstring"),
    ("def f(*args) -> str:\n    'Doc.'\n    return ''\n", r"function 'f'.*'args' is var_positional"),
    ("x = 1\n", r"defines no public function"),
    ("__all__ = ['missing']\n", r"'missing' is not a function"),
])
def test_bad_tools_file_is_named(tmp_path, body, error):
    path = _write(tmp_path, "tools.py", body)
    with pytest.raises(ToolConfigError, match=error) as info:
        load_tools(path)
    assert str(path) in str(info.value)


@pytest.mark.bad_input
@pytest.mark.parametrize("yaml_text, error", [
    ("tools:\n  - path: tools.py\n    function: lookup\n  - path: tools.py\n    function: lookup\n",
     r"two tools named 'lookup'"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n", r"tools\[0\]\.class_name=.*not supported"),
    ("tools:\n  - function: lookup\n", r"tools\[0\]\.path: missing"),
    ("tools:\n  - path: tools.py\n", r"tools\[0\]: no name"),
    ("tools:\n  - path: other.py\n    function: lookup\n", r"tools\[0\]\.path='other\.py': no such file"),
    ("tools:\n  - path: tools.py\n    function: lookup\n  - path: tools.py\n    function: nope\n",
     r"tools\[1\]\.function='nope'.*no such public function"),
    ("tools:\n  - path: tools.py\n    function: lookup\n    colour: red\n",
     r"tools\[0\]: unknown key\(s\) \['colour'\]"),
    ("tools:\n  - path: tools.py\n    function: undocumented\n", r"tools\[0\].*has no docstring"),
    ("tool:\n  - path: tools.py\n", r"expected a top-level `tools:` list"),
    ("tools: [\n", r"not valid YAML"),
    ("tools:\n  - path: tools.py\n    function: lookup\n    tool_schema: {function: {name: 'bad name'}}\n",
     r"tool_schema\.function\.name='bad name'"),
])
def test_bad_yaml_is_named(tmp_path, yaml_text, error):
    _write(tmp_path, "tools.py", TOOLS_PY + "\n\ndef undocumented(x: str) -> str:\n    return x\n")
    path = _write(tmp_path, "tools.yaml", yaml_text)
    with pytest.raises(ToolConfigError, match=error) as info:
        load_tools(path)
    assert str(path) in str(info.value)


@pytest.mark.bad_input
def test_missing_or_unknown_config_path(tmp_path):
    with pytest.raises(ToolConfigError, match=r"tool_config_path='.*nope\.py': no such file"):
        load_tools(tmp_path / "nope.py")
    with pytest.raises(ToolConfigError, match=r"expected a \.py tools file or a \.yaml"):
        load_tools(_write(tmp_path, "tools.json", "{}"))
    assert issubclass(ToolConfigError, ValueError)
