"""Megatron-Core workers. Importing the package arms a one-shot hook that makes the process's first
`import megatron.core` 1.8 s cheaper (lean_import.py says how and why)."""

from megatron_workers import lean_import

lean_import.install()
