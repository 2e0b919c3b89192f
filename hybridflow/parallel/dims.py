"""The one source of truth for parallel layouts.

Every other module (worker groups, Megatron init, the resharding planner,
the rollout engine) derives its view of the mesh from these two dataclasses
instead of keeping its own copy of tp/pp/dp numbers.

Validation happens here, at config time, so that bad layouts fail with the
numbers in the message before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot work for this world size or model."""


@dataclass(frozen=True)
class ModelShape:
    """The few model numbers that constrain a parallel layout."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int  # the dense MLP's width; for an MoE model, one expert's
    vocab_size: int
    num_experts: int = 0  # 0: dense
    moe_topk: int = 0
    shared_expert_ffn: int = 0  # Qwen2-MoE's always-on shared expert; 0: none

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg) -> ModelShape:
        """Accepts a transformers config object or a plain dict from config.json."""
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        heads = get("num_attention_heads")
        experts = moe_num_experts(cfg)
        return cls(
            num_layers=get("num_hidden_layers"),
            hidden_size=get("hidden_size"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            ffn_hidden_size=(get("moe_intermediate_size") or get("intermediate_size")) if experts
            else get("intermediate_size"),
            vocab_size=get("vocab_size"),
            num_experts=experts,
            moe_topk=int(get("num_experts_per_tok") or 0) if experts else 0,
            shared_expert_ffn=int(get("shared_expert_intermediate_size") or 0) if experts else 0,
        )


def moe_num_experts(cfg) -> int:
    """Routed experts of an HF config, 0 for a dense model. The arches spell it num_experts (Qwen2/3-MoE) or
    num_local_experts (Mixtral; transformers 5 also writes Qwen3-MoE's config.json that way)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    return int(get("num_experts") or get("num_local_experts") or 0)


def default_sequence_parallel(tp: int, model: ModelShape) -> bool:
    """megatron.sequence_parallel=null: on for an MoE model under TP (Megatron trains MoE layers under TP only
    with it), off otherwise. verl's own default is on wherever TP > 1; a dense model keeps it off here unless asked."""
    return tp > 1 and model.is_moe


def _check_divides(what: str, n: int, by_name: str, by: int) -> None:
    if by <= 0 or n % by != 0:
        raise LayoutError(f"{by_name}={by} does not divide {what}={n}")


@dataclass(frozen=True)
class ParallelDims:
    """Training layout: tensor (t), pipeline (p), data (d) and context (cp) parallel sizes.

    Rank order follows Megatron's default 'tp-cp-ep-dp-pp': tp varies fastest,
    pp slowest. `coords(rank)` is the single implementation of that order.

    MoE layers have a mesh of their own over the same ranks (Megatron's expert groups): expert tensor parallel
    etp (None: = tp, Megatron's default), expert parallel ep, and expert data parallel edp = tp*cp*dp / (etp*ep),
    ordered etp-ep-edp-pp (`expert_coords`). Attention and everything outside the experts keep tp/cp/dp.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sp: bool = False  # sequence parallel (needs tp > 1 to mean anything)
    # virtual pipeline: model chunks per PP rank (megatron's interleaved schedule); 1: off. Not a mesh
    # dimension (no ranks of its own): it changes which layers a stage holds (see chunk_layer_offsets).
    vpp: int = 1
    ep: int = 1  # expert_model_parallel_size
    etp: int | None = None  # expert_tensor_parallel_size; None: tp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @classmethod
    def from_megatron_config(cls, m, world_size: int) -> ParallelDims:
        """The layout a `megatron` config section (MegatronConfig, or anything with its keys) asks for on
        `world_size` ranks: dp is what tp*pp*cp leave. Not validated: call .validate(world_size, model)."""
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        if min(tp, pp, cp) < 1 or world_size % (tp * pp * cp):
            raise LayoutError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // (tp * pp * cp), sp=bool(m.sequence_parallel),
                   vpp=getattr(m, "virtual_pipeline_model_parallel_size", None) or 1,
                   ep=getattr(m, "expert_model_parallel_size", 1) or 1,
                   etp=getattr(m, "expert_tensor_parallel_size", None))

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return (self.tp * self.cp * self.dp) // (self.expert_tp * self.ep)

    def validate(self, world_size: int | None = None, model: ModelShape | None = None) -> ParallelDims:
        for name in ("tp", "pp", "dp", "cp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be >= 1")
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(
                f"world size {world_size} != tp*pp*dp*cp = {self.tp}*{self.pp}*{self.dp}*{self.cp} = {self.world_size}"
            )
        if self.sp and self.tp == 1:
            raise LayoutError("sequence_parallel=True needs tp > 1 (got tp=1)")
        if self.vpp < 1:
            raise LayoutError(f"virtual_pipeline_model_parallel_size={self.vpp} must be >= 1 (or null: off)")
        if self.vpp > 1 and self.pp < 2:
            raise LayoutError(f"virtual_pipeline_model_parallel_size={self.vpp} interleaves pipeline stages: it "
                              f"needs pipeline_model_parallel_size >= 2 (got {self.pp})")
        self._validate_experts(model)
        if model is not None:
            _check_divides("num_attention_heads", model.num_heads, "tp", self.tp)
            _check_divides("num_key_value_heads", model.num_kv_heads, "tp", self.tp)
            if not model.is_moe:
                _check_divides("intermediate_size", model.ffn_hidden_size, "tp", self.tp)
            _check_divides("num_hidden_layers", model.num_layers, "pp", self.pp)
            per_stage = model.num_layers // self.pp
            if per_stage % self.vpp:
                raise LayoutError(f"virtual_pipeline_model_parallel_size={self.vpp} does not divide the layers per "
                                  f"pipeline stage ({model.num_layers} layers / pp={self.pp} = {per_stage})")
        return self

    def _validate_experts(self, model: ModelShape | None) -> None:
        """The expert mesh (ep, etp) against the world and the model: the one place these rules live."""
        ep_key, etp_key = "expert_model_parallel_size", "expert_tensor_parallel_size"
        if self.ep < 1 or self.expert_tp < 1:
            raise LayoutError(f"{ep_key}={self.ep} and {etp_key}={self.expert_tp} must be >= 1")
        inner = self.tp * self.cp * self.dp  # the ranks of one pipeline stage, which the expert mesh re-slices
        if inner % (self.ep * self.expert_tp):
            raise LayoutError(f"{ep_key} x {etp_key} = {self.ep} x {self.expert_tp} = {self.ep * self.expert_tp} does "
                              f"not divide the ranks of one pipeline stage, tp*cp*dp = {self.tp}*{self.cp}*{self.dp} "
                              f"= {inner} (world {self.world_size} / pp {self.pp})")
        if model is None:
            return
        if not model.is_moe:
            if self.ep > 1 or self.etp not in (None, self.tp):
                raise LayoutError(f"{ep_key}={self.ep}, {etp_key}={self.etp}: the model is dense (no num_experts "
                                  "in its config); expert parallelism needs an MoE model")
            return
        if self.tp > 1 and not self.sp:
            # megatron refuses it when training (moe_layer.py: "performance may degrade if MoE and tensor
            # parallelism are enabled without also enabling sequence parallelism"); say so before any process
            raise LayoutError(f"an MoE model at tensor_model_parallel_size={self.tp} needs sequence_parallel=true "
                              "(Megatron trains MoE layers under TP only with sequence parallelism)")
        _check_divides("num_experts", model.num_experts, ep_key, self.ep)
        _check_divides("moe_intermediate_size", model.ffn_hidden_size, etp_key, self.expert_tp)
        if model.shared_expert_ffn:
            _check_divides("shared_expert_intermediate_size", model.shared_expert_ffn, "tp", self.tp)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """(etp, ep, edp, pp) coordinates of a global rank in the expert mesh: etp fastest (Megatron's
        expert order tp-ep-dp-pp, with tp = etp)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        inner = self.tp * self.cp * self.dp
        pp, rest = divmod(rank, inner)
        etp = rest % self.expert_tp
        rest //= self.expert_tp
        return {"etp": etp, "ep": rest % self.ep, "edp": rest // self.ep, "pp": pp}

    def layers_per_chunk(self, num_layers: int) -> int:
        """Transformer layers in one model chunk (one PP stage without VPP)."""
        return num_layers // (self.pp * self.vpp)

    def chunk_layer_offsets(self, num_layers: int, pp_rank: int) -> list[int]:
        """Global index of the first layer of each of this PP rank's model chunks, in chunk order.

        Interleaved: chunk v of stage p holds layers [(v*pp + p)*n, (v*pp + p + 1)*n) with n layers per chunk,
        so a stage's layers are not contiguous (megatron's get_transformer_layer_offset with vp_stage=v).
        """
        n = self.layers_per_chunk(num_layers)
        return [(v * self.pp + pp_rank) * n for v in range(self.vpp)]

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) coordinates of a global rank, tp fastest (Megatron's default order)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        tp = rank % self.tp
        rest = rank // self.tp
        cp = rest % self.cp
        rest //= self.cp
        dp = rest % self.dp
        pp = rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def check_recompute(key: str, granularity: str | None, method: str | None, num_layers: int | None,
                    dims: ParallelDims | None = None, model: ModelShape | None = None) -> None:
    """Activation-recompute settings (`key` = the override_transformer_config they came from), at config time.

    Megatron's own rules (TransformerConfig.__post_init__), said with our key names, plus the bound it states
    but does not check: recompute_num_layers <= the layers of one model chunk.
    """
    if granularity is None:
        extra = [k for k, v in (("recompute_method", method), ("recompute_num_layers", num_layers)) if v is not None]
        if extra:
            raise LayoutError(f"{key}.{extra[0]} is set but {key}.recompute_granularity is null (recompute off); "
                              f"set recompute_granularity to one of {', '.join(RECOMPUTE_GRANULARITIES)}")
        return
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise LayoutError(f"{key}.recompute_granularity={granularity!r}; choose one of "
                          f"{', '.join(RECOMPUTE_GRANULARITIES)} (or null: off)")
    if method is not None and method not in RECOMPUTE_METHODS:
        raise LayoutError(f"{key}.recompute_method={method!r}; choose one of {', '.join(RECOMPUTE_METHODS)}")
    if granularity == "selective":
        for name, value in (("recompute_method", method), ("recompute_num_layers", num_layers)):
            if value is not None:
                raise LayoutError(f"{key}.{name}={value!r} with recompute_granularity=selective: selective "
                                  "recomputes the core attention of every layer; leave it null")
        return
    if method is None or num_layers is None:
        missing = "recompute_method" if method is None else "recompute_num_layers"
        raise LayoutError(f"{key}.recompute_granularity=full needs {key}.{missing} "
                          f"(method: {' | '.join(RECOMPUTE_METHODS)}; num_layers: layers per checkpointed group)")
    if num_layers < 1:
        raise LayoutError(f"{key}.recompute_num_layers={num_layers} must be >= 1")
    if dims is not None and model is not None:
        per_chunk = dims.layers_per_chunk(model.num_layers)
        if num_layers > per_chunk:
            where = f"pp={dims.pp}" + (f" x vpp={dims.vpp} model chunks" if dims.vpp > 1 else "")
            raise LayoutError(f"{key}.recompute_num_layers={num_layers} is larger than the layers per pipeline "
                              f"stage{' chunk' if dims.vpp > 1 else ''}: {model.num_layers} layers / {where} = "
                              f"{per_chunk}")


@dataclass(frozen=True)
class GenerationDims:
    """Rollout layout: generation tensor parallel t_g, with p_g = 1 (as in the paper's Table 2).

    The number of generation replicas (micro-DP * d) follows from the world size.
    """

    tp: int = 1

    def replicas(self, world_size: int) -> int:
        return world_size // self.tp

    def validate(self, train: ParallelDims, model: ModelShape | None = None) -> GenerationDims:
        t_g = self.tp
        if t_g < 1:
            raise LayoutError(f"rollout tensor_model_parallel_size={t_g} must be >= 1")
        if t_g > train.world_size:
            raise LayoutError(f"rollout tp={t_g} needs more ranks than the world size {train.world_size}")
        if train.world_size % t_g != 0:
            raise LayoutError(f"rollout tp={t_g} does not divide the world size {train.world_size}")
        # t_g need not nest with t*p (the paper's Table 2 assumes t_g*p_g <= t*p for its formula only): a generation
        # group may span pipeline stages, and the planner routes every stage's layers to it from their holders
        # (hybridflow/resharding/planner.py, check_layouts has the rule the shards need: t and t_g nest).
        if model is not None:
            _check_divides("num_attention_heads", model.num_heads, "rollout tp", t_g)
            _check_divides("num_key_value_heads", model.num_kv_heads, "rollout tp", t_g)
            _check_divides("intermediate_size", model.ffn_hidden_size, "rollout tp", t_g)
        return self
