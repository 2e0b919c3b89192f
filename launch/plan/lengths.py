"""Response lengths: real runs stop at EOS, so a step's tokens and its generation time follow a length distribution,
not the budget. Pure functions, no I/O except `from_rollout_dir`.

A `Lengths` is either given as mean and 99th percentile (a log-normal with that mean and p99, clamped to
[1, budget]: response lengths of sampled LLM answers are right-skewed and positive), or read from a run's
`trainer.rollout_data_dir` jsonl files (an empirical histogram). Without either, every response runs to the
budget (what `ignore_eos` runs and the HybridFlow paper's fixed 1024-token responses do).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

Z99 = NormalDist().inv_cdf(0.99)  # 2.326


@dataclass(frozen=True)
class Lengths:
    budget: int  # rollout.response_length: no response is longer
    mean: float  # mean response tokens (before the clamp to the budget; sample_mean() is after)
    p99: float  # 99th percentile (before the clamp)
    sorted_sample: tuple[int, ...] = ()  # an empirical distribution (rollout_data_dir), ascending; empty: log-normal
    source: str = "budget"

    def quantile(self, q: float) -> float:
        """The length at cumulative probability q in (0, 1)."""
        if self.sorted_sample:
            s = self.sorted_sample
            return float(s[min(len(s) - 1, int(q * len(s)))])
        if self.mean >= self.budget:
            return float(self.budget)
        mu, sigma = lognormal_params(self.mean, self.p99)
        x = math.exp(mu + sigma * NormalDist().inv_cdf(min(max(q, 1e-9), 1 - 1e-9))) if sigma > 0 else self.mean
        return float(min(max(x, 1.0), self.budget))

    def sample(self, n: int) -> list[int]:
        """n lengths at the mid-quantiles (i + 0.5)/n, in a fixed low-discrepancy order (the golden-ratio stride), so
        arrival order is uncorrelated with length, as for the requests of a real batch, without a random generator."""
        qs = [max(1, round(self.quantile((i + 0.5) / n))) for i in range(n)]
        stride = max(1, round(n * 0.6180339887)) | 1
        while math.gcd(stride, n) != 1:
            stride += 2
        return [qs[(i * stride) % n] for i in range(n)]

    def expected_max(self, k: int) -> float:
        """The expected longest of k responses (approximated by the k/(k+1) quantile): what a micro-batch of k rows
        trimmed to its longest row pads to."""
        return self.quantile(k / (k + 1))

    def sample_mean(self, n: int = 4096) -> float:
        """The mean after clamping to the budget (the log-normal's mean is `mean` only before the clamp)."""
        s = self.sample(n)
        return sum(s) / len(s)


def lognormal_params(mean: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal with this mean and 99th percentile: ln p99 - ln mean = z*sigma - sigma^2/2, the
    smaller root (the other one puts most mass near 0)."""
    if p99 <= mean:
        return math.log(mean), 0.0
    c = math.log(p99 / mean)
    disc = Z99 * Z99 - 2 * c
    if disc < 0:
        raise ValueError(f"p99 {p99:g} is more than {math.exp(Z99 * Z99 / 2):.1f}x the mean {mean:g}: no log-normal "
                         "has that shape; give a rollout_data_dir histogram instead")
    sigma = Z99 - math.sqrt(disc)
    return math.log(mean) - sigma * sigma / 2, sigma


def from_stats(budget: int, mean: float | None, p99: float | None) -> Lengths:
    """Lengths from --response-length-mean / --response-length-p99; no mean: every response at the budget."""
    if mean is None:
        if p99 is not None:
            raise ValueError("--response-length-p99 needs --response-length-mean")
        return Lengths(budget, float(budget), float(budget))
    if not 0 < mean <= budget:
        raise ValueError(f"--response-length-mean {mean:g} must be in (0, rollout.response_length={budget}]")
    p99 = float(budget) if p99 is None else float(p99)
    if p99 < mean:  # above the budget is fine: the untruncated tail, cut at the budget
        raise ValueError(f"--response-length-p99 {p99:g} must be >= the mean {mean:g}")
    lognormal_params(mean, p99)  # raises on a shape no log-normal has
    return Lengths(budget, float(mean), p99, source=f"mean {mean:g}, p99 {p99:g} (log-normal, clamped to {budget})")


def from_records(budget: int, response_lengths: list[int], prompt_lengths: list[int]) -> tuple[Lengths, float]:
    """An empirical distribution and the mean prompt length, from per-sample token counts."""
    if not response_lengths:
        raise ValueError("no samples")
    s = tuple(sorted(min(max(1, x), budget) for x in response_lengths))
    mean = sum(s) / len(s)
    p99 = float(s[min(len(s) - 1, int(0.99 * len(s)))])
    prompt_mean = sum(prompt_lengths) / len(prompt_lengths) if prompt_lengths else 0.0
    return Lengths(budget, mean, p99, s, f"histogram of {len(s)} samples"), prompt_mean


def from_rollout_dir(budget: int, directory: str | Path) -> tuple[Lengths, float]:
    """Read every step_*.jsonl under a run's trainer.rollout_data_dir (hybridflow.trainer.rollout_dump.rollout_records:
    prompt_ids and response_ids per sample)."""
    files = sorted(Path(directory).glob("step_*.jsonl"))
    if not files:
        raise ValueError(f"{directory}: no step_*.jsonl files (trainer.rollout_data_dir writes them)")
    resp, prompt = [], []
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                resp.append(len(rec.get("response_ids") or []))
                prompt.append(len(rec.get("prompt_ids") or []))
    lengths, prompt_mean = from_records(budget, resp, prompt)
    return Lengths(budget, lengths.mean, lengths.p99, lengths.sorted_sample,
                   f"{lengths.source} from {len(files)} files in {directory}"), prompt_mean
