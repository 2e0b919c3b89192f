"""Keep vLLM's per-step log lines off the console of a training run.

The hybrid engine reloads weights into vLLM before every generation, and vLLM logs three lines
per rank each time. Forwarded by Ray from every worker, they bury the driver's progress bar:

- "Reloading and processing weights took ..." and "Successfully reset prefix cache" (INFO):
  routine; our own `timing_s/reshard` metric already measures the reload.
- "RotaryEmbedding: Failed to load weights" (WARNING): harmless here. The layer's cos/sin cache
  is a buffer vLLM computes from the config, not a checkpoint weight; when a reload carries no
  tensor for it, vLLM puts the existing cache back (model_loader/reload/layerwise.py).

Only these exact messages are dropped, and none when VLLM_LOGGING_LEVEL=DEBUG, so every other
warning still shows.
"""

from __future__ import annotations

import logging
import os

# (logger name, message template as vLLM passes it to the logger, or for %s-formatted ones the rendered text)
ROUTINE_PER_STEP = (
    ("vllm.model_executor.model_loader.reload.inplace", "Reloading and processing weights took"),
    ("vllm.v1.core.block_pool", "Successfully reset prefix cache"),
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights"),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to judge: let it through
            return True
        return not text.startswith(self.prefix)


def quiet_routine_reload_logs() -> int:
    """Install the filters (idempotent); returns how many loggers got one (0 under VLLM_LOGGING_LEVEL=DEBUG)."""
    if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG":
        return 0
    installed = 0
    for name, prefix in ROUTINE_PER_STEP:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropPrefix(prefix))
            installed += 1
    return installed
