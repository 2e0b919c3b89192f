"""Save and load model + optimizer + trainer state with megatron's dist_checkpointing.

Tensors are stored by their global shape and offset (ShardedTensor), so a
checkpoint saved at one TP/PP/DP layout loads at another. The distributed
optimizer's state uses megatron's `fully_sharded_model_space` format, which is
resharding-safe as well.

Non-tensor state (the LR scheduler's step, the caller's `extra` dict such as
the trainer step and dataloader state, and the RNG states) goes into the
checkpoint's common part, written by rank 0. RNG states are rank 0's: all our
randomness is seeded from the config, and per-rank streams could not be mapped
onto a different layout anyway.

Atomicity (write to a temp dir, rename, keep the last N) is the trainer's job.
dist_checkpointing's writer starts a multiprocessing Manager, so a script that
calls `save_checkpoint` needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

LAYOUT_FILE = "hybridflow_layout.json"
# 'fully_reshardable': the distributed optimizer's flat buffers are stored per parameter, in model
# space, so TP/PP/DP may all change between save and load. (megatron 0.16's torch_dist writer
# rejects the older 'fully_sharded_model_space' format: "flattened_range is not supported".)
# On CPU the gather must go through gloo (the default path calls .cuda()): the "mem_efficient" variant.
OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available(),
}


def _torch_adam_step_compat() -> None:
    """Let the distributed optimizer load a `fully_reshardable` checkpoint into torch's Adam.

    Without apex/TE (our CPU machines and the GPU box) the inner optimizer is torch.optim.Adam,
    whose per-param state holds a 'step' tensor next to exp_avg/exp_avg_sq. megatron-core 0.16's
    `_set_main_param_and_optimizer_states` copies every key of that state from the loaded
    per-param tensors, which carry only param/exp_avg/exp_avg_sq -> KeyError: 'step'. The step is
    restored separately (from the param groups), so the copy for 'step' is made a no-op.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__.get("_set_main_param_and_optimizer_states")
    if original is None or getattr(original, "_hybridflow_step_compat", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    set_states._hybridflow_step_compat = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _model_sharded_state_dict(model: list) -> dict:
    """The model's ShardedTensors. One chunk: its dict; VPP: {"model<i>": chunk i's dict} (as Megatron-LM).

    The dict keys are the chunks' local module names (they clash between chunks), but what is stored and
    matched on load is each ShardedTensor's own key, which megatron makes global (the chunk's layer offset,
    vp_stage included). So a checkpoint saved at one VPP size (or none) loads at another.
    """
    if len(model) == 1:
        return _unwrap(model[0]).sharded_state_dict()
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "world_size": dist.get_world_size(),
    }


def save_checkpoint(path: str | os.PathLike, model: list, optimizer=None, scheduler=None,
                    extra: dict | None = None) -> None:
    """Collective: every rank of the role calls it with the same path."""
    from megatron.core import dist_checkpointing

    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # dist_checkpointing's CUDA calls are in cpu_compat's list; no-op with CUDA
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_sd = _model_sharded_state_dict(model)
    state = {"model": model_sd, "common": {"extra": extra or {}, "rng": rng_state()}}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=OPTIMIZER_METADATA)
    if scheduler is not None:
        state["common"]["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, str(path))
    if dist.get_rank() == 0:
        (path / LAYOUT_FILE).write_text(json.dumps(_layout()) + "\n")
    dist.barrier()


def load_checkpoint(path: str | os.PathLike, model: list, optimizer=None, scheduler=None,
                    restore_rng: bool = True) -> dict:
    """Collective. Loads into the (already built, DDP-wrapped) model and optimizer; returns `extra`.

    Pass optimizer=None to load weights only (e.g. a reference model from an actor checkpoint).
    """
    from megatron.core import dist_checkpointing

    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # dist_checkpointing's CUDA calls are in cpu_compat's list; no-op with CUDA
    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a dist_checkpointing checkpoint (no metadata.json)")
    refuse_unsafe_pickles(path)
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    if optimizer is not None and not _has_optimizer_state(path):
        raise ValueError(f"checkpoint {path} has no optimizer state; load with optimizer=None")
    if optimizer is not None:
        _check_optimizer_split(path, optimizer)
    model_sd = _model_sharded_state_dict(model)
    state = {"model": model_sd}
    if optimizer is not None:
        _torch_adam_step_compat()
        _ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(state, str(path))
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(loaded["model"][f"model{i}"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if scheduler is not None and "scheduler" in common:
        scheduler.load_state_dict(common["scheduler"])
    if restore_rng:
        set_rng_state(common["rng"])
    saved = saved_layout(path)
    logger.info("loaded checkpoint %s (saved at %s, now %s)", path, saved, _layout())
    return common["extra"]


def load_weights(path: str | os.PathLike, model: list) -> None:
    """Collective. The model's weights only from a dist checkpoint (verl's use_dist_checkpointing: a role starts from
    dist_checkpointing_path instead of the HF safetensors), at this rank's layout, whatever layout wrote it.

    A checkpoint of a model with tied embeddings (hf-to-mcore of e.g. a tied Qwen2) has no output layer; a model
    built untied from it (the critic's body, whose output layer the value head replaces) takes the embedding for
    its output layer, as the HF loader does."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_workers.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a dist_checkpointing checkpoint (no metadata.json)")
    refuse_unsafe_pickles(path)
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = _model_sharded_state_dict(model)
    for chunk_state in [state] if len(model) == 1 else state.values():
        out = chunk_state.get("output_layer.weight")
        if out is not None and out.key not in saved and "embedding.word_embeddings.weight" in saved:
            out.key = "embedding.word_embeddings.weight"  # same global shape and vocab split
            # a second reader of the embedding: not its main replica (each element has one), as megatron marks
            # a tied output layer
            replica = out.replica_id if isinstance(out.replica_id, tuple) else (out.replica_id,)
            out.replica_id = (1, *replica[1:])
    loaded = dist_checkpointing.load({"model": state}, str(path))["model"]
    for i, chunk in enumerate(model):
        _unwrap(chunk).load_state_dict(loaded if len(model) == 1 else loaded[f"model{i}"])
    logger.info("loaded weights from %s (saved at %s, now %s)", path, saved_layout(path), _layout())


def refuse_unsafe_pickles(path: str | os.PathLike) -> None:
    """Load every pickle-based file of the checkpoint weights-only first, whatever torch's default or
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD say: a planted payload fails here (UnpicklingError), before megatron's
    own torch.load calls (which leave weights_only to the default) see it. Tensor data (.distcp) is read by
    torch.distributed.checkpoint, weights-only too. The allowlist is megatron's (numpy RNG state and the like).
    """
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    for file in sorted(Path(path).glob("*.pt")):
        try:
            torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"{file}: refused, not a weights-only file (it would run code when "
                                         f"unpickled): {str(e).splitlines()[0][:200]}") from None


def _ensure_optimizer_state(optimizer) -> None:
    """Give a fresh (never stepped) torch Adam the state tensors a checkpoint load fills in place.

    Without apex/TE, megatron's DistributedOptimizer.state_dict() reads each param's Adam 'step'
    and asserts there is exactly one value, so loading into an optimizer that has not stepped
    fails. The zeros here are overwritten by the load.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _unshare_adam_steps(optimizer) -> None:
    """Give every param its own Adam 'step' tensor after a load.

    megatron-core 0.16's DistributedOptimizer.load_state_dict (torch-Adam path) puts one and the
    same step tensor into every param's state. torch's Adam increments each param's step in
    place, so the shared tensor advanced once per parameter per update and the bias correction
    went wrong: the first update after a resume differed by ~lr. Measured, then fixed here.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def saved_layout(path: str | os.PathLike) -> dict | None:
    file = Path(path) / LAYOUT_FILE
    return json.loads(file.read_text()) if file.exists() else None


def _check_optimizer_split(path: Path, optimizer) -> None:
    """An MoE model's optimizer state is split in two (megatron's ChainedOptimizer: the experts' Adam over the
    expert-DP group apart from the rest) at expert_model_parallel_size > 1, and in one at 1; megatron cannot load
    one form into the other (measured: KeyError 'optimizer.state.param...' resuming an EP2 save at EP1)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = len({k.split(".", 1)[0] for k in keys if k.startswith("chained_")}) or 1
    now = len(getattr(optimizer, "chained_optimizers", [optimizer]))
    if saved != now:
        layout = saved_layout(path) or {}
        raise ValueError(f"checkpoint {path} holds its optimizer state in {saved} part(s) (saved at "
                         f"expert_model_parallel_size={layout.get('ep', '?')}), this optimizer has {now}: resume the "
                         "optimizer at the saved expert parallel size, or load the weights only (an HF export of "
                         "the checkpoint as the model path)")


def _has_optimizer_state(path: Path) -> bool:
    """Whether the sharded part holds optimizer tensors, read from the torch_dist metadata (no tensors loaded).
    An MoE model's optimizer is megatron's ChainedOptimizer (the experts' parameters in one of their own), whose
    keys are `chained_<i>.optimizer.*`."""
    import re

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    return any(re.match(r"(chained_\d+\.)?optimizer\.", key) for key in metadata.state_dict_metadata)
