"""The sandboxed child that runs one tool call (or describes a tool file): untrusted code runs only here.

Started by hybridflow/agent/tool_sandbox.py as `python -I -S <this file>`, so it imports nothing but the
standard library before the user's file (the parent hands over its own sys.path, so the user's file can
import what the trainer's environment has). Before that import it:

1. caps its address space (RLIMIT_AS = memory_mb) and its CPU time (RLIMIT_CPU, a backstop for the parent's
   wall-time kill), and forbids core dumps;
2. moves itself into new user + network namespaces (unshare(2) via libc) where the kernel allows it: the
   only interface there is a loopback that is down, so no connection of any kind leaves the process, even
   from C code or a child process. Where unshare is refused (e.g. a container without user namespaces) this
   step is skipped and reported back as `"netns": false`;
3. makes socket creation from Python raise PermissionError("network is disabled in the tool sandbox")
   (_socket.socket, and so socket.socket and everything built on it, socketpair, dup, fromfd), so Python
   code gets a clear error whichever way step 2 went;
4. points fd 1 at stderr, so what the tool prints cannot be mistaken for the result: the result goes to a
   private duplicate of the original stdout as one JSON line.

Not blocked: reading and writing files the trainer's user may access, starting processes (they inherit the
limits and, with step 2, the empty network namespace, but not step 3), ctypes. The job comes on stdin
marshalled by the parent (trusted; marshal costs no import); the child answers in JSON, which the parent
parses (it never unpickles or unmarshals what the child wrote).
"""

from __future__ import annotations

import marshal
import os
import sys

_DISABLED = "network is disabled in the tool sandbox"
_MAX_TEXT = 1 << 20  # characters of a result kept (the loop truncates further, in tokens)


def _limit(memory_mb: int, cpu_s: int) -> None:
    import resource

    cap = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _unshare_network() -> bool:
    """New user + network namespaces (CLONE_NEWUSER | CLONE_NEWNET); False where the kernel refuses."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(0x10000000 | 0x40000000) == 0
    except (OSError, AttributeError):
        return False


def _block_sockets() -> None:
    """Socket creation raises, without importing socket.py (7 ms, a third of the child's start): the C type
    is replaced by a subclass whose __init__ refuses, so socket.socket, which subclasses whatever
    _socket.socket is when socket.py is first imported and calls its __init__, refuses too."""
    import _socket

    def refuse(*args, **kwargs):
        raise PermissionError(_DISABLED)

    refused = type("socket", (_socket.socket,), {"__init__": refuse, "__module__": "_socket", "__slots__": ()})
    _socket.socket = _socket.SocketType = refused
    for name in ("socketpair", "dup", "fromfd"):
        if hasattr(_socket, name):
            setattr(_socket, name, refuse)
    if "socket" in sys.modules:  # imported already (it is not, at -I -S): patch its copies too
        mod = sys.modules["socket"]
        for name in ("socket", "SocketType", "socketpair", "fromfd", "create_connection", "create_server"):
            setattr(mod, name, refuse)


def _import_file(path: str):
    import types  # not importlib.util: a few ms less per call

    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("hybridflow_user_tools")
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(code, module.__dict__)
    return module


def _json_str(text: str) -> str:
    """A JSON string literal, written by hand: importing json (and re) would double the child's start."""
    out = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c >= " " else f"\\u{ord(c):04x}" for c in out) + '"'


def _encode(reply: dict) -> str:
    if "tools" in reply:  # describe mode, at load time only
        import json

        return json.dumps(reply)
    parts = [f"{_json_str(k)}: {_json_str(v) if isinstance(v, str) else 'true' if v else 'false'}"
             for k, v in reply.items()]
    return "{" + ", ".join(parts) + "}"


def _describe(module) -> list[dict]:
    """Every tool the file offers: `__all__` if it has one, else its public functions defined in it."""
    import inspect

    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, f in vars(module).items() if inspect.isfunction(f) and not n.startswith("_")
                 and f.__module__ == module.__name__]
    tools = []
    for name in names:
        fn = getattr(module, name, None)
        if not callable(fn):
            tools.append({"name": name, "error": f"{name!r} is not a function"})
            continue
        params = []
        for p in inspect.signature(fn).parameters.values():
            ann = p.annotation
            ann = ann if isinstance(ann, str) else getattr(ann, "__name__", None) if ann is not p.empty else None
            params.append({"name": p.name, "kind": p.kind.name, "annotation": ann,
                           "required": p.default is p.empty})
        tools.append({"name": name, "doc": inspect.getdoc(fn) or "", "params": params})
    return tools


def _run(job: dict) -> dict:
    module = _import_file(job["path"])
    if job["mode"] == "describe":
        return {"ok": True, "tools": _describe(module)}
    fn = getattr(module, job["function"], None)
    if not callable(fn):
        return {"ok": False, "error": f"AttributeError: {job['path']} has no function {job['function']!r}"}
    value = fn(**job["arguments"])
    if not isinstance(value, str):
        return {"ok": False, "error": f"TypeError: tool {job['function']!r} returned {type(value).__name__}, "
                                      "expected str"}
    return {"ok": True, "result": value[:_MAX_TEXT]}


def main() -> None:
    job = marshal.loads(sys.stdin.buffer.read())  # from our own parent: trusted
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace")
    os.dup2(2, 1)  # the tool's prints go to stderr
    sys.path[:0] = [os.path.dirname(job["path"]), *job["sys_path"]]
    _limit(job["memory_mb"], job["cpu_s"])
    netns = _unshare_network() if job.get("netns", True) else False
    _block_sockets()
    try:
        reply = _run(job)
    except BaseException as e:  # noqa: BLE001 - MemoryError, SystemExit, KeyboardInterrupt: all reported as text
        detail = str(e)[:500] or (f"over the {job['memory_mb']} MB cap" if isinstance(e, MemoryError) else "")
        reply = {"ok": False, "error": f"{type(e).__name__}: {detail}"}
    reply["netns"] = netns
    out.write(_encode(reply) + "\n")
    out.flush()
    os._exit(0)  # no atexit handlers or finalizers of the user's code


def _parse_args(argv: list[str]) -> None:
    """Only --help, and only when asked: the parent starts the child without arguments (argparse costs ~1 ms)."""
    import argparse

    argparse.ArgumentParser(
        prog="python -m hybridflow.agent.tool_child",
        description="Run one sandboxed tool call (or describe a tools file) in this memory- and network-limited "
                    "process; hybridflow.agent.tool_sandbox starts it.",
        epilog="Reads a marshalled job from stdin and prints one JSON line. Not meant to be run by hand: the agent "
               "loop starts one per tool call.",
    ).parse_args(argv)


if __name__ == "__main__":
    if sys.argv[1:]:
        _parse_args(sys.argv[1:])
    main()
