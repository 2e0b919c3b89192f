"""Load a user's reward function from a Python file (config: custom_reward_function.path / .name)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import pathlib
import threading
from collections.abc import Callable

IMPORT_TIMEOUT_S = 120.0  # generous: a reward module may import sympy or a math verifier (seconds each)


def _exec(spec, module) -> BaseException | None:
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit too: a script's sys.exit() at import must not end the trainer
        return e
    return None


def load_reward_fn(path: str, name: str = "compute_score", import_timeout_s: float | None = None) -> Callable:
    """Import the file at `path` as a fresh module and return its callable `name`.

    The function is called as fn(data_source, solution_str, ground_truth, extra_info),
    as verl's custom reward functions are.
    """
    file = pathlib.Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file {str(file)!r} does not exist")
    # A name unique to the path, so two reward files called reward.py do not collide in sys.modules.
    module_name = "hybridflow_user_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import custom reward file {str(file)!r} (not a Python source file?)")
    module = importlib.util.module_from_spec(spec)
    # On a thread, so a file whose top level never returns (a loop, a blocking download) fails the start
    # instead of hanging it; the thread is a daemon and is abandoned, as the manager abandons a hung scorer.
    outcome: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: outcome.append(_exec(spec, module)), daemon=True,
                              name="reward-import")
    thread.start()
    import_timeout_s = IMPORT_TIMEOUT_S if import_timeout_s is None else import_timeout_s
    thread.join(import_timeout_s)
    if not outcome:
        raise TimeoutError(f"importing custom reward file {str(file)!r} did not finish in {import_timeout_s:g} s")
    if outcome[0] is not None:
        e = outcome[0]
        raise ImportError(f"importing custom reward file {str(file)!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom reward file {str(file)!r} has no function {name!r}; it defines: {defined}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in custom reward file {str(file)!r} is a {type(fn).__name__}, not a function")
    # A wrong signature would otherwise fail on every sample at run time, each scored 0 and merely counted.
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none to read: let the call decide
        return fn
    try:
        signature.bind("data_source", "solution_str", "ground_truth", "extra_info")
    except TypeError as e:
        raise TypeError(f"{name}{signature} in custom reward file {str(file)!r} cannot be called as "
                        f"{name}(data_source, solution_str, ground_truth, extra_info): {e}") from None
    return fn
