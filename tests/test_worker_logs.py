"""A worker process's output goes to its log file; only errors and our own warnings (once) reach the console.

Runs redirect_worker_output in a fresh interpreter (it rewires file descriptors 1 and 2), emits what
workers emit, and reads the process's real stderr (what Ray would forward) and the log file.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import logging, os, sys, warnings
    from hybridflow.controller.worker_logs import redirect_worker_output
    path = redirect_worker_output(sys.argv[1], "actor+rollout", 1)
    print("plain print")
    os.write(2, b"C-level stderr\\n")
    warnings.warn("Transformer Engine and Apex are not installed.", UserWarning)
    logging.getLogger("vllm.engine").info("vLLM start-up line")
    logging.getLogger("megatron.core.optimizer").warning("a library warning")
    for _ in range(3):
        logging.getLogger("hybridflow.rollout").warning("config looks odd: %s", "x")
    logging.getLogger("megatron.core").error("a library error")
    logging.getLogger("hybridflow.worker").error("a worker error")
    print(path)
""")


def test_worker_output_goes_to_its_file_and_only_what_matters_to_the_console(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # fd 1 went to the file
    console = proc.stderr.splitlines()
    assert len(console) == 3, console
    assert "[actor+rollout rank 1] hybridflow.rollout: config looks odd: x" in console[0]
    assert console[1].endswith("megatron.core: a library error") and "ERROR" in console[1]
    assert console[2].endswith("hybridflow.worker: a worker error")
    text = (tmp_path / "actor_rollout_rank1.log").read_text()
    for needle in ("plain print", "C-level stderr", "Transformer Engine and Apex", "vLLM start-up line",
                   "a library warning", "a library error", "a worker error"):
        assert needle in text, needle
    assert text.count("config looks odd") == 3  # the file keeps every occurrence
