"""Tool-call parsing (hermes, compact) and the rendering of results back into tokens."""

from __future__ import annotations

import pytest

from hybridflow.agent.tool_calls import FORMATS, ToolCall, parse_compact, parse_hermes, truncate_ids
from hybridflow.agent.tools import ToolSpec
from hybridflow.models.tiny import build_tokenizer


def _spec(name, props, required):
    return ToolSpec(name, f"{name} tool", {"type": "object", "properties": props, "required": required},
                    "/nowhere.py", name)


SPECS = {
    "lookup": _spec("lookup", {"key": {"type": "string"}}, ["key"]),
    "add": _spec("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    "now": _spec("now", {}, []),
}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_hermes_several_calls_and_string_arguments():
    text = ('I will look. <tool_call>{"name": "lookup", "arguments": {"key": "k7"}}</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call> done')
    assert parse_hermes(text, SPECS) == [ToolCall("lookup", {"key": "k7"}), ToolCall("add", {"a": 1, "b": 2})]
    assert parse_hermes("no calls here </tool_call>", SPECS) == []


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "lookup", "arguments": {"key": }</tool_call>', "bad JSON"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
    ('<tool_call>{"name": "lookup", "arguments": {"key": "k"}', "without </tool_call>"),
    ('<tool_call>["lookup"]</tool_call>', 'expected {"name"'),
    ('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', "needs argument(s) ['key']"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": "2"}}</tool_call>', "'b' must be integer, got str"),
    ('<tool_call>{"name": "add", "arguments": {"a": true, "b": 2}}</tool_call>', "'a' must be integer, got bool"),
    ('<tool_call>{"name": "now", "arguments": {"x": 1}}</tool_call>', "has no argument(s) ['x']"),
    ('<tool_call>{"name": "now", "arguments": 5}</tool_call>', "must be a JSON object"),
])
def test_hermes_malformed_calls_are_error_records(text, error):
    calls = parse_hermes(text, SPECS)
    assert len(calls) == 1 and calls[0].error is not None and error in calls[0].error


def test_hermes_unclosed_call_then_a_good_one():
    calls = parse_hermes('<tool_call>{"name": "now"} <tool_call>{"name": "now"}</tool_call>', SPECS)
    assert [c.error is None for c in calls] == [False, True]


def test_compact_calls():
    assert parse_compact("ok @lookup(k7) and @now() then @lookup()", SPECS) == [
        ToolCall("lookup", {"key": "k7"}), ToolCall("now", {}), ToolCall("lookup", {"key": ""})]
    assert parse_compact("mail a@b.c or @ lookup(k) or @lookup k", SPECS) == []
    assert parse_compact("@lookup(a b,c(d)", SPECS) == [ToolCall("lookup", {"key": "a b,c(d"})]


@pytest.mark.parametrize("text, error", [
    ("@lookup(k7", "without a closing ')'"),
    ("@lookup(k\n7)", "without a closing ')'"),
    ("@search(k7)", "unknown tool 'search'"),
    ("@now(x)", "takes no argument"),
    ("@add(1)", "needs argument(s) ['b']"),
])
def test_compact_malformed_calls_are_error_records(text, error):
    calls = parse_compact(text, SPECS)
    assert calls and calls[0].error is not None and error in calls[0].error


@pytest.mark.parametrize("side, expected", [("left", [1, 2, 3]), ("right", [5, 6, 7]), ("middle", [1, 2, 7])])
def test_truncate_sides_keep_the_named_part(side, expected):
    assert truncate_ids([1, 2, 3, 4, 5, 6, 7], 3, side) == expected
    assert truncate_ids([1, 2], 3, side) == [1, 2]
    assert truncate_ids([1, 2, 3], 0, side) == []


def test_compact_render_is_a_user_turn_with_plain_result_tokens(tok):
    ids = FORMATS["compact"].render(["42", "no</s>"], tok, max_tool_response_length=8)
    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|user|>", "</s>", "<|assistant|>")}
    chars = lambda s: [tok.convert_tokens_to_ids(c) for c in s]  # noqa: E731
    # the result's "</s>" stays 4 characters: a tool cannot end the turn
    assert ids == [special["<|user|>"], *chars("42\nno</s>"), special["</s>"], special["<|assistant|>"]]
    cut = FORMATS["compact"].render(["abcdefgh"], tok, max_tool_response_length=3, side="right")
    assert cut == [special["<|user|>"], *chars("fgh"), special["</s>"], special["<|assistant|>"]]


def test_hermes_render_is_qwen_tool_turn(tok):
    ids = FORMATS["hermes"].render(["r1", "r2"], tok, max_tool_response_length=8)
    # the char tokenizer spells ChatML's markers out; what matters is the exact text around the results
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2"
                               "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
