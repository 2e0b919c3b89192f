"""The 3D-HybridEngine: training (Megatron) shards -> generation (vLLM) shards without gathering the model.

planner.py        pure plan: rank placement (paper's mesh) and per-parameter transfers, closed forms
intervals.py      the row-interval arithmetic the plan is made of
engine.py         executes a plan with torch.distributed p2p, bucket by bucket, zero-copy where possible
naive.py          the all-gather baseline (for the benchmark and as a second path in tests)
megatron_specs.py Megatron parameters -> ParamSpecs (from their own TP attributes)
vllm_groups.py    makes vLLM's TP groups the planned ones (version-checked, scoped patch)
vllm_layout.py    generation shards -> vLLM (CPU: reload_weights; GPU: direct copy), via hf_mapping
hybrid_engine.py  HybridEngine: all of the above for one actor/rollout worker
cross_pool_plan.py  the plan of weights from a training pool to a separate rollout pool (async RL), pure
cross_pool.py     carrying it out: the sync group, the handshake, send/receive
"""
