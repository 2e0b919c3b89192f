"""Export a trained actor as a Hugging Face directory, in one command.

    python -m hybridflow.trainer.export RUN_DIR_OR_STEP_DIR --out HF_DIR [--tp T --pp P] [--hf-config DIR]

Given a run directory (trainer.default_local_dir) it takes the newest *complete* checkpoint
(checkpoints/global_step_<N>/COMPLETE, the trainer's own rule in checkpoint.py); given a step directory,
that one. The HF config and tokenizer come from the run's config.yaml (actor_rollout_ref.model.path and
.tokenizer_path), the layout to read at from the actor checkpoint's hybridflow_layout.json (as saved), and
the conversion itself is `megatron_workers.convert mcore-to-hf` under torchrun on this machine with tp*pp
processes. The output loads with transformers' from_pretrained and vLLM's LLM(model=HF_DIR).

Every input is checked here before torchrun starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hybridflow.trainer.checkpoint import MARKER, CheckpointManager

REPO = Path(__file__).resolve().parents[2]
ACTOR = "actor"
EXPORT_FILE = "hybridflow_export.json"


class ExportError(ValueError):
    """Bad input to an export; the message names the path or key at fault."""


@dataclass(frozen=True)
class ExportPlan:
    step: int
    step_dir: Path
    actor_dir: Path
    hf_config_dir: Path
    tokenizer_dir: Path
    tp: int
    pp: int
    out: Path

    @property
    def nproc(self) -> int:
        return self.tp * self.pp

    def command(self) -> list[str]:
        convert = ["-m", "megatron_workers.convert", "mcore-to-hf", "--mcore", str(self.actor_dir),
                   "--out", str(self.out), "--tp", str(self.tp), "--pp", str(self.pp),
                   "--hf-config", str(self.hf_config_dir), "--tokenizer", str(self.tokenizer_dir)]
        # --standalone: a local rendezvous on a free port torchrun picks itself
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                *convert]


def find_step_dir(path) -> tuple[int, Path]:
    """(step, dir) of a step directory, or of the newest complete checkpoint of a run / checkpoints dir."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory")
    if (path / MARKER).is_file():
        try:
            step = int(CheckpointManager.trainer_state(path)["global_step"])
        except (OSError, KeyError, ValueError) as e:
            raise ExportError(f"{path / 'trainer_state.json'}: no readable global_step ({e})") from e
        return step, path
    if path.name.startswith("global_step_"):
        raise ExportError(f"{path}: an incomplete checkpoint (no {MARKER} marker: the run stopped while writing it)")
    for root in (path / "checkpoints", path):
        found = CheckpointManager(root).latest()
        if found is not None:
            return found
    raise ExportError(f"{path}: no complete checkpoint (looked for checkpoints/global_step_<N>/{MARKER} and "
                      f"global_step_<N>/{MARKER})")


def _run_config(step_dir: Path):
    from omegaconf import OmegaConf

    path = step_dir.parent.parent / "config.yaml"  # <run>/checkpoints/global_step_<N>
    if not path.is_file():
        return None, path
    return OmegaConf.load(path), path


def plan_export(path, out, tp: int | None = None, pp: int | None = None, hf_config: str | None = None,
                tokenizer: str | None = None) -> ExportPlan:
    step, step_dir = find_step_dir(path)
    actor = step_dir / ACTOR
    if not (actor / "metadata.json").is_file():
        raise ExportError(f"{actor}: no actor dist checkpoint (metadata.json missing)")
    cfg, cfg_path = _run_config(step_dir)

    def from_config(key: str) -> str | None:
        if cfg is None:
            return None
        from omegaconf import OmegaConf

        value = OmegaConf.select(cfg, key)
        return None if value in (None, "") else str(value)

    cfg_dir = hf_config or from_config("actor_rollout_ref.model.path")
    if cfg_dir is None:
        raise ExportError(f"{cfg_path}: not found or no actor_rollout_ref.model.path; pass --hf-config with the "
                          "HF directory the actor started from")
    if not (Path(cfg_dir) / "config.json").is_file():
        key = "--hf-config" if hf_config else f"actor_rollout_ref.model.path in {cfg_path}"
        raise ExportError(f"{key}: {Path(cfg_dir) / 'config.json'} not found (the HF config and tokenizer are read "
                          "from there; pass --hf-config if the model moved)")
    tok_dir = tokenizer or from_config("actor_rollout_ref.model.tokenizer_path") or cfg_dir
    layout = _saved_layout(actor)
    megatron = "actor_rollout_ref.actor.megatron."  # only for checkpoints without a layout file
    tp = tp or (layout or {}).get("tp") or int(from_config(megatron + "tensor_model_parallel_size") or 1)
    pp = pp or (layout or {}).get("pp") or int(from_config(megatron + "pipeline_model_parallel_size") or 1)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: exists and is not an empty directory (refusing to overwrite)")
    # The converter's own checks (layout against heads/ffn/layers, dtype, tokenizer dir) before torchrun starts.
    from megatron_workers.convert import ConvertError, plan_mcore_to_hf

    try:
        plan_mcore_to_hf(str(actor), str(out), tp, pp, str(cfg_dir), str(tok_dir), world_size=tp * pp)
    except ConvertError as e:
        raise ExportError(str(e)) from e
    # absolute: torchrun's processes must find them whatever their working directory
    return ExportPlan(step, step_dir.resolve(), actor.resolve(), Path(cfg_dir).resolve(), Path(tok_dir).resolve(),
                      tp, pp, out.resolve())


def _saved_layout(actor: Path) -> dict | None:
    file = actor / "hybridflow_layout.json"  # dist_ckpt.LAYOUT_FILE (not imported: keeps this free of megatron)
    return json.loads(file.read_text()) if file.is_file() else None


def run_export(plan: ExportPlan, timeout_s: float = 900.0) -> dict:
    """Run the conversion under torchrun; returns the record written next to the HF files."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    t = time.perf_counter()
    proc = subprocess.run(plan.command(), env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if "warn" not in ln.lower())
        raise RuntimeError(f"export of {plan.actor_dir} failed (rc={proc.returncode}):\n{tail[-4000:]}")
    record = {"step": plan.step, "checkpoint": str(plan.step_dir), "tp": plan.tp, "pp": plan.pp,
              "hf_config": str(plan.hf_config_dir), "tokenizer": str(plan.tokenizer_dir),
              "seconds": round(time.perf_counter() - t, 3)}
    (plan.out / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m hybridflow.trainer.export", description=__doc__.splitlines()[0])
    p.add_argument("path", help="a run dir (newest complete checkpoint) or a checkpoints/global_step_<N> dir")
    p.add_argument("--out", required=True, help="new (empty) directory for the HF model")
    p.add_argument("--tp", type=int, default=None, help="layout to read at (default: as saved)")
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--hf-config", default=None, help="HF dir with config.json (default: the run's model.path)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the run's model.tokenizer_path or path)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    try:
        plan = plan_export(args.path, args.out, args.tp, args.pp, args.hf_config, args.tokenizer)
    except ExportError as e:
        raise SystemExit(f"export: error: {e}") from None
    record = run_export(plan, args.timeout_s)
    print(f"exported step {plan.step} of {plan.step_dir} to {plan.out} (tp={plan.tp} pp={plan.pp}, "
          f"{record['seconds']} s)")
    return record


if __name__ == "__main__":
    main()
