"""Import megatron-core without the two packages it loads and a worker never uses: 1.8 s less per process.

`import megatron.core` takes ~3.9 s of CPU (megatron-core 0.16.1, torch 2.13, this 2-core box); ~1.8 s of it
goes on two things no Megatron worker of ours touches at import:
- `megatron.core.jit` sets `jit_fuser = torch.compile`, and megatron's fused-kernel modules decorate functions
  with it when they are imported. Decorating already imports torch._dynamo and parts of inductor (1.1 s of
  `-X importtime`), though nothing is compiled until a decorated function is first called, and on our paths most
  never are.
- megatron's timers and inference context `import wandb` inside `try` (0.4 s) to log to it if configured;
  we never configure it (hybridflow/trainer/tracking.py imports wandb itself when trainer.logger asks for it).

Every worker process (each torchrun rank, each Ray actor) pays that once, and a run starts several, so the
whole test suite and every job's start-up carry it. While megatron.core itself is being imported (and only
then) this module:
- hands megatron a `torch.compile` that defers: the real `torch.compile(fn, **options)` runs at the first
  call of the decorated function, with the same options. torch.compile compiles lazily anyway, so what runs
  is unchanged; only the wrapper is built later;
- makes `import wandb` fail, which megatron's own `try` turns into `wandb = None` (its "not installed" path).
  The block is lifted right after, so our tracking imports the real wandb as before.

It acts on the first `import megatron.core` made after `megatron_workers` is imported (an import hook that
removes itself), so the many lazy imports in this package need no change. HYBRIDFLOW_LEAN_MEGATRON_IMPORT=0
turns it off (the import is then megatron's own, as before).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "megatron.core"
ENV = "HYBRIDFLOW_LEAN_MEGATRON_IMPORT"


def deferred_compile(real_compile):
    """A torch.compile stand-in whose compile happens at the first call, with the same options."""

    def stand_in(model=None, **options):
        if model is None:  # used as @torch.compile(...) with options
            return lambda fn: stand_in(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        call.deferred_compile = True  # for tests and debugging: this was not compiled at import
        return call

    return stand_in


@contextlib.contextmanager
def lean():
    """While inside: torch.compile defers (deferred_compile) and `import wandb` raises ImportError, unless wandb
    is already imported. Both are restored on the way out, whatever happens."""
    import torch

    real_compile = torch.compile
    block_wandb = "wandb" not in sys.modules
    torch.compile = deferred_compile(real_compile)
    if block_wandb:
        sys.modules["wandb"] = None  # the import system raises ImportError for a None entry
    try:
        yield
    finally:
        torch.compile = real_compile
        if block_wandb and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


class _LeanLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with lean():
            self.loader.exec_module(module)

    def __getattr__(self, name):  # is_package, get_resource_reader, get_data...: the real loader's, unchanged
        return getattr(self.loader, name)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds megatron.core the normal way, once, and wraps its loader in lean()."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LeanLoader(spec.loader)
        return spec


def installed() -> bool:
    return any(isinstance(f, _Hook) for f in sys.meta_path)


def install() -> None:
    """Arm the hook, unless megatron.core is already imported, it is armed, or the env var turns it off."""
    if os.environ.get(ENV, "1") == "0" or TARGET in sys.modules or installed():
        return
    sys.meta_path.insert(0, _Hook())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]
