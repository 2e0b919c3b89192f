"""Megatron's own config fields in ours: verl's `*.megatron.override_transformer_config.<field>` and
`*.optim.override_optimizer_config.<field>` take any field of megatron-core's TransformerConfig / OptimizerConfig,
checked by name against those dataclasses (a typo fails at load with the nearest field), and go to Megatron as
they are, with three exceptions:

  - OWNED: a field another key of ours sets (the parallel layout, the dtype, the model's shape from its
    config.json, the optimizer's lr / betas / decay): refused at load with that key, so one value has one key;
  - NOT_YET: a field whose layout the rest of this stack does not follow (uneven pipeline stages, multi-token
    prediction): refused at load unless it holds Megatron's default;
  - CUDA_ONLY: a field whose value needs CUDA kernels (the fusions, DeepEP and its flex dispatcher, the optimizer's
    CPU offload, ...): kept in the config, used where the model is built on a GPU, and left at the portable
    value on a machine without CUDA (one line logged before Ray starts). Selected by detection at build time.

Where the model builder sets a field itself (megatron_workers/model_builder.py), the precedence is: OWNED
fields are the builder's (from the keys named in OWNED); CUDA_ONLY fields are the override's on GPU and the
builder's portable value on CPU; every other field is the override's.

The field names are read from megatron-core's source (its dataclass definitions, with `ast`), since importing
megatron.core takes ~10 s and the loader runs on every config load.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import logging
from pathlib import Path

log = logging.getLogger("hybridflow")

TRANSFORMER, OPTIMIZER = "TransformerConfig", "OptimizerConfig"
# Where each dataclass is defined, under megatron/core/.
_SOURCES = {TRANSFORMER: "transformer/transformer_config.py", OPTIMIZER: "optimizer/optimizer_config.py"}
# The config section that holds each, as verl spells it.
SECTIONS = {TRANSFORMER: "override_transformer_config", OPTIMIZER: "override_optimizer_config"}
NOT_YET = "not supported yet"

_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
           "context_parallel_size", "sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size")
_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
          "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
          "add_qkv_bias", "qk_layernorm", "init_method_std", "num_moe_experts", "moe_router_topk",
          "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
          "moe_shared_expert_gate", "multi_latent_attention")
_DTYPE = ("params_dtype", "pipeline_dtype", "bf16", "fp16", "autocast_dtype")
_MODEL_JSON = ("set from the model's config.json, so the Megatron model matches the checkpoint's weights",
               "drop it (edit the model's config.json to train another shape)")

# field -> (why, what to write instead), for fields another key of ours owns.
OWNED: dict[str, dict[str, tuple[str, str]]] = {
    TRANSFORMER: {
        **{f: ("the parallel layout has its own keys", f"<role>.megatron.{f}") for f in _LAYOUT},
        **{f: ("the precision has its own key", "<model>.model.dtype (auto, bfloat16, float32)") for f in _DTYPE},
        **{f: _MODEL_JSON for f in _SHAPE},
        "moe_router_load_balancing_type": (
            "follows the aux-loss coefficient (aux_loss when it is > 0, none otherwise)",
            "<role>.megatron.override_transformer_config.moe_aux_loss_coeff"),
        "moe_enable_routing_replay": ("always on here: it only gives each router a replay slot (routing replay)",
                                      "actor_rollout_ref.actor.router_replay.mode=R3 to replay the rollout's routing"),
    },
    OPTIMIZER: {
        "optimizer": ("this stack runs Adam(W)", "drop it"),
        "lr": ("the learning rate has its own key", "<role>.optim.lr"),
        "min_lr": ("the floor of the decay has its own key", "<role>.optim.min_lr_ratio (a fraction of optim.lr)"),
        "weight_decay": ("the weight decay has its own key", "<role>.optim.weight_decay"),
        "adam_beta1": ("Adam's betas have their own key", "<role>.optim.betas=[beta1,beta2]"),
        "adam_beta2": ("Adam's betas have their own key", "<role>.optim.betas=[beta1,beta2]"),
        "clip_grad": ("gradient clipping has its own key", "<role>.optim.clip_grad"),
        **{f: ("the precision has its own key", "<model>.model.dtype") for f in ("bf16", "fp16", "params_dtype")},
        "use_distributed_optimizer": ("it has its own key", "<role>.megatron.use_distributed_optimizer"),
    },
}

# field -> (Megatron's default, why not): refused unless the value is that default.
NOT_SUPPORTED: dict[str, dict[str, tuple[object, str]]] = {
    TRANSFORMER: {
        **{f: (None, "uneven pipeline stages are " + NOT_YET + " (ParallelDims, the weight mapping, the resharding "
                     "plan and the planner split the layers evenly: num_hidden_layers / pp per stage)")
           for f in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                     "pipeline_model_parallel_layout")},
        **{f: (False, "uneven pipeline stages are " + NOT_YET + " (the layers are split evenly over the stages)")
           for f in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")},
        "mtp_num_layers": (None, "multi-token prediction layers are " + NOT_YET),
        "recompute_modules": (["core_attn"], "selective recompute here is the core attention "
                                             "(recompute_granularity=selective); other modules are " + NOT_YET),
    },
    OPTIMIZER: {},
}


def _off(value) -> bool:
    return value in (False, None, 0, 0.0)


# field -> the test "this value needs CUDA". Left at the builder's portable value where CUDA is absent.
CUDA_ONLY: dict[str, dict[str, object]] = {
    TRANSFORMER: {
        **{f: (lambda v: not _off(v)) for f in (
            "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
            "gradient_accumulation_fusion", "persist_layer_norm", "cross_entropy_loss_fusion", "moe_permute_fusion",
            "moe_enable_deepep", "moe_shared_expert_overlap", "tp_comm_overlap", "fp8", "fp4", "enable_cuda_graph",
            "external_cuda_graph", "batch_p2p_comm")},
        "cuda_graph_impl": lambda v: v not in (None, "none"),
        "moe_token_dispatcher_type": lambda v: v == "flex",
        "moe_grouped_gemm": lambda v: v is True,  # Transformer Engine's grouped GEMM (its spec, on a GPU)
        "attention_backend": lambda v: v in ("flash", "fused"),  # Transformer Engine's attention kernels
        "use_cpu_initialization": lambda v: v is False,
    },
    OPTIMIZER: {f: (lambda v: not _off(v)) for f in (
        "optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
        "use_precision_aware_optimizer")},
}


def _source_root() -> Path:
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("megatron-core is not installed, so Megatron config fields cannot be checked")
    return Path(next(iter(spec.submodule_search_locations)))


def _class_fields(path: Path, name: str) -> list[str]:
    """The annotated class-level names of dataclass `name` in `path` and of its bases (followed through the
    module's `from megatron.core.x import` / `from ..x import` lines), bases first."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if name not in classes:
        raise ValueError(f"megatron-core's {path} defines no class {name}")
    node, names = classes[name], []
    for base in node.bases:
        base_name = ast.unparse(base)
        if base_name in classes:
            names += _class_fields(path, base_name)
            continue
        for imp in (n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module):
            if not any(a.name == base_name for a in imp.names):
                continue
            if imp.level:  # relative to this module's package
                names += _class_fields(path.parents[imp.level - 1] / f"{imp.module.replace('.', '/')}.py", base_name)
            elif imp.module.startswith("megatron.core."):
                rel = imp.module.removeprefix("megatron.core.").replace(".", "/")
                names += _class_fields(_source_root() / f"{rel}.py", base_name)
    return names + [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and "ClassVar" not in ast.unparse(s.annotation)]


@functools.cache
def field_names(which: str) -> frozenset[str]:
    """The fields of megatron-core's TransformerConfig or OptimizerConfig, as installed here."""
    return frozenset(_class_fields(_source_root() / _SOURCES[which], which))


def classify(which: str, path: str, value) -> str | None:
    """None if `path` (a key `...<section>.<field>[.<sub>]`) may hold `value`; otherwise the problem, naming the
    key: an unknown field (with the nearest one), or a refusal with what to write instead (verl_compat's form)."""
    name = path.split(f"{SECTIONS[which]}.", 1)[1].split(".", 1)[0]
    role = path.split(".megatron.", 1)[0].split(".optim.", 1)[0]  # e.g. actor_rollout_ref.actor, critic
    model = "actor_rollout_ref" if role.startswith("actor_rollout_ref") else role  # whose model.dtype
    fields = field_names(which)
    if name not in fields:
        near = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.6)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        return f"unknown Megatron {which} field '{name}' in '{path}'{hint}"
    if name in OWNED[which]:
        why, use = OWNED[which][name]
        use = use.replace("<role>", role).replace("<model>", model)
        return f"verl key '{path}={value}' is refused here: {why}; instead: {use}"
    if name in NOT_SUPPORTED[which]:
        default, why = NOT_SUPPORTED[which][name]
        if value != default:
            return f"verl key '{path}={value}' is refused here: {why}; instead: drop it"
    return None


def needs_cuda(which: str, name: str, value) -> bool:
    test = CUDA_ONLY[which].get(name)
    return bool(test and test(value))


def cuda_only_settings(sections: dict[str, tuple[str, dict]]) -> list[str]:
    """`key=value` of every CUDA-only setting in {section prefix: (TRANSFORMER | OPTIMIZER, {field: value})}."""
    out = []
    for prefix, (which, values) in sections.items():
        out += [f"{prefix}.{SECTIONS[which]}.{k}={v}" for k, v in values.items() if needs_cuda(which, k, v)]
    return out


def overrides_of(section) -> dict:
    """The pass-through fields of an override section (its `other`); the typed ones have code paths of their own."""
    return dict(getattr(section, "other", None) or {})


def log_cuda_only(cfg, on_cuda: bool) -> list[str]:
    """One log line naming every CUDA-only Megatron field the job sets, when this machine has no CUDA (they are
    used where the model is built on a GPU). Returns the settings named."""
    roles = {}
    for role, m, optim in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.megatron,
                            cfg.actor_rollout_ref.actor.optim),
                           ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron, None),
                           ("critic", cfg.critic.megatron, cfg.critic.optim),
                           ("reward_model", cfg.reward_model.megatron, None)):
        o = m.override_transformer_config
        typed = {k: getattr(o, k) for k in ("moe_token_dispatcher_type", "attention_backend", "moe_grouped_gemm")}
        roles[f"{role}.megatron"] = (TRANSFORMER, {**typed, **overrides_of(o)})
        if optim is not None:
            roles[f"{role}.optim"] = (OPTIMIZER, overrides_of(optim.override_optimizer_config))
    settings = cuda_only_settings(roles)
    if settings and not on_cuda:
        log.info("%s: need CUDA, so not used on this machine (the portable kernels run instead; used where the "
                 "model is built on a GPU)", ", ".join(settings))
    return settings


def transformer_fields(o, on_cuda: bool) -> dict:
    """The pass-through TransformerConfig fields of override section `o` for a model built here: all of them on
    a GPU, without the CUDA-only ones on CPU. Refused fields raise (a config built without the loader)."""
    return _usable_fields(TRANSFORMER, f"megatron.{SECTIONS[TRANSFORMER]}", o, on_cuda)


def optimizer_fields(section, on_cuda: bool) -> dict:
    """As transformer_fields, for an override_optimizer_config section."""
    return _usable_fields(OPTIMIZER, f"optim.{SECTIONS[OPTIMIZER]}", section, on_cuda)


def _usable_fields(kind, prefix: str, section, on_cuda: bool) -> dict:
    fields = overrides_of(section)
    for name, value in fields.items():
        problem = classify(kind, f"{prefix}.{name}", value)
        if problem:
            raise ValueError(problem)
    return {k: v for k, v in fields.items() if on_cuda or not needs_cuda(kind, k, v)}
