"""`--space KEY=KIND(ARGS)` specs: parsed and checked without Ray, then turned into Ray Tune search-space objects.

    actor_rollout_ref.actor.optim.lr=loguniform(1e-6,1e-4)   a float, log-uniform in [a, b]   (0 < a < b)
    critic.optim.lr=uniform(1e-4,1e-3)                        a float, uniform in [a, b]        (a < b)
    data.train_batch_size=randint(8,33)                       an int in [a, b), as tune.randint (a < b)
    algorithm.kl_ctrl.kl_coef=choice(0.001,0.01)              one of the values, sampled
    actor_rollout_ref.rollout.n=grid(2,4)                     every value, each in its own trial(s)

Values are YAML scalars, as in a trainer override (`0.001` a float, `4` an int, `true` a bool, `gae` a string).
A key must be one of hybridflow/config/schema.py's (what the trainer's overrides accept); that each value fits
the key's type is checked against the config loader by launch.sweep.run before any trial starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import yaml

KINDS = {"loguniform": 2, "uniform": 2, "randint": 2, "choice": None, "grid": None}  # kind -> argument count
_SPEC = re.compile(r"^\s*([^=\s]+)\s*=\s*([a-z_]+)\s*\((.*)\)\s*$", re.DOTALL)


class SpaceError(ValueError):
    pass


@dataclass(frozen=True)
class Dim:
    """One swept key: `kind` (KINDS) over `args` (the range's bounds, or the values)."""
    key: str
    kind: str
    args: tuple

    def values_to_check(self) -> tuple:
        """Values whose override must load: every choice/grid value, a range's two bounds."""
        return self.args

    def to_tune(self):
        from ray import tune

        a = self.args
        return {"loguniform": lambda: tune.loguniform(*a), "uniform": lambda: tune.uniform(*a),
                "randint": lambda: tune.randint(*a), "choice": lambda: tune.choice(list(a)),
                "grid": lambda: tune.grid_search(list(a))}[self.kind]()


def _scalar(spec: str, text: str):
    text = text.strip()
    if not text:
        raise SpaceError(f"--space {spec!r}: an empty value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string; the config loader reads a float
        try:
            value = float(text)
        except ValueError:
            pass
    if isinstance(value, (dict, list)) or value is None:
        raise SpaceError(f"--space {spec!r}: {text!r} is not a scalar value")
    return value


def _number(spec: str, key: str, kind: str, value, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        need = "integers" if integer else "numbers"
        raise SpaceError(f"--space {spec!r}: {kind} takes {need}, got {value!r} for {key}")
    if not math.isfinite(value):
        raise SpaceError(f"--space {spec!r}: {value!r} is not finite ({key})")
    return value if integer else float(value)


def parse_dim(spec: str) -> Dim:
    """`KEY=KIND(ARGS)` -> Dim; a malformed spec fails naming the spec and the key. The key is not checked here."""
    m = _SPEC.match(spec)
    if not m:
        raise SpaceError(f"--space {spec!r} is not KEY=KIND(ARGS), e.g. actor_rollout_ref.actor.optim.lr="
                         f"loguniform(1e-6,1e-4); kinds: {', '.join(KINDS)}")
    key, kind, body = m.group(1), m.group(2), m.group(3)
    if kind not in KINDS:
        raise SpaceError(f"--space {spec!r}: unknown kind {kind!r} for {key}; choose one of {', '.join(KINDS)}")
    args = tuple(_scalar(spec, part) for part in body.split(",")) if body.strip() else ()
    want = KINDS[kind]
    if want is not None and len(args) != want:
        raise SpaceError(f"--space {spec!r}: {kind} takes {want} bounds (low,high) for {key}, got {len(args)}")
    if want is None:
        if not args:
            raise SpaceError(f"--space {spec!r}: {kind} needs at least one value for {key}")
        if len(set(map(repr, args))) != len(args):
            raise SpaceError(f"--space {spec!r}: {kind} lists a value twice for {key}")
        return Dim(key, kind, args)
    low, high = (_number(spec, key, kind, v, integer=kind == "randint") for v in args)
    if not low < high:
        raise SpaceError(f"--space {spec!r}: {kind} needs low < high for {key}, got {low} and {high}")
    if kind == "loguniform" and low <= 0:
        raise SpaceError(f"--space {spec!r}: loguniform needs 0 < low for {key}, got {low}")
    return Dim(key, kind, (low, high))


def parse_space(specs: list[str], is_valid_key) -> list[Dim]:
    """Every spec parsed; a key the schema lacks (`is_valid_key`) or a key given twice fails, naming it."""
    if not specs:
        raise SpaceError("no --space given: a sweep needs at least one KEY=KIND(ARGS)")
    dims = [parse_dim(s) for s in specs]
    seen = set()
    for spec, d in zip(specs, dims, strict=True):
        if not is_valid_key(d.key):
            raise SpaceError(f"--space {spec!r}: {d.key} is not a config key (hybridflow/config/schema.py)")
        if d.key in seen:
            raise SpaceError(f"--space {spec!r}: {d.key} is swept twice")
        seen.add(d.key)
    return dims


def override(key: str, value) -> str:
    """A trial's value as a trainer dotlist override (YAML scalar syntax, so it loads back as the same value)."""
    if isinstance(value, float):
        return f"{key}={value!r}"
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
