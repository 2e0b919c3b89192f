"""Experiment tracking: several backends at once, chosen by `trainer.logger`.

console (a tqdm bar over steps showing reward and throughput on a terminal; one line per step when
stderr is not one, e.g. in `ray job logs` or a log file, where a bar's carriage returns pile up), jsonl (one object
per step, with "step"), tensorboard, wandb (offline: works with no network),
mlflow (local file store), prometheus (gauges: an HTTP endpoint on loopback or Ray's metrics
export, hybridflow/trainer/prometheus.py). A backend that cannot start fails at construction,
before any worker is launched.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)
BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "prometheus")


class Tracking:
    def __init__(self, backends: list[str], run_dir: str | Path, project: str, experiment: str,
                 config: dict | None = None, total_steps: int | None = None, start_step: int = 0,
                 prometheus: dict | None = None):
        """`prometheus`: make_exporter's keyword arguments (mode, host, port, linger_s, joined_cluster)."""
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.backends = list(backends)
        self._bar = self._jsonl = self._tb = self._wandb = self._mlflow = self._prom = None
        if "prometheus" in backends:  # first: a busy port fails before any other backend opened a file
            from hybridflow.trainer.prometheus import make_exporter

            self._prom = make_exporter(project=project, experiment=experiment, **(prometheus or {}))
        if "console" in backends:
            if _is_tty(sys.stderr):
                from tqdm import tqdm

                self._bar = tqdm(total=total_steps, initial=start_step, desc=f"{experiment}", unit="step",
                                 dynamic_ncols=True)
            else:
                self._bar = StepLines(experiment, total_steps, start_step)
        if "jsonl" in backends:
            path = self.run_dir / "metrics.jsonl"
            prepare_jsonl(path, start_step)
            self._jsonl = open(path, "a")  # noqa: SIM115 - closed in finish()
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in backends:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(project=project, name=experiment, config=config or {},
                                     dir=str(self.run_dir), mode=os.environ["WANDB_MODE"])
        if "mlflow" in backends:
            import mlflow

            # A local file store needs no server; mlflow 3 asks for an explicit opt-in to it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())
            mlflow.set_experiment(project)
            self._mlflow = mlflow.start_run(run_name=experiment)
            if config:
                mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def log(self, metrics: dict[str, float], step: int, advance: bool = True) -> None:
        """advance=False: a row that is not a training step (validation before training) leaves the bar's count."""
        clean = {k: float(v) for k, v in metrics.items() if _finite(v)}
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb:
            self._wandb.log(clean, step=step)
        if self._mlflow:
            import mlflow

            mlflow.log_metrics({k.replace("@", "_"): v for k, v in clean.items()}, step=step)
        if self._prom:  # after the jsonl row: a scraper that sees step N finds its row on disk
            self._prom.update(clean)
        if self._bar is not None:
            post = {}
            for key, short in (("critic/score/mean", "reward"), ("perf/throughput", "tok/s/dev"),
                               ("perf/time_per_step", "s/step")):
                if key in clean:
                    post[short] = f"{clean[key]:.3g}"
            if post:
                self._bar.set_postfix(post, refresh=False)
            if advance:
                self._bar.update(1)

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """Validation samples (input, output, score; trainer.log_val_generations picks them) to the backends that
        keep text: console (printed), jsonl (val_generations.jsonl, one object per sample), tensorboard (a text
        table), wandb (a table), mlflow (an artifact per step). Prometheus keeps numbers only."""
        if not samples:
            return
        rows = [{"step": step, "input": i, "output": o, "score": s} for i, o, s in samples]
        if self._bar is not None:
            text = "\n".join(f"[validation sample {k + 1}/{len(rows)} at step {step}]\n[prompt] {r['input']}\n"
                             f"[response] {r['output']}\n[score] {r['score']}" for k, r in enumerate(rows))
            print(text, file=sys.stderr, flush=True)
        if self._jsonl:
            with open(self.run_dir / "val_generations.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if self._tb:
            table = "| input | output | score |\n|---|---|---|\n" + "\n".join(
                f"| {_cell(r['input'])} | {_cell(r['output'])} | {r['score']:.4g} |" for r in rows)
            self._tb.add_text("val/generations", table, step)
            self._tb.flush()
        if self._wandb:
            import wandb

            table = wandb.Table(columns=["step", "input", "output", "score"],
                                data=[[r["step"], r["input"], r["output"], r["score"]] for r in rows])
            self._wandb.log({"val/generations": table}, step=step)
        if self._mlflow:
            import mlflow

            mlflow.log_dict({"samples": rows}, f"val_generations/step_{step}.json")

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
        if self._mlflow:
            import mlflow

            mlflow.end_run()
        if self._prom:
            self._prom.close()


def _cell(text: str) -> str:
    """Text in one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class StepLines:
    """The console progress without a terminal: `<experiment> step 3/80 reward=0.51 tok/s/dev=812 s/step=2.1`,
    one flushed line per step (tqdm's interface as far as Tracking uses it)."""

    def __init__(self, desc: str, total: int | None, initial: int = 0, stream=None):
        self.desc, self.total, self.n, self.stream = desc, total, initial, stream
        self._post: dict = {}

    def set_postfix(self, post: dict, refresh: bool = False) -> None:
        self._post = dict(post)

    def update(self, n: int = 1) -> None:
        self.n += n
        total = f"/{self.total}" if self.total else ""
        post = "".join(f" {k}={v}" for k, v in self._post.items())
        print(f"{self.desc} step {self.n}{total}{post}", file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def prepare_jsonl(path: Path, start_step: int) -> Path | None:
    """Make `path` hold exactly the rows of steps <= start_step before this run appends to it.

    A resumed run (start_step = the checkpoint's step) keeps the rows up to its checkpoint; rows of later
    steps came from a run killed after its last checkpoint and will be redone, so they would appear twice.
    A fresh run (start_step = 0) in an old run directory starts an empty file. Nothing is lost: whenever
    rows are dropped, the whole old file is kept beside it as metrics.jsonl.<n>.old. Returns that copy.
    """
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if start_step > 0 and json.loads(line).get("step", 0) <= start_step]
    if len(keep) == len(lines):
        return None
    n = 0
    while path.with_name(f"{path.name}.{n}.old").exists():
        n += 1
    backup = path.with_name(f"{path.name}.{n}.old")
    path.rename(backup)
    path.write_text("".join(line + "\n" for line in keep))
    log.info("%s: kept %d of %d rows (steps <= %d); the old file is %s", path, len(keep), len(lines), start_step,
             backup)
    return backup


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
