"""The rollout interface: prompts in, verl-shaped sequences out.

Every engine (vLLM in-process, HF transformers `generate`) implements `Rollout`.
What goes in and what comes out is fixed here so the trainer never needs to know
which engine produced a batch:

input  `DataProto` batch keys
    input_ids       (B, P) left-padded prompt ids
    attention_mask  (B, P) 1 on prompt tokens, 0 on left padding
    position_ids    (B, P) optional; derived from attention_mask when absent
  meta_info may override sampling for one call (see `SAMPLING_OVERRIDE_KEYS`),
  e.g. `do_sample=False` for greedy validation; `validate=True` marks a validation call,
  which draws from its own seed stream so the training calls sample what they would without it.

output `DataProto` with B*n rows, sample j of prompt i at row i*n + j:
    prompts            (B*n, P)    the prompt ids, left-padded as given
    responses          (B*n, R)    generated ids, right-padded with the pad id
    input_ids          (B*n, P+R)  prompts ++ responses
    attention_mask     (B*n, P+R)  prompt mask ++ response_mask
    position_ids       (B*n, P+R)  response positions continue after the prompt's last one
    response_mask      (B*n, R)    1 on generated tokens up to and including the stop token
    rollout_log_probs  (B*n, R)    the sampler's log-prob of each generated token, 0 after the end
  non-tensor fields (and any extra tensor fields) of the input repeated interleaved for n;
  meta_info carried over unchanged.

R is the configured `response_length` for every call, so outputs of different
replicas and steps concatenate without re-padding.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from hybridflow.config.schema import RolloutConfig
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)

# actor_rollout_ref.rollout.name: the engines megatron_workers/rollout_role.py can attach.
ENGINES = ("vllm", "hf")

# meta_info keys that may override the configured sampling for a single call.
SAMPLING_OVERRIDE_KEYS = ("do_sample", "n", "temperature", "top_p", "top_k", "response_length", "seed", "validate")
# meta_info key -> SamplingSettings field where the names differ (verl's "validate" would shadow validate()).
_FIELD_OF_KEY = {"validate": "is_validation"}


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling of one `generate_sequences` call: the config merged with meta_info overrides.

    Log-prob semantics (both engines): the log-prob under the distribution actually sampled from,
    i.e. log_softmax(logits / temperature) after top-k/top-p filtering. With top_p=1 and top_k off
    this is exactly what the trainer computes from the same logits; greedy uses temperature 1.
    """

    do_sample: bool = True
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    response_length: int = 32
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    # A validation call: engines seed it from a separate counter, so validating does not shift the
    # per-call seeds of the training rollouts (a run with validation samples what one without does).
    is_validation: bool = False

    @classmethod
    def from_config(cls, config: RolloutConfig) -> SamplingSettings:
        return cls(
            do_sample=True,
            n=config.n,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            response_length=config.response_length,
            stop_token_ids=tuple(config.stop_token_ids),
            ignore_eos=config.ignore_eos,
            seed=config.seed,
        ).validate()

    def with_overrides(self, meta_info: dict) -> SamplingSettings:
        """Applies the meta_info overrides. `do_sample=False` means greedy with n=1 unless n is given too."""
        over = {_FIELD_OF_KEY.get(k, k): meta_info[k] for k in SAMPLING_OVERRIDE_KEYS if k in meta_info}
        if over.get("do_sample", True) is False:
            over.setdefault("n", 1)
        if not over:
            return self
        return replace(self, **over).validate()

    @property
    def greedy(self) -> bool:
        # A temperature of 0 is greedy in vLLM; treat it the same everywhere.
        return not self.do_sample or self.temperature == 0

    def validate(self) -> SamplingSettings:
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n={self.n!r} must be an int >= 1")
        if not isinstance(self.response_length, int) or self.response_length < 1:
            problems.append(f"response_length={self.response_length!r} must be an int >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.top_k, int):
            problems.append(f"top_k={self.top_k!r} must be an int (<= 0 turns it off)")
        if problems:
            raise ValueError("rollout sampling settings: " + "; ".join(problems))
        return self


def prompt_token_lists(prompts: DataProto) -> list[list[int]]:
    """The unpadded prompt of each row: `input_ids` where `attention_mask` is 1.

    Prompts must be left-padded: a row whose mask has a 0 after a 1 is rejected, because the
    response would then not start right after the prompt's last token.
    """
    for key in ("input_ids", "attention_mask"):
        if key not in prompts.batch:
            raise KeyError(f"rollout input needs batch key {key!r}; got {sorted(prompts.batch)}")
    ids, mask = prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].cpu()
    if ids.shape != mask.shape or ids.ndim != 2:
        raise ValueError(f"rollout input: input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} "
                         "must be equal 2-D shapes")
    keep = mask.bool()
    # Left padding means the mask is non-decreasing along each row.
    bad = (keep[:, :-1] & ~keep[:, 1:]).any(dim=1).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"rollout input: rows {bad.tolist()[:8]} are not left-padded (attention_mask has 0 after 1)")
    empty = (~keep.any(dim=1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"rollout input: rows {empty.tolist()[:8]} have an empty prompt (attention_mask all 0)")
    return [row[m].tolist() for row, m in zip(ids, keep)]


def prompt_position_ids(prompts: DataProto) -> torch.Tensor:
    """`position_ids` if given, else 0 at each row's first real token (clamped at 0 over the padding)."""
    if "position_ids" in prompts.batch:
        return prompts.batch["position_ids"]
    mask = prompts.batch["attention_mask"].long()
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


class Rollout(abc.ABC):
    """Generates responses for a batch of prompts; see the module docstring for the keys."""

    config: RolloutConfig

    @abc.abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        ...

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replaces the weights with HF-named full (unsharded) tensors.

        One call should carry the whole model (a generator is fine): engines that re-process
        weights per module need all parts of a fused module (q/k/v, gate/up) in the same call.
        """

    # Engines without anything to free or cache keep these no-op defaults.
    def release(self) -> None:
        """Frees KV cache and weights between rollouts where the engine can; a no-op otherwise."""
        return None

    def resume(self) -> None:
        """Undoes `release` before the next weight load and generation."""
        return None

    def reset_prefix_cache(self) -> None:
        """Drops cached prompt prefixes (they were computed with the old weights)."""
        return None

    def sampling_for(self, prompts: DataProto) -> SamplingSettings:
        s = SamplingSettings.from_config(self.config).with_overrides(prompts.meta_info)
        step = prompts.meta_info.get("global_step")
        if step is not None and not s.is_validation:
            # Step n's rollout is the n-th training call, also in a worker restarted from a checkpoint at
            # step n-1: its samples (and so the resumed run's weights) equal an uninterrupted run's.
            self.__dict__.setdefault("_call_counts", {False: 0, True: 0})[False] = max(int(step) - 1, 0)
        return s

    def next_call_index(self, s: SamplingSettings) -> int:
        """How many calls of this kind came before: training and validation calls are counted apart, so
        the n-th training call is seeded the same whether or not validations ran in between."""
        counts = self.__dict__.setdefault("_call_counts", {False: 0, True: 0})
        index = counts[s.is_validation]
        counts[s.is_validation] += 1
        return index
