"""The agent demo's tool (make demo-agent): a plain Python function per tool; its name is the tool's name, its
docstring the description, and its signature the parameters (docs/agent_loop.md). It runs in the sandbox:
a child process with a time limit, a memory cap and no sockets."""

import hashlib


def lookup(key: str) -> str:
    """Return the secret value stored under `key`.

    Args:
        key: the key named in the question, e.g. "qzr".
    """
    key = key.strip()
    if not key.isalpha() or not key.islower():
        raise ValueError(f"no such key: {key!r}")
    return f"{int(hashlib.sha256(key.encode()).hexdigest(), 16) % 1000:03d}"
