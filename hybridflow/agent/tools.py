"""The tool registry: tools written as plain Python functions, listed by a .py file or a verl-style YAML.

A tools file (multi_turn.tool_config_path=my_tools.py): every public function defined in it is a tool (or
the names in its `__all__`). The tool's name is the function's name, its description the docstring's first
paragraph, its parameters the signature's (JSON types from the annotations: str -> string, int -> integer,
float -> number, bool -> boolean, list -> array, dict -> object, none -> string; a parameter without a
default is required; a Google-style `Args:` section of the docstring gives each parameter's description).
A tool returns a str, the text the model reads.

A YAML (multi_turn.tool_config_path=tools.yaml) has verl's shape, each entry pointing at a function::

    tools:
      - path: my_tools.py          # relative to the YAML's folder
        function: lookup           # default: tool_schema.function.name
        tool_schema:               # optional: default from the docstring and signature, as above
          type: function
          function:
            name: lookup           # the name the model calls; default: the function's name
            description: Look a key up in the table.
            parameters: {type: object, properties: {key: {type: string}}, required: [key]}

verl's `class_name` entries (BaseTool subclasses) are refused with a message saying what to write instead.

Every check runs in `load_tools`, before any worker starts, and raises ToolConfigError naming the file and
key: a file that is missing or does not import (imported in the sandbox, never in the trainer's process), a
tool without a docstring or description, two tools with the same name.
"""

from __future__ import annotations

import asyncio
import pathlib
import re
from dataclasses import dataclass, field

from hybridflow.agent.tool_sandbox import ToolResult, ToolSandbox, error_text

_JSON_TYPE = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object", None: "string"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ToolConfigError(ValueError):
    """A tools file or YAML that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool: the OpenAI-style function schema the model is told about and where its code lives."""

    name: str
    description: str
    parameters: dict  # JSON schema: {"type": "object", "properties": {...}, "required": [...]}
    path: str  # the .py file
    function: str  # the function's name in it

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolSet:
    """The tools a loop may call, and the sandbox that runs them. `ToolSet()` is the empty set."""

    specs: dict[str, ToolSpec] = field(default_factory=dict)
    sandbox: ToolSandbox = field(default_factory=ToolSandbox)

    def __contains__(self, name: str) -> bool:
        return name in self.specs

    def schemas(self) -> list[dict]:
        """For the chat template's `tools=` (hermes models are told the tools in the system prompt)."""
        return [s.schema() for s in self.specs.values()]

    async def call(self, name: str, arguments: dict) -> ToolResult:
        spec = self.specs.get(name)
        if spec is None:  # the parser refuses unknown names first; this is the loop's last guard
            return ToolResult(error_text("KeyError", f"unknown tool {name!r}"), "error", 0.0)
        try:
            return await self.sandbox.call(spec.path, spec.function, arguments)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the OS refused a process: an observation, not a crash
            return ToolResult(error_text(type(e).__name__, str(e)[:300]), "error", 0.0)


def load_tools(path: str | pathlib.Path, timeout_s: float = 10.0, memory_mb: int = 512,
               max_concurrency: int = 64) -> ToolSet:
    """Loads and checks a tools .py file or YAML (module docstring); raises ToolConfigError."""
    file = pathlib.Path(path).expanduser().resolve()
    if not file.is_file():
        raise ToolConfigError(f"multi_turn.tool_config_path={str(path)!r}: no such file")
    sandbox = ToolSandbox(timeout_s=timeout_s, memory_mb=memory_mb, max_concurrency=max_concurrency)
    if file.suffix == ".py":
        specs = [_spec_from_doc(file, tool, f"{file}: function {tool['name']!r}")
                 for tool in _describe(sandbox, file, f"multi_turn.tool_config_path={str(file)!r}")]
        if not specs:
            raise ToolConfigError(f"{file}: defines no public function (each public function is a tool)")
    elif file.suffix in (".yaml", ".yml"):
        specs = _specs_from_yaml(file, sandbox)
    else:
        raise ToolConfigError(f"multi_turn.tool_config_path={str(file)!r}: expected a .py tools file or a "
                              ".yaml tool config")
    out: dict[str, ToolSpec] = {}
    for spec in specs:
        if spec.name in out:
            raise ToolConfigError(f"{file}: two tools named {spec.name!r} ({out[spec.name].path}:"
                                  f"{out[spec.name].function} and {spec.path}:{spec.function})")
        out[spec.name] = spec
    return ToolSet(specs=out, sandbox=sandbox)


def _describe(sandbox: ToolSandbox, file: pathlib.Path, where: str) -> list[dict]:
    reply = sandbox.describe(str(file))
    if not reply.get("ok"):
        raise ToolConfigError(f"{where}: the tools file {str(file)!r} does not import: {reply.get('error')}")
    return reply["tools"]


def _spec_from_doc(file: pathlib.Path, tool: dict, where: str) -> ToolSpec:
    if "error" in tool:
        raise ToolConfigError(f"{where}: {tool['error']}")
    name = tool["name"]
    if not _NAME.match(name):
        raise ToolConfigError(f"{where}: {name!r} is not a usable tool name")
    description, arg_docs = _split_doc(tool["doc"])
    if not description:
        raise ToolConfigError(f"{where}: has no docstring; its first paragraph is the description the model "
                              "reads (or give tool_schema.function.description in a YAML)")
    properties, required = {}, []
    for p in tool["params"]:
        if p["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD", "POSITIONAL_ONLY"):
            raise ToolConfigError(f"{where}: parameter {p['name']!r} is {p['kind'].lower()}; tools are called "
                                  "with keyword arguments only")
        prop = {"type": _JSON_TYPE.get(p["annotation"], "string")}
        if p["name"] in arg_docs:
            prop["description"] = arg_docs[p["name"]]
        properties[p["name"]] = prop
        if p["required"]:
            required.append(p["name"])
    return ToolSpec(name=name, description=description,
                    parameters={"type": "object", "properties": properties, "required": required},
                    path=str(file), function=name)


def _split_doc(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {param: description} from an `Args:` section)."""
    paragraphs = doc.strip().split("\n\n")
    description = " ".join(paragraphs[0].split()) if paragraphs and not paragraphs[0].startswith("Args:") else ""
    args: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
        elif in_args and (m := re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)):
            args[m.group(1)] = m.group(2).strip()
        elif in_args and line.strip() and not line.startswith((" ", "\t")):
            in_args = False
    return description, args


def _specs_from_yaml(file: pathlib.Path, sandbox: ToolSandbox) -> list[ToolSpec]:
    import yaml

    try:
        doc = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{file}: not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list):
        raise ToolConfigError(f"{file}: expected a top-level `tools:` list")
    described: dict[pathlib.Path, dict[str, dict]] = {}
    specs = []
    for i, entry in enumerate(doc["tools"]):
        key = f"{file}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{key}: expected a mapping with `path` and `function`")
        if "class_name" in entry:
            raise ToolConfigError(f"{key}.class_name={entry['class_name']!r}: verl's BaseTool classes are not "
                                  "supported; write the tool as a function and give `path` (its .py file) and "
                                  "`function` (docs/agent_loop.md)")
        unknown = sorted(set(entry) - {"path", "function", "tool_schema", "config"})
        if unknown:
            raise ToolConfigError(f"{key}: unknown key(s) {unknown}; allowed: path, function, tool_schema, config "
                                  "(verl's; not used)")
        if not entry.get("path"):
            raise ToolConfigError(f"{key}.path: missing (the .py file that defines the tool)")
        schema = entry.get("tool_schema") or {}
        fn_schema = schema.get("function", {}) if isinstance(schema, dict) else None
        if not isinstance(fn_schema, dict):
            raise ToolConfigError(f"{key}.tool_schema: expected {{type: function, function: {{name, ...}}}}")
        function = entry.get("function") or fn_schema.get("name")
        if not function:
            raise ToolConfigError(f"{key}: no name: give `function` or tool_schema.function.name")
        path = (file.parent / str(entry["path"])).resolve()
        if not path.is_file():
            raise ToolConfigError(f"{key}.path={entry['path']!r}: no such file ({path})")
        if path not in described:
            described[path] = {t["name"]: t for t in _describe(sandbox, path, f"{key}.path")}
        if function not in described[path]:
            raise ToolConfigError(f"{key}.function={function!r}: {path} has no such public function "
                                  f"(it has {sorted(described[path])})")
        tool = dict(described[path][function])
        if fn_schema.get("description"):
            tool["doc"] = fn_schema["description"]
        spec = _spec_from_doc(path, tool, f"{key} ({path}:{function})")
        if fn_schema.get("parameters") is not None:
            params = fn_schema["parameters"]
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise ToolConfigError(f"{key}.tool_schema.function.parameters: expected a JSON schema of type "
                                      "object")
            spec = ToolSpec(spec.name, spec.description, {"type": "object", **params}, spec.path, spec.function)
        name = fn_schema.get("name") or function
        if not _NAME.match(str(name)):
            raise ToolConfigError(f"{key}.tool_schema.function.name={name!r}: not a usable tool name")
        specs.append(ToolSpec(str(name), spec.description, spec.parameters, spec.path, spec.function))
    if not specs:
        raise ToolConfigError(f"{file}: `tools:` is empty")
    return specs
