"""megatron-core without CUDA: the one module that holds the CPU fixes.

megatron-core assumes a GPU in a handful of places even when every tensor is
on the CPU and the process groups use gloo. Each patch below names the exact
failure it fixes (measured on megatron-core 0.16.1, torch 2.13 CPU). The rest
of the code base never mentions CUDA absence: it calls `apply_cpu_compat()`
once, before building models, and writes device-agnostic code.

How the patches stay narrow:
- Device requests. Instead of replacing `torch.cuda.current_device` for the
  whole process (which vLLM and others would then see), each affected megatron
  module gets its own view of `torch` (`_CpuTorchView`) in which
  `torch.cuda.current_device()` names the CPU, `device="cuda"` in tensor
  factories means the CPU and the CUDA RNG calls use the CPU generator. Every
  other attribute is the real torch, so `isinstance(x, torch.Tensor)` etc.
  behave as with torch itself.
- Tensor methods. The optimizer compares `tensor.type()` with
  'torch.cuda.FloatTensor', and the tied-embedding set-up calls
  `tensor.cuda()`. Only for the duration of those specific functions does
  `Tensor.type()` report CPU tensors with the CUDA name / `Tensor.cuda()`
  leave the tensor on the CPU.
- Coalesced collectives. gloo runs a coalesced all-gather of buffers with
  different dtypes wrongly; megatron coalesces the distributed optimizer's
  param all-gather over its bf16 and fp32 (norm) buffers, so bf16 training
  scrambled every parameter on its first step. The buffer module's
  synchronous collectives run one by one instead.
- MoE without Transformer Engine. Not about CUDA either: moe_utils imports
  its TE kernels in a try block but then tests `te_general_gemm is not None`
  in the router's GEMM, a name the failed import never bound (NameError on the
  first MoE forward, wherever TE is missing). The missing names are bound to
  None, which is what that test expects.
- The sequence-parallel norm. This one is not about CUDA: the local layer
  spec falls back to `WrappedTorchNorm` whenever apex is missing (the GPU box
  has no apex either), and that wrapper refuses sequence parallel although a
  per-token norm is correct under it. We build the same torch norm and tag its
  parameters `sequence_parallel=True` so that megatron all-reduces their
  gradients over the TP group. It is applied whenever that wrapper exists.

Version guard: tested on megatron-core 0.16.x. On other versions each patch is
applied only when its target exists, and a single warning says so.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import types
import warnings

import torch

TESTED_MCORE_PREFIXES = ("0.16.",)

_state = {"cuda_fixes": False, "norm_fix": False, "warned": False}
applied_patches: list[str] = []  # names of the patches actually installed, for logs and tests


def apply_cpu_compat() -> list[str]:
    """Install the fixes once per process. Returns the names of the patches installed so far.

    Does nothing CUDA-related when CUDA is available; the sequence-parallel norm
    fix is applied in both cases (see module docstring).
    """
    mcore = _import_or_none("megatron.core")
    if mcore is None:
        return applied_patches
    version = getattr(mcore, "__version__", "unknown")
    if not version.startswith(TESTED_MCORE_PREFIXES) and not _state["warned"]:
        _state["warned"] = True
        warnings.warn(
            f"megatron_workers.cpu_compat was tested on megatron-core {TESTED_MCORE_PREFIXES}, found {version}; "
            "patches are applied only where their targets exist",
            stacklevel=2,
        )
    if not _state["norm_fix"]:
        _state["norm_fix"] = True
        _patch_sequence_parallel_torch_norm()
        _patch_moe_names_without_te()
    if not _state["cuda_fixes"] and not torch.cuda.is_available():
        _state["cuda_fixes"] = True
        _patch_cuda_device_requests()
        _patch_rng_helpers()
        _patch_scoped_tensor_methods()
        _patch_gloo_mixed_dtype_coalescing()
        _patch_moe_split_sizes_to_host()
    return applied_patches


def _import_or_none(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a missing or broken optional module just means "no patch"
        return None


_MOE_TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute")


def _patch_moe_names_without_te() -> None:
    """moe_utils.py: `if te_general_gemm is not None` in RouterGatingLinearFunction.forward
    -> NameError: name 'te_general_gemm' is not defined (megatron-core 0.16.1 without transformer_engine)."""
    module = _import_or_none("megatron.core.transformer.moe.moe_utils")
    if module is None or getattr(module, "HAVE_TE", True):
        return
    missing = [n for n in _MOE_TE_NAMES if not hasattr(module, n)]
    for name in missing:
        setattr(module, name, None)
    if missing:
        applied_patches.append("moe-without-te:megatron.core.transformer.moe.moe_utils")


def _patch_moe_split_sizes_to_host() -> None:
    """token_dispatcher.py: the alltoall dispatcher turns its split sizes into host numpy arrays with
    maybe_move_tensor_to_cpu(..., as_numpy=True), which converts only CUDA tensors; on the CPU they stay tensors
    and all_to_all_single refuses them (TypeError: all_to_all_single(): incompatible function arguments) at
    expert_model_parallel_size > 1. Here a CPU tensor is converted as a CUDA one would be."""
    module = _import_or_none("megatron.core.transformer.moe.token_dispatcher")
    original = getattr(module, "maybe_move_tensor_to_cpu", None)
    if original is None or getattr(original, "_hybridflow_cpu", False):
        return

    @functools.wraps(original)
    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._hybridflow_cpu = True
    module.maybe_move_tensor_to_cpu = to_host
    applied_patches.append("moe-split-sizes:megatron.core.transformer.moe.token_dispatcher")


# ---------------------------------------------------------------------------
# 1. A per-module view of torch in which "the current CUDA device" is the CPU.
# ---------------------------------------------------------------------------


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # megatron passes torch.cuda.current_device() (an int) around
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


class _CpuCudaView(types.ModuleType):
    """`torch.cuda` as seen by a patched megatron module on a CUDA-less machine."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.current_device = lambda: "cpu"
        self.synchronize = lambda *a, **k: None
        self.is_available = lambda: False
        # The CUDA RNG calls in tensor_parallel/random.py: the CPU generator is the one CPU ops draw from.
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.manual_seed = lambda seed: torch.manual_seed(seed)
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state)
        # MoE's alltoall dispatcher copies its split sizes to the host on a side stream and waits on an event;
        # on the CPU there is one stream and nothing to wait for.
        self.Stream = _CpuStream
        self.current_stream = _CpuStream.current
        self.stream = lambda s=None: contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuStream:
    """A CUDA stream on a machine with none: every wait and event is already complete."""

    _current: _CpuStream | None = None

    @classmethod
    def current(cls, device=None) -> _CpuStream:
        if cls._current is None:
            cls._current = cls()
        return cls._current

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None):
        return types.SimpleNamespace(synchronize=lambda: None, wait=lambda *a: None)

    def synchronize(self) -> None:
        pass


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn")


class _CpuTorchView(types.ModuleType):
    """`torch` as seen by a patched megatron module: CUDA device requests go to the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCudaView()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_VIEW: _CpuTorchView | None = None

# module -> the failure it shows without the patch
_CUDA_DEVICE_MODULES = {
    # rotary_pos_embedding.py: self.inv_freq.to(device=torch.cuda.current_device())
    #   -> AssertionError: Torch not compiled with CUDA enabled
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE inv_freq on current_device",
    # p2p_communication.py: recv buffers / shape tensors allocated on torch.cuda.current_device()
    "megatron.core.pipeline_parallel.p2p_communication": "PP send/recv buffers on current_device",
    # schedules.py: total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda"), in every schedule
    "megatron.core.pipeline_parallel.schedules": "schedules total_num_tokens on cuda",
    # param_and_grad_buffer.py: DDP param/grad buffers allocated on torch.cuda.current_device()
    "megatron.core.distributed.param_and_grad_buffer": "DDP buffers on current_device",
    "megatron.core.distributed.distributed_data_parallel": "DDP current_device",
    # optimizer.py / distrib_optimizer.py / clip_grads.py: found_inf, norms and scratch buffers on cuda
    "megatron.core.optimizer.optimizer": "optimizer scratch tensors on cuda",
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer buffers on current_device",
    "megatron.core.optimizer.clip_grads": "grad-norm tensors on cuda",
    # finalize_model_grads.py: num_tokens / norm all-reduce tensors on current_device
    "megatron.core.distributed.finalize_model_grads": "finalize_model_grads tensors on cuda",
    # mappings.py: SP all-gather / reduce-scatter outputs on torch.cuda.current_device()
    "megatron.core.tensor_parallel.mappings": "SP collectives' outputs on current_device",
    # layers.py: SP backward buffer (sub_grad_input) and non-CPU-init weights on current_device
    "megatron.core.tensor_parallel.layers": "linear layers' SP backward buffers on current_device",
    # tensor_parallel/utils.py: split/gather scratch tensors on current_device
    "megatron.core.tensor_parallel.utils": "TP split/gather scratch on current_device",
    # core/utils.py: GlobalMemoryBuffer.get_tensor (SP with use_global_buffer) on current_device
    "megatron.core.utils": "global memory buffer on current_device",
    # transformer/utils.py: get_default_causal_mask -> torch.ones(sq, sq, device="cuda") when no mask is passed
    "megatron.core.transformer.utils": "default causal mask on cuda",
    # dist_checkpointing (measured by the checkpoint helper, megatron_workers/dist_ckpt.py):
    # filesystem_async.py preload_tensors: torch.cuda.synchronize() -> "Torch not compiled with CUDA enabled"
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "checkpoint writer synchronizes CUDA",
    # state_dict_saver.py: torch.tensor([...], device='cuda') for the cross-rank verify / failure flags
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "checkpoint verify flags on cuda",
    # async_utils.py: torch.cuda.synchronize() and is-alive flags on torch.cuda.current_device()
    "megatron.core.dist_checkpointing.strategies.async_utils": "checkpoint async flags on current_device",
    # tensor_parallel/random.py: CUDA RNG get/set inside the RNG tracker (see _patch_rng_helpers)
    "megatron.core.tensor_parallel.random": "RNG tracker uses the CUDA generator",
    # MoE (measured with the tiny qwen3_moe/qwen2_moe/mixtral models):
    # token_dispatcher.py: MoEAlltoAllTokenDispatcher.__init__ -> torch.cuda.Stream()
    #   -> RuntimeError: torch.cuda.Stream requires CUDA support
    "megatron.core.transformer.moe.token_dispatcher": "alltoall dispatcher's D2H side stream",
    # router.py: router weight / aux-loss tensors on torch.cuda.current_device()
    "megatron.core.transformer.moe.router": "router tensors on current_device",
    # experts.py: expert weights on current_device when not initialised on the CPU
    "megatron.core.transformer.moe.experts": "expert weights on current_device",
    # moe_utils.py: the aux-loss tracker's values on cuda; record_stream on the current stream
    "megatron.core.transformer.moe.moe_utils": "aux-loss tracker on cuda",
    # shared_experts.py: the overlap stream (only with moe_shared_expert_overlap)
    "megatron.core.transformer.moe.shared_experts": "shared-expert overlap stream",
}


def _patch_cuda_device_requests() -> None:
    global _TORCH_VIEW
    if _TORCH_VIEW is None:
        _TORCH_VIEW = _CpuTorchView()
    for name in _CUDA_DEVICE_MODULES:
        module = _import_or_none(name)
        if module is None or getattr(module, "torch", None) is not torch:
            continue  # not in this megatron version, or already patched
        module.torch = _TORCH_VIEW
        applied_patches.append(f"cpu-device:{name}")


# ---------------------------------------------------------------------------
# 2. RNG: megatron's tracker saves/restores the CUDA generator.
# ---------------------------------------------------------------------------


def _patch_rng_helpers() -> None:
    """`_get_cuda_rng_state` / `_set_cuda_rng_state` index torch.cuda.default_generators -> IndexError/assert
    without CUDA. Point them at the CPU generator, which is what dropout on CPU actually draws from, so the
    tracker's fork() gives per-TP-rank dropout streams exactly as on GPU."""
    random = _import_or_none("megatron.core.tensor_parallel.random")
    if random is None:
        return
    if hasattr(random, "_get_cuda_rng_state"):

        def _get_state(device=None, clone=False, graph_safe=False):
            state = torch.get_rng_state()
            return state.clone() if clone else state

        random._get_cuda_rng_state = _get_state
        applied_patches.append("rng:_get_cuda_rng_state")
    if hasattr(random, "_set_cuda_rng_state"):
        random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
        applied_patches.append("rng:_set_cuda_rng_state")


# ---------------------------------------------------------------------------
# 3. Tensor methods that only make sense on CUDA, patched only while specific megatron functions run:
#    - `tensor.type()` compared with 'torch.cuda.FloatTensor' and friends in the optimizer;
#    - `tensor.cuda()` in the tied-embedding set-up.
# ---------------------------------------------------------------------------

_REAL_TENSOR_TYPE = torch.Tensor.type


def _type_with_cuda_names(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _REAL_TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_strings():
    previous = torch.Tensor.type
    torch.Tensor.type = _type_with_cuda_names
    try:
        yield
    finally:
        torch.Tensor.type = previous


@contextlib.contextmanager
def _tensor_cuda_stays_on_cpu():
    previous = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = previous


def _scoped(fn, context):
    """fn, run with `context()` active for the duration of each call only."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    wrapper._hybridflow_cpu_compat = True
    return wrapper


def _patch_scoped_tensor_methods() -> None:
    # (module, holder attribute or None for module-level, function name, context)
    targets = [
        # clip_grads.py: assert param.grad.type() == 'torch.cuda.FloatTensor' (AssertionError on clip)
        ("megatron.core.optimizer.clip_grads", None, "clip_grad_by_total_norm_fp32", _cuda_type_strings),
        # optimizer.py imports it by name, so the call site's binding is the one that matters
        ("megatron.core.optimizer.optimizer", None, "clip_grad_by_total_norm_fp32", _cuda_type_strings),
        # optimizer.py Float16OptimizerWithFloat16Params: TypeError 'Wrapped parameters must be one of
        #   torch.cuda.FloatTensor ...' for fp32 params next to bf16 ones
        ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__", _cuda_type_strings),
        # distrib_optimizer.py: the same TypeError while building the sharded main params
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "_build_model_and_main_param_groups",
         _cuda_type_strings),
        # language_module.py setup_embeddings_and_output_layer: `weight.data = weight.data.cuda()` before the
        #   all-reduce that copies tied embeddings to the last PP stage -> AssertionError (tied + PP > 1)
        ("megatron.core.models.common.language_module.language_module", "LanguageModule",
         "setup_embeddings_and_output_layer", _tensor_cuda_stays_on_cpu),
    ]
    for module_name, holder_name, fn_name, context in targets:
        module = _import_or_none(module_name)
        holder = module if holder_name is None or module is None else getattr(module, holder_name, None)
        if holder is None:
            continue
        raw = holder.__dict__.get(fn_name) if isinstance(holder, type) else getattr(holder, fn_name, None)
        if raw is None:
            continue
        # keep the descriptor kind (staticmethod/classmethod/plain function) of the original
        kind = type(raw) if isinstance(raw, staticmethod | classmethod) else None
        fn = raw.__func__ if kind else raw
        if getattr(fn, "_hybridflow_cpu_compat", False):
            continue
        wrapped = _scoped(fn, context)
        setattr(holder, fn_name, kind(wrapped) if kind else wrapped)
        applied_patches.append(f"{context.__name__.strip('_')}:{module_name}.{holder_name or ''}.{fn_name}")


# ---------------------------------------------------------------------------
# 4. gloo's coalesced all-gather over tensors of different dtypes.
# ---------------------------------------------------------------------------


class _NoWork:
    """The handle of collectives that already ran synchronously."""

    def wait(self):
        return None


def _patch_gloo_mixed_dtype_coalescing() -> None:
    """param_and_grad_buffer.py start_param_sync: `with _coalescing_manager(group): all_gather_into_tensor(...)` per
    bucket. gloo's coalesced all-gather of tensors of mixed dtypes returns interleaved garbage (torch 2.13,
    measured at 1 and 2 ranks: [0, 1, 2, 3] came back as [0, 0, 0, 1]); same-dtype coalescing is exact. A model
    with parameters of two dtypes has a buffer of each (ours had, bf16 linears and fp32 torch norms, before
    model_builder cast the norms), and every parameter was overwritten after the first optimizer step.
    Synchronous calls (no overlap, which stays off on CPU: optimizer.wrap_ddp) therefore run one by one; async
    ones keep torch's manager. tests/test_mcore_cpu_compat.py checks it on a real 2-rank gloo group."""
    module = _import_or_none("megatron.core.distributed.param_and_grad_buffer")
    real = getattr(module, "_coalescing_manager", None)
    if real is None or getattr(real, "_hybridflow_cpu_compat", False):
        return

    @contextlib.contextmanager
    def one_by_one(group=None, device=None, async_ops=False):
        if async_ops:
            with real(group, device=device, async_ops=True) as cm:
                yield cm
        else:
            yield _NoWork()

    one_by_one._hybridflow_cpu_compat = True
    module._coalescing_manager = one_by_one
    applied_patches.append("gloo-coalescing:param_and_grad_buffer._coalescing_manager")


# ---------------------------------------------------------------------------
# 5. Sequence parallel with the local spec's torch norm.
# ---------------------------------------------------------------------------


def _patch_sequence_parallel_torch_norm() -> None:
    """torch_norm.py WrappedTorchNorm: `assert not config.sequence_parallel` -> AssertionError
    'sequence parallel not supported by torch LayerNorm' as soon as SP is on with the local spec.
    RMSNorm/LayerNorm act per token, so they are correct on a sequence shard; megatron only needs
    the weights tagged `sequence_parallel` to all-reduce their gradients over TP."""
    torch_norm = _import_or_none("megatron.core.transformer.torch_norm")
    cls = getattr(torch_norm, "WrappedTorchNorm", None)
    if cls is None or getattr(cls.__new__, "_hybridflow_cpu_compat", False):
        return
    original_new = cls.__new__

    def sp_capable_new(klass, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(klass, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(klass, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    sp_capable_new._hybridflow_cpu_compat = True
    cls.__new__ = staticmethod(sp_capable_new)
    applied_patches.append("sp-norm:WrappedTorchNorm")
