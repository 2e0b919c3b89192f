"""Load a Hugging Face checkpoint into Megatron model chunks, and export them back.

Loading: each rank opens the safetensors files lazily and reads only the rows /
columns of its own TP shard and PP stage (`safe_open(...).get_slice`). All
files and tensor names are checked first (header, size, names), so a missing or
truncated checkpoint fails with the file named before any weight is read.

Exporting: TP shards are all-gathered inside each TP group, PP stages send
their HF tensors to global rank 0 with point-to-point sends (gloo and nccl
both support them), and rank 0 writes config.json, model.safetensors (or
shards + index) and the tokenizer files, so `AutoModelForCausalLM.from_pretrained`
loads the directory.

All layout knowledge comes from `hf_mapping`.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_workers import hf_mapping

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded: the message names the file."""


# --------------------------------------------------------------------------- reading


def read_hf_config(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def safetensors_header(path: Path) -> dict:
    """Parse and check a safetensors header against the file size, without reading tensor data."""
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file is missing")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, the header length alone is 8)")
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header says {header_len} bytes, "
                                  f"file has {size - 8} after the length)")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, tensors need "
                              f"{8 + header_len + data_end})")
    return header


def checkpoint_weight_map(hf_dir) -> dict[str, Path]:
    """HF tensor name -> file, from the index if sharded, else from the single file's header."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        return {name: hf_dir / fname for name, fname in weight_map.items()}
    single = hf_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")
    return {name: single for name in safetensors_header(single) if name != "__metadata__"}


def check_checkpoint(hf_dir, needed_names) -> dict[str, Path]:
    """Check that every needed tensor is listed and its file is complete, before any tensor data is read."""
    hf_dir = Path(hf_dir)
    weight_map = checkpoint_weight_map(hf_dir)
    missing = sorted(set(needed_names) - weight_map.keys())
    if missing:
        where = hf_dir / (INDEX_FILE if (hf_dir / INDEX_FILE).is_file() else SINGLE_FILE)
        raise CheckpointError(f"{where}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for path in sorted({weight_map[n] for n in needed_names}):
        header = safetensors_header(path)
        absent = sorted(n for n in needed_names if weight_map[n] == path and n not in header)
        if absent:
            raise CheckpointError(f"{path}: the index lists {absent[:5]} in this file, but the file lacks them")
    return weight_map


class _SliceReader:
    """A hf_mapping.Reader over safetensors files: reads only the requested rows/columns."""

    def __init__(self, weight_map: dict[str, Path]):
        from safetensors import safe_open

        self._weight_map = weight_map
        self._open = safe_open
        self._handles = {}
        self.bytes_read = 0

    def __call__(self, name, dim, start, stop):
        path = self._weight_map[name]
        if path not in self._handles:
            self._handles[path] = self._open(str(path), framework="pt")
        sl = self._handles[path].get_slice(name)
        if dim is None:
            out = sl[:]
        else:
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(start, stop)
            out = sl[tuple(index)]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self):
        self._handles.clear()


def _tp_coords(expert: bool = False) -> tuple[int, int]:
    """(rank, size) in the group that splits a parameter: tp, or etp for an expert's weights."""
    from megatron.core import parallel_state

    if expert:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def load_hf_into_mcore(model_chunks, hf_dir, hf_config=None) -> dict:
    """Copy the HF weights in `hf_dir` into this rank's Megatron chunks (in place).

    Call before creating the optimizer (or reload the optimizer's main params after).
    Returns {"tensors": n, "bytes_read": n} for this rank.
    """
    hf_dir = Path(hf_dir)
    hf_config = hf_config if hf_config is not None else read_hf_config(hf_dir)
    chunks = model_chunks if isinstance(model_chunks, list | tuple) else [model_chunks]

    params = [(name, p) for chunk in chunks for name, p in hf_mapping.global_named_parameters(chunk)]
    needed = {hf for name, _ in params for hf in hf_mapping.describe(name, hf_config).hf_names}
    weight_map = check_checkpoint(hf_dir, needed)

    read = _SliceReader(weight_map)
    try:
        with torch.no_grad():
            for name, param in params:
                tp_rank, tp_size = _tp_coords(hf_mapping.is_expert(name))
                shard = hf_mapping.mcore_shard_from_hf(name, read, hf_config, tp_rank, tp_size)
                if tuple(shard.shape) != tuple(param.shape):
                    raise CheckpointError(f"{hf_dir}: {name} from HF has shape {tuple(shard.shape)}, the Megatron "
                                          f"parameter on TP rank {tp_rank}/{tp_size} has {tuple(param.shape)}")
                param.data.copy_(shard.to(dtype=param.dtype))
    finally:
        read.close()
    return {"tensors": len(params), "bytes_read": read.bytes_read}


# --------------------------------------------------------------------------- writing


def _gather_tp(param: torch.Tensor, expert: bool = False) -> torch.Tensor:
    from megatron.core import parallel_state

    _, tp_size = _tp_coords(expert)
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    group = (parallel_state.get_expert_tensor_parallel_group() if expert
             else parallel_state.get_tensor_model_parallel_group())
    shards = [torch.empty_like(param) for _ in range(tp_size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return hf_mapping.gather_to_full(shards, param)


def _gather_experts(name: str, full: torch.Tensor, chunk) -> list[tuple[str, torch.Tensor]]:
    """(global name, tensor) of this expert weight on every EP rank: rank k's local expert j is global expert
    k * E/ep + j, the same j on every rank, so one all-gather per local weight (all EP ranks iterate alike)."""
    from megatron.core import parallel_state

    config = hf_mapping.unwrap(chunk).config
    ep = config.expert_model_parallel_size
    if ep == 1:
        return [(name, full)]
    local = config.num_moe_experts // ep
    parts = [torch.empty_like(full) for _ in range(ep)]
    dist.all_gather(parts, full.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    offset = hf_mapping.expert_offset(chunk)
    local_name = hf_mapping.global_to_local_name(name, 0, offset)
    return [(hf_mapping.local_to_global_name(local_name, 0, k * local), part) for k, part in enumerate(parts)]


def _stage_hf_tensors(chunks, hf_config, keep: bool) -> list[tuple[str, torch.Tensor]]:
    """This stage's HF tensors; every TP (and EP) rank joins the all-gathers, only `keep` ranks convert and keep
    them."""
    out = []
    for chunk in chunks:
        for name, param in hf_mapping.global_named_parameters(chunk):
            expert = hf_mapping.is_expert(name)
            full = _gather_tp(param, expert)
            named = _gather_experts(name, full, chunk) if expert else [(name, full)]
            if keep:
                for n, f in named:
                    out.extend((hf, t.detach().cpu()) for hf, t in hf_mapping.mcore_full_to_hf(n, f, hf_config))
    return out


def gather_hf_state(chunks, hf_config) -> list[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of this pipeline stage on every TP rank (the HF-rollout reference path)."""
    return _stage_hf_tensors(chunks if isinstance(chunks, list | tuple) else [chunks], hf_config, keep=True)


def _is_stage_leader() -> bool:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)


def _collect_on_rank0(local: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]] | None:
    """Stage leaders send their tensors to global rank 0 (metadata as objects, data as tensor sends)."""
    from megatron.core import parallel_state

    rank = dist.get_rank()
    comm_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    info = [None] * dist.get_world_size()
    dist.all_gather_object(info, (_is_stage_leader(), parallel_state.get_pipeline_model_parallel_rank()))
    senders = [r for r, (leader, pp) in enumerate(info) if leader and pp > 0 and r != 0]
    if rank in senders:
        meta = [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in local]]
        dist.send_object_list(meta, dst=0)
        for _, t in local:
            dist.send(t.to(comm_device).contiguous(), dst=0)
        return None
    if rank != 0:
        return None
    gathered = list(local)
    for src in senders:
        meta = [None]
        dist.recv_object_list(meta, src=src)
        for name, shape, dtype in meta[0]:
            buf = torch.empty(shape, dtype=getattr(torch, dtype), device=comm_device)
            dist.recv(buf, src=src)
            gathered.append((name, buf.cpu()))
    return gathered


def _write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous().clone()  # clone: safetensors refuses tensors that share storage
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True))
    return names


def _write_config(hf_config, out_dir: Path) -> None:
    if hasattr(hf_config, "save_pretrained"):
        hf_config.save_pretrained(str(out_dir))
    else:
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))


def export_mcore_to_hf(model_chunks, hf_config, out_dir, tokenizer_dir=None,
                       max_shard_bytes: int = 2 * 1024**3) -> list[str] | None:
    """Write the (TP/PP-distributed) model as an HF directory on global rank 0. Collective: call on all ranks.

    Returns the written safetensors file names on rank 0, None elsewhere.
    """
    chunks = model_chunks if isinstance(model_chunks, list | tuple) else [model_chunks]
    local = _stage_hf_tensors(chunks, hf_config, keep=_is_stage_leader())
    gathered = _collect_on_rank0(local)
    written = None
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = dict(gathered)
        if len(tensors) != len(gathered):
            raise AssertionError("export: the same HF tensor came from two stages")
        written = _write_safetensors(tensors, out, max_shard_bytes)
        _write_config(hf_config, out)
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / fname
                if src.is_file():
                    shutil.copyfile(src, out / fname)
    dist.barrier()
    return written
