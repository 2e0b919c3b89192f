"""Move a role's parameters, gradient buffers and optimizer state to host memory and back.

For colocated placements on GPUs: while the rollout engine generates, the actor's
training state (and the reference / critic models) need not occupy device memory.

How each piece moves:
- DDP buffers (megatron's flat param/grad buffers): the storage is resized to 0 and
  re-allocated on reload (`storage().resize_`), so every view into it -- param.data,
  param.main_grad, the distributed optimizer's fp32 shards -- stays the same tensor
  object and is valid again after reload. Parameters are copied to a host buffer
  first; gradients are simply dropped (they are zeroed at the start of each step).
- Parameters outside a buffer (a forward-only model without DDP, or fp32 params
  without the distributed optimizer): `param.data` moves.
- Optimizer: the Adam moments, and main params that own their storage (the fp32
  copies of bf16 params). Main params that are views into a DDP buffer move with it.

Without CUDA the model already lives in host memory: offload is a logged no-op.
`force=True` runs the same buffer mechanics on CPU (used by the test).
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)


def _buffers(chunk) -> list:
    """megatron DDP's flat buffers (a plain nn.Module's `buffers` is the method, not a list)."""
    out = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, list):
            out.extend(value)
    return out


def _params_in_buffers(chunk) -> set[int]:
    """Parameters whose data is a view into a DDP param buffer (distributed optimizer / mixed precision)."""
    return {id(p) for buf in _buffers(chunk) if buf.param_data is not None for p in buf.params}


def _inner_optimizers(optimizer) -> list:
    if optimizer is None:
        return []
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in opts if getattr(o, "optimizer", None) is not None]


class Offloader:
    """Offload / reload one engine's model chunks and optimizer, as chosen by the three flags."""

    def __init__(self, engine, params: bool, grads: bool, optimizer: bool, force: bool = False):
        self.engine = engine
        self.flags = {"params": params, "grads": grads, "optimizer": optimizer}
        self.enabled = any(self.flags.values()) and (torch.cuda.is_available() or force)
        self.device = next(engine.model[0].parameters()).device
        self.host = torch.device("cpu")
        self.offloaded = False
        self._param_host: dict[int, torch.Tensor] = {}
        self._sizes: dict[tuple[int, str], int] = {}
        if any(self.flags.values()) and not self.enabled:
            logger.info("offload %s requested, but the model is already in host memory (no CUDA): nothing to move",
                        [k for k, v in self.flags.items() if v])

    # ---------------------------------------------------------------- public

    def offload(self) -> None:
        if not self.enabled or self.offloaded:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for chunk in self.engine.model:
            self._offload_chunk(chunk)
        if self.flags["optimizer"]:
            self._move_optimizer(self.host)
        self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if not self.enabled or not self.offloaded:
            return
        for chunk in self.engine.model:
            self._reload_chunk(chunk)
        if self.flags["optimizer"]:
            self._move_optimizer(self.device)
        self.offloaded = False

    @contextlib.contextmanager
    def resident(self):
        """On the device inside the block, offloaded again after it (if offloading is on)."""
        self.reload()
        try:
            yield
        finally:
            self.offload()

    # ---------------------------------------------------------------- pieces

    def _offload_chunk(self, chunk) -> None:
        for buf in _buffers(chunk):
            key = id(buf)
            if self.flags["params"] and buf.param_data is not None:
                storage = buf.param_data.untyped_storage()
                if storage.size() > 0:
                    self._param_host[key] = buf.param_data.to(self.host, copy=True)
                    self._sizes[(key, "param")] = storage.size()
                    storage.resize_(0)
            if self.flags["grads"] and buf.grad_data is not None:
                storage = buf.grad_data.untyped_storage()
                if storage.size() > 0:
                    self._sizes[(key, "grad")] = storage.size()
                    storage.resize_(0)
        if self.flags["params"]:
            in_buffer = _params_in_buffers(chunk)
            for p in chunk.parameters():
                if id(p) not in in_buffer:
                    p.data = p.data.to(self.host)

    def _reload_chunk(self, chunk) -> None:
        for buf in _buffers(chunk):
            key = id(buf)
            if (key, "param") in self._sizes:
                buf.param_data.untyped_storage().resize_(self._sizes.pop((key, "param")))
                buf.param_data.copy_(self._param_host.pop(key))
            if (key, "grad") in self._sizes:
                buf.grad_data.untyped_storage().resize_(self._sizes.pop((key, "grad")))
                buf.grad_data.zero_()
        if self.flags["params"]:
            in_buffer = _params_in_buffers(chunk)
            for p in chunk.parameters():
                if id(p) not in in_buffer:
                    p.data = p.data.to(self.device)

    def _move_optimizer(self, device: torch.device) -> None:
        # Without the distributed optimizer in fp32, the optimizer's params are the model's own:
        # those move (or not) with the `params` flag.
        model_params = {id(p) for chunk in self.engine.model for p in chunk.parameters()}
        for inner in _inner_optimizers(self.engine.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    if p._base is None and id(p) not in model_params:  # own storage: fp32 main copies
                        p.data = p.data.to(device)
            for state in inner.state.values():
                for k, v in state.items():
                    # torch Adam keeps 'step' on the CPU unless capturable; leave scalars where they are.
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state[k] = v.to(device)


def make_offloader(engine, megatron_cfg, force: bool = False) -> Offloader:
    """From MegatronConfig's param_offload / grad_offload / optimizer_offload."""
    return Offloader(engine, params=megatron_cfg.param_offload, grads=megatron_cfg.grad_offload,
                     optimizer=megatron_cfg.optimizer_offload, force=force)
