"""Tool-call syntax: finding calls in a turn's decoded text, and the tokens that carry results back.

Two formats (multi_turn.format):

hermes (Qwen2.5 / Hermes chat models): each call is `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
any number per turn; "arguments" may also be a JSON string holding the object. Results go back as the chat
template's tool turn (ChatML, Qwen2.5's template), one `<tool_response>` per call in a single user turn::

    \\n<|im_start|>user\\n<tool_response>\\nRESULT 1\\n</tool_response>\\n<tool_response>\\nRESULT 2
    \\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

(the leading newline is the one the template puts after the model's `<|im_end|>`, the turn's stop token).
Other templates: pass a `RenderTemplate` of your own.

compact (our character-level tiny model, hybridflow/models/tiny.py): a call is `@NAME(ARG)`: `@`, a name
matching [A-Za-z_][A-Za-z0-9_]*, `(`, the argument: every character up to the first `)` taken verbatim
(no quoting, no escapes; it cannot contain `)` or a newline; it may be empty), then `)`. A turn may hold
several calls; `@` not followed by a name and `(` is plain text. ARG is passed as the tool's first
parameter, which must be a string; a tool whose other parameters are all optional qualifies, and an empty
ARG calls a tool without parameters. `@lookup(k7)` calls lookup("k7"). Results go back as a user turn,
results joined by a newline::

    <|user|>RESULT 1\\nRESULT 2</s><|assistant|>

Malformed calls (bad JSON, no "name", an unknown tool, arguments that do not fit the tool's schema, a
missing `</tool_call>` or `)`) are ToolCall records with `error` set: the loop shows the model that text
as the call's result, and never raises. Everything rendered here is appended with response_mask 0.
Result text is tokenised with special-token parsing off (a tool printing `<|im_end|>` cannot end a turn),
then cut to max_tool_response_length tokens per result; `side` says which part is KEPT, as verl's
tool_response_truncate_side: left (the start), right (the end), middle (the start and the end).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridflow.agent.tools import ToolSpec

_JSON_CHECK = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}
SIDES = ("left", "middle", "right")


@dataclass(frozen=True)
class ToolCall:
    """One call found in a turn. error set: a malformed call; its text is the observation."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class RenderTemplate:
    """The strings around tool results: turn_open, then per result item_open + RESULT + item_close (results
    separated by item_sep), then turn_close. Boundary strings are tokenised with special tokens parsed."""

    turn_open: str
    item_open: str
    item_close: str
    item_sep: str
    turn_close: str


HERMES_TEMPLATE = RenderTemplate(turn_open="\n<|im_start|>user", item_open="\n<tool_response>\n",
                                 item_close="\n</tool_response>", item_sep="",
                                 turn_close="<|im_end|>\n<|im_start|>assistant\n")
COMPACT_TEMPLATE = RenderTemplate(turn_open="<|user|>", item_open="", item_close="", item_sep="\n",
                                  turn_close="</s><|assistant|>")


def check_arguments(spec: ToolSpec, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool's JSON schema (required, unknown names, basic types), or None."""
    props = spec.parameters.get("properties", {})
    missing = [k for k in spec.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"tool {spec.name!r} needs argument(s) {missing}"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"tool {spec.name!r} has no argument(s) {unknown} (it takes {list(props)})"
    for key, value in arguments.items():
        want = _JSON_CHECK.get(props.get(key, {}).get("type"))
        bad_bool = isinstance(value, bool) and want in (int, (int, float))
        if want is not None and (not isinstance(value, want) or bad_bool):
            return f"tool {spec.name!r} argument {key!r} must be {props[key]['type']}, got {type(value).__name__}"
    return None


def _checked(name: str, arguments: dict, specs: Mapping[str, ToolSpec]) -> ToolCall:
    if name not in specs:
        return ToolCall(name, arguments, f"unknown tool {name!r} (tools: {sorted(specs)})")
    problem = check_arguments(specs[name], arguments)
    return ToolCall(name, arguments, problem)


def parse_hermes(text: str, specs: Mapping[str, ToolSpec]) -> list[ToolCall]:
    calls, pos = [], 0
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    while (start := text.find(open_tag, pos)) >= 0:
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        next_open = text.find(open_tag, body_start)
        if end < 0 or 0 <= next_open < end:
            calls.append(ToolCall("", {}, "malformed tool call: <tool_call> without </tool_call>"))
            pos = body_start if end < 0 else next_open
            if end < 0:
                break
            continue
        pos = end + len(close_tag)
        try:
            obj = json.loads(text[body_start:end])
        except ValueError as e:
            calls.append(ToolCall("", {}, f"malformed tool call: bad JSON ({e})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'malformed tool call: expected {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "malformed tool call: \"arguments\" must be a JSON object"))
            continue
        calls.append(_checked(obj["name"], args, specs))
    return calls


_COMPACT_START = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)\(")


def parse_compact(text: str, specs: Mapping[str, ToolSpec]) -> list[ToolCall]:
    calls, pos = [], 0
    while (m := _COMPACT_START.search(text, pos)) is not None:
        name, arg_start = m.group(1), m.end()
        end = text.find(")", arg_start)
        newline = text.find("\n", arg_start)
        if end < 0 or 0 <= newline < end:
            calls.append(ToolCall(name, {}, f"malformed tool call: @{name}( without a closing ')'"))
            pos = arg_start
            continue
        pos = end + 1
        arg = text[arg_start:end]
        spec = specs.get(name)
        if spec is None:
            calls.append(_checked(name, {}, specs))
            continue
        props = list(spec.parameters.get("properties", {}))
        if not props:
            calls.append(ToolCall(name, {}, None if arg == "" else f"tool {name!r} takes no argument, got {arg!r}"))
            continue
        calls.append(_checked(name, {props[0]: arg}, specs))
    return calls


def truncate_ids(ids: list[int], max_len: int, side: str) -> list[int]:
    """Keeps max_len ids: the start (left), the end (right), or both ends (middle; the start gets the odd one)."""
    if side not in SIDES:
        raise ValueError(f"multi_turn.tool_response_truncate_side={side!r}: expected one of {SIDES}")
    if len(ids) <= max_len:
        return list(ids)
    if side == "left":
        return list(ids[:max_len])
    if side == "right":
        return list(ids[len(ids) - max_len:]) if max_len else []
    head = (max_len + 1) // 2
    return list(ids[:head]) + (list(ids[len(ids) - (max_len - head):]) if max_len - head else [])


def _encode_plain(tokenizer, text: str) -> list[int]:
    """Tokens of untrusted text: special-token strings in it stay characters."""
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError:  # a tokenizer without split_special_tokens
        return list(tokenizer.encode(text, add_special_tokens=False))


def _encode_boundary(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    template: RenderTemplate

    def parse(self, text: str, specs: Mapping[str, ToolSpec]) -> list[ToolCall]:
        return parse_hermes(text, specs) if self.name == "hermes" else parse_compact(text, specs)

    def render(self, results: list[str], tokenizer, max_tool_response_length: int, side: str = "middle") -> list[int]:
        """The ids appended after a turn for its calls' results (all with response_mask 0)."""
        t = self.template
        ids = _encode_boundary(tokenizer, t.turn_open)
        for i, text in enumerate(results):
            if i:
                ids += _encode_boundary(tokenizer, t.item_sep)
            ids += _encode_boundary(tokenizer, t.item_open)
            ids += truncate_ids(_encode_plain(tokenizer, text), max_tool_response_length, side)
            ids += _encode_boundary(tokenizer, t.item_close)
        return ids + _encode_boundary(tokenizer, t.turn_close)


FORMATS = {"hermes": ToolCallFormat("hermes", HERMES_TEMPLATE), "compact": ToolCallFormat("compact", COMPACT_TEMPLATE)}


def get_format(name: str, template: RenderTemplate | None = None) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"multi_turn.format={name!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[name] if template is None else ToolCallFormat(name, template)
