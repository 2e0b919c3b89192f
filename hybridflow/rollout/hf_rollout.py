"""A rollout on Hugging Face transformers `generate`: the reference engine and the fallback.

Tests compare vLLM against it, and it stands in where vLLM is not installed (e.g. the
GPU machine). It is slower than vLLM for anything but tiny models, batches all
prompts in one `generate` call and holds its own full copy of the weights.

Log-probs come from `generate`'s output scores: the logits after the same processors
that sampling used (temperature, top-k, top-p), so their log_softmax is the sampler's
distribution, the same quantity vLLM reports in "processed_logprobs" mode.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable

import torch

from hybridflow.config.schema import RolloutConfig
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, SamplingSettings
from hybridflow.rollout.output import assemble_rollout_output, cut_at_stop

logger = logging.getLogger(__name__)


class HFRollout(Rollout):
    """Rollout on `model.generate`. `model` is a loaded causal LM or an HF directory path."""

    def __init__(self, model, config: RolloutConfig, *, pad_token_id: int | None = None,
                 eos_token_id: int | list[int] | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None, router_dtype: torch.dtype = torch.float32):
        self.config = config
        if isinstance(model, str) or hasattr(model, "__fspath__"):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        from hybridflow.rollout.moe_routing import RouterRecorder

        # MoE: routers in the training's router dtype; with routing replay, their choices recorded per token
        self.routing = RouterRecorder(model, router_dtype, record=bool(config.enable_rollout_routing_replay))
        if config.enable_rollout_routing_replay and not self.routing.routers:
            raise ValueError("actor_rollout_ref.rollout.enable_rollout_routing_replay=true, but the model has no MoE "
                             "routers to record")
        gen_cfg = getattr(model, "generation_config", None)
        cfg = model.config
        self.pad_token_id = _first_set(pad_token_id, getattr(gen_cfg, "pad_token_id", None), cfg.pad_token_id)
        if self.pad_token_id is None:
            raise ValueError("HFRollout: the model has no pad_token_id; pass pad_token_id=")
        eos = _first_set(eos_token_id, getattr(gen_cfg, "eos_token_id", None), cfg.eos_token_id)
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.vocab_size = cfg.vocab_size
        self.last_stats: dict[str, float] = {}
        # No tensor parallelism here: in a distributed world every rank is its own replica, so
        # the trainer can slice and gather exactly as for vLLM (see replicas.py).
        import torch.distributed as dist

        on_world = dist.is_available() and dist.is_initialized()
        self.replica_rank = dist.get_rank() if on_world else 0
        self.num_replicas = dist.get_world_size() if on_world else 1
        self.tp_rank = 0
        self.is_replica_leader = True

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _stop_ids(self, s: SamplingSettings) -> list[int]:
        ids = ([] if s.ignore_eos else list(self.eos_token_ids)) + list(s.stop_token_ids)
        return list(dict.fromkeys(ids))

    def _call_seed(self, s: SamplingSettings) -> int:
        """Seeded per call from the config seed, without touching the caller's global RNG. Validation calls
        count on their own, so the n-th training call draws the same seed whether or not validations ran."""
        base, index = (s.seed if s.seed is not None else 0), self.next_call_index(s)
        return hash((base, index, 1)) % (2**63) if s.is_validation else base + index

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        s = self.sampling_for(prompts)
        ids = prompts.batch["input_ids"].to(self.device)
        mask = prompts.batch["attention_mask"].to(self.device)
        if len(prompts) == 0:
            return assemble_rollout_output(prompts, [], [] if self.config.calculate_log_probs else None, s.n,
                                           s.response_length, self.pad_token_id)
        stop_ids = self._stop_ids(s)
        kwargs = dict(
            max_new_tokens=s.response_length,
            min_new_tokens=0,
            num_return_sequences=s.n,
            pad_token_id=self.pad_token_id,
            # An out-of-vocabulary id never matches, which is how "do not stop" is spelled when
            # there is no stop id: None would fall back to the model's own eos.
            eos_token_id=stop_ids or [self.vocab_size],
            output_scores=True,
            return_dict_in_generate=True,
        )
        if s.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k if s.top_k > 0 else 0)
        seed = self._call_seed(s)
        self.routing.start(next(self.model.parameters()).dtype)
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start

        generated = out.sequences[:, ids.shape[1]:].cpu()
        if generated.shape[1]:
            scores = torch.stack(out.scores, dim=1).float()  # (B*n, steps, V), processed logits
            token_logp = torch.log_softmax(scores, dim=-1).gather(-1, generated.to(scores.device).unsqueeze(-1))
            token_logp = token_logp.squeeze(-1).cpu()
        else:
            token_logp = torch.zeros(generated.shape)
        stop_set = set(stop_ids)
        responses, log_probs = [], []
        for row, lp in zip(generated.tolist(), token_logp.tolist()):
            n_tok = cut_at_stop(row, stop_set)
            responses.append(row[:n_tok])
            log_probs.append(lp[:n_tok])
        num_tokens = sum(len(r) for r in responses)
        self.last_stats = {"seconds": elapsed, "response_tokens": num_tokens,
                           "tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0}
        output = assemble_rollout_output(prompts, responses, log_probs if self.config.calculate_log_probs else None,
                                         s.n, s.response_length, self.pad_token_id)
        if self.routing.record:
            from hybridflow.rollout.moe_routing import ROUTED_EXPERTS

            output.batch[ROUTED_EXPERTS] = self.routing.routed_experts(generated.shape[0], ids.shape[1],
                                                                        s.response_length, generated.shape[1])
        return output

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named full tensors into the model. Unknown names are an error; missing ones keep
        their old values (partial updates are allowed here)."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params[name] if name in params else _fused_expert_view(name, params)
                if target is None:
                    raise KeyError(f"HFRollout.load_weights: no parameter named {name!r} in the model")
                if target.shape != tensor.shape:
                    raise ValueError(f"HFRollout.load_weights: {name!r} has shape {tuple(target.shape)}, "
                                     f"got {tuple(tensor.shape)}")
                target.copy_(tensor)


# A checkpoint's per-expert tensor (what hf_mapping and the weight sync speak): layer, block, expert, projection.
_EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                            r"(gate_proj|w1|up_proj|w3|down_proj|w2)\.weight$")


def _fused_expert_view(name: str, params: dict) -> torch.Tensor | None:
    """Where a checkpoint-format MoE tensor lives in a transformers >= 5 model, which holds each layer's experts
    fused: `mlp.experts.gate_up_proj` [E, 2*ffn, hidden] (gate rows, then up rows) and `mlp.experts.down_proj`
    [E, hidden, ffn], and Mixtral's `block_sparse_moe.*` under `mlp.*`. The weight sync of tests/test_e2e_moe.py
    goes through here (fp32 rollout and training log-probs then agree within 1e-4). None: no such parameter."""
    m = _EXPERT_TENSOR.match(name)
    if m is None:
        renamed = name.replace(".block_sparse_moe.", ".mlp.")
        return params.get(renamed) if renamed != name else None
    layer, expert, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj in ("down_proj", "w2"):
        fused = params.get(f"{layer}.mlp.experts.down_proj")
        return None if fused is None else fused[expert]
    fused = params.get(f"{layer}.mlp.experts.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj in ("gate_proj", "w1") else fused[expert, half:]


def _first_set(*values):
    for v in values:
        if v is not None:
            return v
    return None
