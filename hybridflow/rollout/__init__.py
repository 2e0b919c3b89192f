"""Rollout engines behind one interface (`base.Rollout.generate_sequences`).

- base.py: the interface, the output keys and the sampling settings
- output.py: the one place that pads responses and builds masks / positions
- replicas.py: slicing a batch over generation replicas and gathering it back
- vllm_rollout.py / vllm_launch.py: in-process vLLM (external_launcher) on the worker's ranks
- hf_rollout.py: HF transformers `generate`, the reference and the fallback

Nothing here imports vLLM at package import (it costs ~13 s); the engine modules do, lazily.
"""
