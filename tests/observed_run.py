"""One real tiny PPO run that several test modules watch, so the suite pays for its start-up once.

`python -m hybridflow.trainer.main` (Ray driver, Megatron TP=2 actor+ref and critic, vLLM rollout) in a
subprocess, 2 steps of two mini-batches each (so the old-log-prob pass runs and every stage has a timer), with
everything an operator looks at switched on at once:
- the prometheus logger on a free loopback port, scraped every 0.1 s while the run runs (tests/test_prometheus.py);
- the torch.profiler timeline of step 2 (tests/test_timeline.py);
- a non-finite critic update injected at step 1, whose warning must reach the quiet console once per rank
  (tests/test_timeline.py);
- the metric keys verl users read and the curves plot (tests/test_e2e_trainer.py).
conftest.py's session fixture `observed_run` calls `run_observed` once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT, EXPERIMENT = "promtest", "tiny2"


def scrape(url: str, timeout: float = 5.0) -> dict[str, list[tuple[dict, float]]]:
    """One scrape: {metric family: [(labels, value)]}, read with prometheus_client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return {f.name: [(dict(s.labels), s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def run_observed(root: Path) -> dict:
    """Run the job under `root`; returns run_dir, console (stdout+stderr as a terminal shows them), the
    metrics.jsonl rows and the scrapes (each a parsed snapshot taken while a step was being served)."""
    from hybridflow.trainer.warmstart import prepare

    assets = prepare(root / "assets", sft_steps=2, train_size=256, test_size=16)
    run_dir = root / "run"
    cmd = [sys.executable, "-m", "hybridflow.trainer.main", "--config", str(REPO / "configs" / "ppo_tiny_cpu.yaml"),
           f"trainer.default_local_dir={run_dir}", "trainer.logger=[console,jsonl,prometheus]",
           "trainer.prometheus.mode=http", "trainer.prometheus.port=0",
           "trainer.prometheus.linger_s=2",  # step 2 takes ~0.4 s: the last step stays up for the scraper
           f"trainer.project_name={PROJECT}", f"trainer.experiment_name={EXPERIMENT}",
           "trainer.ray.timeout_s=300", "trainer.ray.object_store_memory=268435456",
           "data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1",
           f"actor_rollout_ref.model.path={assets['model']}", f"data.train_files=[{assets['train']}]",
           # two mini-batches per step: the old-log-prob pass runs, so every stage has its timing
           "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
           "trainer.total_training_steps=2", "trainer.save_freq=-1",
           f"trainer.timeline_dir={run_dir / 'timeline'}", "trainer.timeline_steps=[2]"]
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "HYBRIDFLOW_FAULT": "stage=update_critic,step=1,kind=nan,role=critic",
           "HYBRIDFLOW_FAULT_STATE": str(root / "fault_state")}
    # Fresh worker interpreters, not the tests' forked ones (tests/ray_zygote.py): this run checks what a worker's
    # start-up prints (library warnings at import) reaches its log file and not the console.
    env.pop("RAY_RUNTIME_ENV_HOOK", None)
    log_path = root / "console.log"
    scrapes: list[dict] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            url, deadline = None, time.monotonic() + 480
            while proc.poll() is None and time.monotonic() < deadline:
                if url is None:
                    m = re.search(r"prometheus metrics: (http://\S+)", log_path.read_text())
                    url = m.group(1) if m else None
                if url is not None:
                    try:
                        got = scrape(url, timeout=2)
                    except OSError:  # not yet serving, or the run just closed it
                        got = {}
                    if "hybridflow_training_global_step" in got:
                        scrapes.append(got)
                time.sleep(0.1)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
    console = log_path.read_text()
    assert rc == 0, console[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"run_dir": run_dir, "console": console, "rows": rows, "scrapes": scrapes}
