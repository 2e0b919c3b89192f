"""Checkpoint conversion: Hugging Face <-> Megatron dist checkpoint, and Megatron re-layout.

    torchrun --nproc-per-node T*P -m megatron_workers.convert hf-to-mcore --hf HF_DIR --out MCORE_DIR --tp T --pp P
    torchrun --nproc-per-node T*P -m megatron_workers.convert mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--tp T --pp P]
    torchrun --nproc-per-node T*P -m megatron_workers.convert relayout --mcore MCORE_DIR --out MCORE_DIR2 --tp T --pp P

Any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT works (torchrun, torchrun under Ray);
without one the command runs as a single process (TP=PP=1). The backend is detected: NCCL with CUDA, gloo
without. The world size must be T*P (no data parallelism: every rank holds a distinct shard).

- hf-to-mcore: each rank reads only its own rows/columns of the safetensors files (hf_io's sliced loader)
  and the shards are written with dist_checkpointing. config.json, generation_config.json and the
  tokenizer files are copied to <out>/hf_config, so the way back needs no extra arguments.
- mcore-to-hf: loads the dist checkpoint at the requested layout (any TP/PP: dist_checkpointing stores
  global shapes and offsets) and writes an HF directory (safetensors + config + tokenizer) that
  transformers and vLLM load. Trainer checkpoints (model + optimizer) work too: only the model is read;
  they carry no hf_config, so pass --hf-config (hybridflow.trainer.export does that for you).
- relayout: mcore -> mcore at another TP/PP (load at the new layout, save again).

Every check that can fail on the inputs (paths, config, tensor names, layout against heads/ffn/layers and
the world size) runs before any process group is created or megatron is imported. All layout knowledge is
in hf_mapping (names), hybridflow/parallel/dims.py (what divides what) and dist_checkpointing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridflow.parallel.dims import LayoutError, ModelShape, ParallelDims
from megatron_workers import hf_io, hf_mapping
from megatron_workers.model_builder import UnsupportedModelError, read_hf_facts

log = logging.getLogger("megatron_workers.convert")

HF_CONFIG_DIR = "hf_config"  # inside a Megatron checkpoint written here: where the HF side is kept
CONVERT_FILE = "hybridflow_convert.json"  # what wrote the checkpoint, from what, at which layout
_HF_SIDE_FILES = ("config.json", *hf_io.TOKENIZER_FILES)
_DTYPES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_EMBEDDING_KEY = "embedding.word_embeddings.weight"


class ConvertError(ValueError):
    """Bad input to a conversion; the message names the path, key or number at fault."""


@dataclass
class Job:
    """One conversion, fully checked: what every rank does, with no decision left for later."""

    command: str  # hf-to-mcore | mcore-to-hf | relayout
    source: Path
    out: Path
    tp: int
    pp: int
    dtype: str
    hf_config_dir: Path  # config.json (+ generation_config.json) comes from here
    tokenizer_dir: Path  # tokenizer files come from here
    hf_config: dict = field(repr=False, default_factory=dict)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, pp=self.pp)


# --------------------------------------------------------------------------- checks (no process group yet)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_layout(hf_config: dict, tp: int, pp: int, world_size: int, where: Path) -> None:
    """The model's heads / kv heads / ffn / layers first (the more telling error), then the world size."""
    try:
        read_hf_facts(hf_config)
        dims = ParallelDims(tp=tp, pp=pp)
        dims.validate(model=ModelShape.from_hf_config(hf_config))
    except (LayoutError, UnsupportedModelError) as e:
        raise ConvertError(f"{where / 'config.json'}: {e}") from e
    if world_size != dims.world_size:
        raise ConvertError(f"world size {world_size} != tp*pp = {tp}*{pp}: launch with "
                           f"torchrun --nproc-per-node {dims.world_size} (every rank holds a distinct shard)")


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out}: exists and is not an empty directory (refusing to overwrite)")


def _hf_dtype(hf_dir: Path, weight_map: dict[str, Path]) -> str:
    """The dtype the weights are stored in (read from the embedding's safetensors header)."""
    name = "model.embed_tokens.weight"
    path = weight_map[name]
    code = hf_io.safetensors_header(path)[name]["dtype"]
    if code not in _SAFETENSORS_DTYPES:
        raise ConvertError(f"{path}: {name} is stored as {code}; supported: {sorted(_SAFETENSORS_DTYPES)}")
    return _SAFETENSORS_DTYPES[code]


def plan_hf_to_mcore(hf: str, out: str, tp: int, pp: int, dtype: str = "auto",
                     world_size: int | None = None) -> Job:
    hf_dir, out_dir = Path(hf), Path(out)
    if not hf_dir.is_dir():
        raise ConvertError(f"--hf {hf_dir}: no such directory")
    try:
        cfg = hf_io.read_hf_config(hf_dir)
        _check_layout(cfg, tp, pp, world_size_from_env() if world_size is None else world_size, hf_dir)
        needed = {h for name in hf_mapping.mcore_param_names(cfg) for h in hf_mapping.describe(name, cfg).hf_names}
        weight_map = hf_io.check_checkpoint(hf_dir, needed)
    except hf_io.CheckpointError as e:
        raise ConvertError(str(e)) from e
    _check_out(out_dir)
    dtype = _hf_dtype(hf_dir, weight_map) if dtype == "auto" else dtype
    return Job("hf-to-mcore", hf_dir, out_dir, tp, pp, dtype, hf_dir, hf_dir, cfg)


def saved_layout(mcore_dir: Path) -> dict | None:
    from megatron_workers.dist_ckpt import saved_layout as read

    return read(mcore_dir)


def check_mcore_against_config(mcore_dir: Path, hf_config: dict, cfg_dir: Path) -> str:
    """Check the dist checkpoint holds this config's model (torch_dist metadata; no tensor is read).

    Returns the dtype of its model tensors. Catches a wrong --hf-config before any process starts
    (megatron stores the layers stacked: (num_layers, ...) per parameter).
    """
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(mcore_dir)).read_metadata().state_dict_metadata
    f = read_hf_facts(hf_config)
    qkv_rows = (f.num_heads + 2 * f.num_kv_heads) * f.head_dim
    expected = {_EMBEDDING_KEY: (None, f.hidden_size),
                "decoder.layers.self_attention.linear_qkv.weight": (f.num_layers, qkv_rows, f.hidden_size)}
    if f.is_moe:  # megatron stores every layer's experts stacked too: (layers, experts, ...)
        expected["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = (
            f.num_layers, f.num_experts, 2 * f.moe_ffn_hidden_size, f.hidden_size)
    else:
        expected["decoder.layers.mlp.linear_fc1.weight"] = (f.num_layers, 2 * f.ffn_hidden_size, f.hidden_size)
    for key, shape in expected.items():
        if key not in meta:
            model_keys = sorted(k for k in meta if not re.match(r"(chained_\d+\.)?optimizer\.", k))
            raise ConvertError(f"{mcore_dir}: the checkpoint has no {key!r} (model keys: {model_keys[:5]} ...)")
        have = tuple(meta[key].size)
        if len(have) != len(shape) or any(e is not None and e != h for e, h in zip(shape, have)):
            raise ConvertError(f"{mcore_dir}: {key} has global shape {have}, {cfg_dir / 'config.json'} implies "
                               f"{tuple('*' if e is None else e for e in shape)}: is --hf-config the right model?")
    return str(meta[_EMBEDDING_KEY].properties.dtype).removeprefix("torch.")


def _plan_from_mcore(command: str, mcore: str, out: str, tp: int | None, pp: int | None, hf_config: str | None,
                     tokenizer: str | None, world_size: int | None) -> Job:
    src, out_dir = Path(mcore), Path(out)
    if not src.is_dir():
        raise ConvertError(f"--mcore {src}: no such directory")
    if not (src / "metadata.json").is_file():
        hint = (" (a trainer step dir: use its actor/ subdir, or python -m hybridflow.trainer.export)"
                if (src / "actor").is_dir() else "")
        raise ConvertError(f"--mcore {src}: not a Megatron dist checkpoint (no metadata.json){hint}")
    cfg_dir = Path(hf_config) if hf_config else src / HF_CONFIG_DIR
    if not (cfg_dir / "config.json").is_file():
        how = "" if hf_config else (f" and {src} has no {HF_CONFIG_DIR}/ (it was not written by hf-to-mcore): pass "
                                    "--hf-config with the HF directory the model came from")
        raise ConvertError(f"{cfg_dir / 'config.json'}: config.json not found{how}")
    world = world_size_from_env() if world_size is None else world_size
    saved = saved_layout(src)
    if tp is None and pp is None:
        if saved and saved["tp"] * saved["pp"] == world:
            tp, pp = saved["tp"], saved["pp"]
        elif world == 1:
            tp, pp = 1, 1
        else:
            raise ConvertError(f"{src}: saved at {saved}; with {world} processes pass --tp and --pp (tp*pp={world})")
    tp, pp = tp or 1, pp or 1
    cfg = hf_io.read_hf_config(cfg_dir)
    _check_layout(cfg, tp, pp, world, cfg_dir)
    _check_out(out_dir)
    dtype = check_mcore_against_config(src, cfg, cfg_dir)
    tok_dir = Path(tokenizer) if tokenizer else cfg_dir
    if not tok_dir.is_dir():
        raise ConvertError(f"--tokenizer {tok_dir}: no such directory")
    return Job(command, src, out_dir, tp, pp, dtype, cfg_dir, tok_dir, cfg)


def plan_mcore_to_hf(mcore: str, out: str, tp: int | None = None, pp: int | None = None,
                     hf_config: str | None = None, tokenizer: str | None = None,
                     world_size: int | None = None) -> Job:
    return _plan_from_mcore("mcore-to-hf", mcore, out, tp, pp, hf_config, tokenizer, world_size)


def plan_relayout(mcore: str, out: str, tp: int, pp: int, hf_config: str | None = None,
                  world_size: int | None = None) -> Job:
    return _plan_from_mcore("relayout", mcore, out, tp, pp, hf_config, None, world_size)


# --------------------------------------------------------------------------- running (collective)


@contextlib.contextmanager
def megatron_session(dims: ParallelDims, timeout_s: float = 300.0):
    """Megatron's groups for `dims` for the duration; the default group too if nobody created it.

    Without launcher variables a single process joins a world of one through an in-memory store.
    """
    import torch.distributed as dist

    from megatron_workers import parallel_init

    owns = not dist.is_initialized()
    if owns and "RANK" not in os.environ:
        import datetime

        dist.init_process_group(parallel_init.default_backend(), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    parallel_init.init_distributed(timeout_s=timeout_s)
    parallel_init.init_model_parallel(dims, seed=0, timeout_s=timeout_s)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if owns:
            dist.destroy_process_group()


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _config_with_dtype(hf_config: dict, dtype: str) -> dict:
    """config.json as given, but naming the dtype the exported tensors are in (vLLM's dtype="auto" reads it)."""
    keys = [k for k in ("dtype", "torch_dtype") if k in hf_config] or ["dtype"]
    return {**hf_config, **dict.fromkeys(keys, dtype)}


def _copy_hf_side(src_cfg: Path, src_tok: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in _HF_SIDE_FILES:
        src = (src_cfg if name in ("config.json", "generation_config.json") else src_tok) / name
        if src.is_file():
            shutil.copyfile(src, dst / name)


def _write_record(job: Job, seconds: dict) -> None:
    record = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(job).items() if k != "hf_config"}
    (job.out / CONVERT_FILE).write_text(json.dumps({**record, "seconds": seconds}, indent=1) + "\n")


def run(job: Job) -> dict:
    """Run a checked job on every rank (collective). Returns timings (seconds) per phase (+ HF bytes read)."""
    import torch.distributed as dist

    from megatron_workers.dist_ckpt import load_checkpoint, save_checkpoint
    from megatron_workers.model_builder import build_gpt_model

    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    with megatron_session(job.dims):
        seconds["init"] = time.perf_counter() - t0
        t = time.perf_counter()
        model = build_gpt_model(job.hf_config, job.dims, dtype=_torch_dtype(job.dtype))
        seconds["build"] = time.perf_counter() - t
        t = time.perf_counter()
        if job.command == "hf-to-mcore":
            # this rank's own rows/columns only; the byte count shows it (and lands in the record)
            seconds["hf_bytes_read"] = hf_io.load_hf_into_mcore(model, job.source, job.hf_config)["bytes_read"]
        else:
            load_checkpoint(job.source, [model], restore_rng=False)
        seconds["read"] = time.perf_counter() - t
        t = time.perf_counter()
        if job.command == "mcore-to-hf":
            hf_io.export_mcore_to_hf(model, _config_with_dtype(job.hf_config, job.dtype), job.out,
                                     tokenizer_dir=job.tokenizer_dir)
        else:
            save_checkpoint(job.out, [model], extra={"converted_from": str(job.source)})
        seconds["write"] = time.perf_counter() - t
        if dist.get_rank() == 0:
            if job.command != "mcore-to-hf":
                _copy_hf_side(job.hf_config_dir, job.tokenizer_dir, job.out / HF_CONFIG_DIR)
            seconds["total"] = time.perf_counter() - t0
            _write_record(job, seconds)
        dist.barrier()
    seconds.setdefault("total", time.perf_counter() - t0)
    return seconds


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_workers.convert", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> Megatron dist checkpoint at --tp/--pp")
    a.add_argument("--hf", required=True, help="HF directory: config.json, *.safetensors, tokenizer files")
    a.add_argument("--out", required=True, help="new (empty) directory for the dist checkpoint")
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    a.add_argument("--dtype", default="auto", choices=("auto", *_DTYPES), help="auto: as stored in the HF files")
    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF directory")
    b.add_argument("--mcore", required=True, help="a dist checkpoint (ours, or a trainer step's actor/)")
    b.add_argument("--out", required=True, help="new (empty) directory for the HF model")
    b.add_argument("--tp", type=int, default=None, help="layout to read at (default: as saved, if it fits)")
    b.add_argument("--pp", type=int, default=None)
    b.add_argument("--hf-config", default=None, help=f"HF dir with config.json (default: <mcore>/{HF_CONFIG_DIR})")
    b.add_argument("--tokenizer", default=None, help="dir with the tokenizer files (default: the --hf-config dir)")
    c = sub.add_parser("relayout", help="Megatron dist checkpoint -> dist checkpoint at another --tp/--pp")
    c.add_argument("--mcore", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--tp", type=int, required=True)
    c.add_argument("--pp", type=int, required=True)
    c.add_argument("--hf-config", default=None, help=f"HF dir with config.json (default: <mcore>/{HF_CONFIG_DIR})")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> Job:
    if args.command == "hf-to-mcore":
        return plan_hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.dtype)
    if args.command == "mcore-to-hf":
        return plan_mcore_to_hf(args.mcore, args.out, args.tp, args.pp, args.hf_config, args.tokenizer)
    return plan_relayout(args.mcore, args.out, args.tp, args.pp, args.hf_config)


def main(argv: list[str] | None = None) -> dict:
    try:
        job = plan(parse_args(argv))
    except ConvertError as e:
        raise SystemExit(f"convert: error: {e}") from None
    seconds = run(job)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"convert {job.command} {job.source} -> {job.out} at tp={job.tp} pp={job.pp} ({job.dtype}): "
              + json.dumps({k: round(v, 3) for k, v in seconds.items()}), file=sys.stderr, flush=True)
    return seconds


if __name__ == "__main__":  # dist_checkpointing's writer starts a multiprocessing Manager: keep this guard
    main()
