"""HybridEngine: the actor's Megatron shards -> its colocated vLLM engine, in one object.

Typical use on every rank of the actor/rollout worker (after Megatron's model exists, before vLLM's):

    hybrid = HybridEngine(dims, GenerationDims(tp=t_g), model_chunks, hf_config, bucket_bytes=256 << 20)
    rollout = VLLMRollout(path, rollout_cfg, group_order=hybrid.group_order)  # vLLM gets the planned groups
    hybrid.verify_groups()                                                    # optional: vLLM built them
    stats = hybrid.sync_to(rollout)          # after every training step, before generating

The plan is made once (parameter shapes do not change); `sync_to` reads the live parameters each
time, streams bucket by bucket through the resharding engine into vLLM and resets its prefix cache.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridflow.parallel.dims import GenerationDims, LayoutError, ModelShape, ParallelDims
from hybridflow.resharding.cross_pool import megatron_named_params
from hybridflow.resharding.engine import DEFAULT_BUCKET_BYTES, ReshardEngine
from hybridflow.resharding.megatron_specs import gather_param_specs, param_specs
from hybridflow.resharding.planner import plan_resharding
from hybridflow.resharding.vllm_groups import planned_vllm_groups, verify_vllm_groups
from hybridflow.resharding.vllm_layout import VllmShardConverter, load_into_vllm, vllm_vocab_pad


class HybridEngine:
    def __init__(
        self,
        dims: ParallelDims,
        gen_dims: GenerationDims,
        model_chunks,
        hf_config,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        group: dist.ProcessGroup | None = None,
    ):
        from megatron_workers import hf_mapping
        from megatron_workers.model_builder import read_hf_facts

        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if len(chunks) != dims.vpp:
            raise LayoutError(f"HybridEngine got {len(chunks)} model chunks per rank, dims.vpp={dims.vpp}")
        self.dims, self.gen_dims, self.hf_config = dims, gen_dims, hf_config
        self.rank = dist.get_rank(group)
        self._check_megatron_order()
        # With VPP a stage holds several non-contiguous layer ranges (one per chunk); the plan is per
        # parameter and its global name, so the chunks simply contribute all their parameters.
        self._chunks = chunks
        facts = read_hf_facts(hf_config)
        ep_rank = dims.expert_coords(self.rank)["ep"]
        named = self._named_params()
        self._check_expert_owners(named, facts, ep_rank)
        local_specs, _ = param_specs(
            named,
            tp=dims.tp,
            pp_stage=dims.coords(self.rank)["pp"],
            vocab_size=facts.vocab_size,
            gen_vocab_pad_multiple=vllm_vocab_pad(),
            is_vocab=lambda name: hf_mapping.describe(name, hf_config).kind == hf_mapping.VOCAB,
            is_expert=hf_mapping.is_expert,
            expert_tp=dims.expert_tp,
            ep_rank=ep_rank,
        )
        self.plan = plan_resharding(dims, gen_dims, gather_param_specs(local_specs, group),
                                    ModelShape.from_hf_config(hf_config))
        self.engine = ReshardEngine(self.plan, bucket_bytes=bucket_bytes, group=group, timeout_s=timeout_s)
        self.converter = VllmShardConverter(self.plan, hf_config, self.rank)

    def _check_megatron_order(self) -> None:
        """The planner assumes Megatron's default rank order (tp fastest, pp slowest); check it on this rank."""
        try:
            from megatron.core import parallel_state as mps
        except ImportError:
            return
        if not mps.model_parallel_is_initialized():
            return
        want = self.dims.coords(self.rank)
        got = {"tp": mps.get_tensor_model_parallel_rank(), "pp": mps.get_pipeline_model_parallel_rank()}
        if got != {"tp": want["tp"], "pp": want["pp"]}:
            raise LayoutError(f"rank {self.rank}: Megatron has (tp, pp) = {got}, ParallelDims.coords says {want}; "
                              "the resharding plan assumes Megatron's default order tp-cp-ep-dp-pp")
        want_e = self.dims.expert_coords(self.rank)
        got_e = {"ep": mps.get_expert_model_parallel_rank(), "etp": mps.get_expert_tensor_parallel_rank()}
        if got_e != {"ep": want_e["ep"], "etp": want_e["etp"]}:
            raise LayoutError(f"rank {self.rank}: Megatron has expert (ep, etp) = {got_e}, "
                              f"ParallelDims.expert_coords says {want_e}; the plan assumes Megatron's expert "
                              "order etp-ep-edp-pp")

    def _check_expert_owners(self, named, facts, ep_rank: int) -> None:
        """Every expert this rank holds is one of its EP rank's (global index e // (E/ep) = ep_rank), so the
        plan's owners are right; a wrong expert offset in the global names would send the wrong weights."""
        from megatron_workers import hf_mapping

        per_rank = max(facts.num_experts // self.dims.ep, 1)
        for name, _ in named:
            if hf_mapping.is_expert(name):
                e = hf_mapping.describe(name, self.hf_config).expert
                if e // per_rank != ep_rank:
                    raise LayoutError(f"rank {self.rank} (EP rank {ep_rank}) holds {name!r}: expert {e} belongs to "
                                      f"EP rank {e // per_rank} ({facts.num_experts} experts / ep={self.dims.ep})")

    def _named_params(self) -> list[tuple[str, torch.Tensor]]:
        return megatron_named_params(self._chunks)  # a tied output layer is the embedding: HF and vLLM keep one

    def group_order(self):
        """Context manager to create the vLLM engine in: its TP groups become the plan's."""
        return planned_vllm_groups(self.plan)

    def verify_groups(self) -> None:
        verify_vllm_groups(self.plan)

    def gen_shards(self):
        """Buckets of {global Megatron name: this rank's generation shard}, from the live parameters."""
        return self.engine.iter_shards({n: p.detach() for n, p in self._named_params()})

    def sync_to(self, rollout, device_kind: str = "auto", poison: float | None = None) -> dict:
        """Reshard and load into `rollout` (a VLLMRollout, vllm.LLM or model runner). Returns the numbers."""
        start = time.perf_counter()
        load = load_into_vllm(rollout, self.gen_shards(), device_kind, converter=self.converter, poison=poison)
        st = self.engine.stats
        return {
            "seconds": time.perf_counter() - start,
            "reshard_s": st.seconds,
            "load_s": load["load_s"] - st.seconds,  # load_into_vllm's clock includes the resharding it drives
            "bytes_recv": st.bytes_recv,
            "bytes_sent": st.bytes_sent,
            "expected_recv_bytes": self.plan.expected_recv_bytes(self.rank),
            "bytes_aliased": st.bytes_aliased,
            "bytes_local_copy": st.bytes_local_copy,
            "peak_extra_bytes": st.peak_extra_bytes,
            "num_buckets": st.num_buckets,
            "device_kind": load["device_kind"],
            "tensors_loaded": load.get("tensors", 0),
        }
