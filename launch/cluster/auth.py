"""Ray's token auth (on by default in Ray 2.60) for clusters this tool starts.

Ray looks for the token in RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token.
`ray start` alone turns auth on only when a token already exists, so the head makes one (and says where)
and every node is started with RAY_AUTH_MODE=token: a node without the token fails instead of silently
joining an open cluster. RAY_AUTH_MODE=disabled, set by the user, is respected.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def auth_enabled(env=None) -> bool:
    return (env if env is not None else os.environ).get("RAY_AUTH_MODE", "token").lower() != "disabled"


def token_path(env=None) -> Path:
    env = env if env is not None else os.environ
    return Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()


def read_token(env=None) -> str | None:
    env = env if env is not None else os.environ
    if env.get("RAY_AUTH_TOKEN"):
        return env["RAY_AUTH_TOKEN"].strip()
    path = token_path(env)
    if path.is_file():
        return path.read_text().strip() or None
    return None


def _write_private(path: Path, token: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, even briefly
    with os.fdopen(fd, "w") as f:
        f.write(token)


def ensure_token(env=None) -> str:
    """The cluster's token; a new random one is written (mode 600) to the token path when there is none."""
    token = read_token(env)
    if token is None:
        token = secrets.token_hex(32)
        _write_private(token_path(env), token)
    return token


def require_token(env=None) -> str:
    token = read_token(env)
    if token is None:
        raise RuntimeError(f"Ray token auth is on but there is no token at {token_path(env)} (nor RAY_AUTH_TOKEN): "
                           "copy the head's token file there, or set RAY_AUTH_MODE=disabled on every node "
                           "of a trusted network")
    return token


def install_token(token: str, env=None) -> None:
    """Put the token `up` sent over ssh where Ray on this host looks for it; a different token already there
    is an error (it may belong to another cluster), never overwritten."""
    token = token.strip()
    if not token:
        raise ValueError("--auth-token-stdin: read an empty token")
    have = read_token(env)
    if have is None:
        _write_private(token_path(env), token)
    elif have != token:
        raise RuntimeError(f"a different Ray token already exists at {token_path(env)}: remove it, or copy the "
                           "head's token there, so that every node of this cluster uses the same one")
