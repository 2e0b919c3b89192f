"""The tool sandbox: a tool that raises, hangs, returns a non-string, opens a socket or allocates past the cap
gives an error observation (counted by the loop), never an exception; a good tool gives its string."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest

from hybridflow.agent.loop import ToolAgentLoop
from hybridflow.agent.tools import load_tools
from hybridflow.models.tiny import build_tokenizer
from hybridflow.rollout.server_api import TokenOutput, TurnSampling

# timing: tool timeouts (1.5 s), latency bounds and a per-call overhead bound; they must not share the cores
pytestmark = pytest.mark.serial

TOOLS = '''
import socket
import subprocess
import sys
import time


def lookup(key: str) -> str:
    """Look a key up."""
    print("noise on stdout must not be taken for the result")
    return {"k7": "42"}.get(key, "none")


def boom(x: str) -> str:
    """Raises."""
    raise ValueError("bad " + x)


def nap() -> str:
    """Sleeps past any timeout."""
    time.sleep(60)
    return "awake"


def number() -> str:
    """Returns an int, not a str."""
    return 7


def dial() -> str:
    """Opens a socket."""
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    return "connected"


def dial_from_child() -> str:
    """Opens a socket from a fresh interpreter (no Python-level block there)."""
    code = "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return res.stderr.strip().splitlines()[-1]


def hog() -> str:
    """Allocates 1 GiB."""
    return str(len(bytearray(1 << 30)))
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("sandbox") / "tools.py"
    path.write_text(textwrap.dedent(TOOLS))
    return load_tools(path, timeout_s=1.5, memory_mb=256)


def test_each_failure_is_an_observation(tools):
    async def go():
        names = ["lookup", "boom", "nap", "number", "dial", "hog"]
        args = [{"key": "k7"}, {"x": "y"}, {}, {}, {}, {}]
        start = time.perf_counter()
        results = await asyncio.gather(*(tools.call(n, a) for n, a in zip(names, args)))
        return dict(zip(names, results)), time.perf_counter() - start

    res, wall = asyncio.run(go())
    assert (res["lookup"].status, res["lookup"].text) == ("ok", "42")
    assert (res["boom"].status, res["boom"].text) == ("error", "error: ValueError: bad y")
    assert res["nap"].status == "timeout" and res["nap"].text.startswith("error: TimeoutError: ")
    assert 1.4 < res["nap"].latency_s < 10
    assert res["number"].text == "error: TypeError: tool 'number' returned int, expected str"
    assert res["dial"].text == "error: PermissionError: network is disabled in the tool sandbox"
    assert res["hog"].status == "error" and res["hog"].text.startswith("error: MemoryError")
    assert wall < 10  # all six ran at once: the timeout is the longest


def test_a_fresh_interpreter_inside_has_no_network(tools):
    sandbox = tools.sandbox
    if not sandbox.describe(tools.specs["lookup"].path).get("netns"):
        pytest.skip("the kernel refuses unprivileged network namespaces here; only the Python-level block applies")
    res = asyncio.run(tools.call("dial_from_child", {}))
    assert res.status == "ok" and "Network is unreachable" in res.text, res.text


def test_unknown_tool_and_a_vanished_file(tools, tmp_path):
    assert asyncio.run(tools.call("nope", {})).text == "error: KeyError: unknown tool 'nope'"
    gone = tmp_path / "gone.py"
    gone.write_text("def f() -> str:\n    'Doc.'\n    return 'x'\n")
    other = load_tools(gone)
    gone.unlink()
    res = asyncio.run(other.call("f", {}))
    assert res.status == "error" and "FileNotFoundError" in res.text


class ScriptedPolicy:
    """A scripted policy (no model): the turns' texts are fixed, to drive the loop's control flow."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, list(texts), 0

    async def generate(self, prompt_ids, sampling: TurnSampling, route_key: str) -> TokenOutput:
        text = self.texts[min(self.calls, len(self.texts) - 1)]
        self.calls += 1
        ids = self.tok.encode(text, add_special_tokens=False)[: sampling.max_tokens]
        return TokenOutput(ids, [-0.5] * len(ids), "stop" if ids[-1] == self.tok.eos_token_id else "length")


def test_the_loop_counts_errors_and_timeouts(tools):
    tok = build_tokenizer()
    policy = ScriptedPolicy(tok, ["@lookup(k7)@boom(z)@nap()@number()@dial()@hog()@nope(1)</s>", "ok</s>"])
    loop = ToolAgentLoop(tok, "compact", response_length=1000, sampling=TurnSampling(max_tokens=100),
                         max_parallel_calls=8, max_tool_response_length=200)
    traj = asyncio.run(loop.run({"prompt_ids": [1, 5], "seed": 3}, policy, tools))
    assert (traj.tool_calls, traj.tool_errors, traj.tool_timeouts, traj.tool_parse_errors) == (7, 6, 1, 1)
    assert len(traj.tool_latencies_s) == 6 and traj.num_turns == 2 and traj.stop_reason == "no_tool_call"
    shown = tok.decode(traj.turns[0].tool_ids)
    assert shown.startswith("<|user|>42\nerror: ValueError: bad z\nerror: TimeoutError: ")
    assert "\nerror: unknown tool 'nope'" in shown and shown.endswith("</s><|assistant|>")


def test_overhead(tools):
    """Per-call overhead of the sandbox (the module docstring quotes it); loose bound, for a loaded box."""
    async def go(n):
        start = time.perf_counter()
        for _ in range(n):
            assert (await tools.call("lookup", {"key": "k7"})).ok
        return (time.perf_counter() - start) / n

    per_call = asyncio.run(go(5))
    print(f"\ntool sandbox: {per_call * 1e3:.1f} ms per call ({sys.executable})")
    assert per_call < 2.0
