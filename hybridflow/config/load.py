"""Load a config: schema defaults <- YAML file <- command-line dotlist overrides.

Unknown keys fail here, before any process starts, naming the nearest valid key. verl keys that are not in
our schema go through hybridflow.config.verl_compat first: ignored (dropped, logged once with the reason)
or refused (with what to use instead). Every problem of a layer is reported at once, so a pasted verl
command line shows all its refused keys in one error.

verl command-line habits that work as in verl (Hydra): `+key=value` and `++key=value` (every key exists
here, so both mean key=value), `key=[a,b]` lists, and a single string for a list key
(`data.train_files=x.parquet`, `trainer.logger=console`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from hybridflow.config import megatron_checks, verl_compat
from hybridflow.config.schema import (
    INTERPOLATED_DEFAULTS,
    HybridFlowConfig,
    OverrideOptimizerConfig,
    OverrideTransformerConfig,
)

log = logging.getLogger(__name__)

# Sections that take any field of a megatron-core dataclass by name; the fields they do not type go to `other`.
_MEGATRON_SECTIONS = {OverrideTransformerConfig: megatron_checks.TRANSFORMER,
                      OverrideOptimizerConfig: megatron_checks.OPTIMIZER}


class ConfigError(ValueError):
    pass


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _valid_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        keys.append(path)
        default = _default(f)
        if dataclasses.is_dataclass(default):
            keys += _valid_keys(type(default), path + ".")
    return keys


def is_valid_key(key: str) -> bool:
    return key in _valid_keys(HybridFlowConfig)


def _unknown(path: str, cls, prefix: str, source: str) -> str:
    near = difflib.get_close_matches(path, _valid_keys(cls, prefix), n=1, cutoff=0.5) or difflib.get_close_matches(
        path, _valid_keys(HybridFlowConfig), n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return f"unknown config key '{path}' in {source}{hint}"


def _leaves(path: str, value) -> list[tuple[str, object]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(f"{path}.{k}", v)]
    return [(path, value)]


def _is_list_field(f: dataclasses.Field) -> bool:
    return str(f.type).replace(" ", "").startswith(("list[", "list|", "List["))


def _filter_keys(node: dict, cls, prefix: str, source: str, ignored: dict, problems: list[str]) -> None:
    """Check one layer against the schema, in place: verl keys the compat table ignores are removed (and
    collected in `ignored`), refused and unknown keys are collected in `problems`."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    megatron = _MEGATRON_SECTIONS.get(cls)
    for key in list(node):
        value, path = node[key], f"{prefix}{key}"
        if megatron and (key not in names or key == "other"):
            fields = value if key == "other" and isinstance(value, dict) else {key: value}
            bad = [megatron_checks.classify(megatron, f"{prefix}{k}", v) for k, v in fields.items()]
            problems += [f"{b} (in {source})" for b in bad if b]
            if key != "other":  # a Megatron field we do not type: kept by name in `other`
                node.setdefault("other", {})[key] = node.pop(key)
            continue
        if key not in names:
            verdicts = [(leaf, verl_compat.classify(leaf, v)) for leaf, v in _leaves(path, value)]
            if all(v is None for _, v in verdicts):
                problems.append(_unknown(path, cls, prefix, source))
                continue
            for leaf, v in verdicts:
                if v is None:
                    problems.append(_unknown(leaf, cls, prefix, source))
                elif v.kind == verl_compat.REFUSED:
                    problems.append(f"{v.message} (in {source})")
            if all(v is not None and v.kind == verl_compat.IGNORED for _, v in verdicts):
                ignored.update({v.key: v for _, v in verdicts})
                del node[key]
            continue
        f = names[key]
        default = _default(f)
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            _filter_keys(value, type(default), path + ".", source, ignored, problems)
        elif dataclasses.is_dataclass(default) and value is not None:
            sub = [g.name for g in dataclasses.fields(default)][:3]
            problems.append(f"'{path}' is a section of keys ({', '.join(f'{path}.{n}' for n in sub)}, ...), "
                            f"not a value: got {value!r:.80} in {source}")
        elif _is_list_field(f) and isinstance(value, dict):
            problems.append(f"'{path}' is a list, got a mapping {value!r:.80} in {source}; write {path}=[a,b]")
        elif _is_list_field(f) and isinstance(value, str) and not value.startswith("${"):
            node[key] = [value]  # verl (and its data loader / tracker) takes one string for a list
        if not dataclasses.is_dataclass(default):
            verdict = verl_compat.check_value(path, node[key])  # a verl value of our key that we do not have
            if verdict is not None:
                problems.append(f"{verdict.message} (in {source})")


def _checked_layer(cfg, source: str, ignored: dict):
    container = OmegaConf.to_container(cfg, resolve=False)
    if not isinstance(container, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys (data:, trainer:, ...), "
                          f"got a {type(container).__name__}")
    problems: list[str] = []
    _filter_keys(container, HybridFlowConfig, "", source, ignored, problems)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} config keys cannot be used:\n  - " + "\n  - ".join(problems))
    return OmegaConf.create(container)


def _normalise_override(item: str) -> str:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value")
    if item.startswith("~"):
        raise ConfigError(f"override '{item}': Hydra's ~key (delete a key) is not supported; set the key's value")
    # Hydra's +key (add) and ++key (add or override): every key already exists here, so both are key=value.
    return item[2:] if item.startswith("++") else item[1:] if item.startswith("+") else item


@functools.cache
def _defaults():
    """The schema's defaults as a structured config, built once per process: building it is ~60% of a
    load_config (~50 ms of ~80), and the verl-compat and bad-input tests load hundreds of configs. Callers must
    not modify it; OmegaConf.merge copies its first argument."""
    base = OmegaConf.structured(HybridFlowConfig)
    for key, expr in INTERPOLATED_DEFAULTS.items():  # defaults that follow another key, as in verl's yaml
        OmegaConf.update(base, key, expr, merge=False)
    OmegaConf.set_readonly(base, True)  # a caller that writes to it fails loudly instead of changing every load
    return base


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> HybridFlowConfig:
    base = _defaults()
    layers = []
    ignored: dict[str, verl_compat.Verdict] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            text = OmegaConf.load(p)
        except yaml.YAMLError as e:  # the parser's message carries the line and column
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        layers.append(_checked_layer(text, str(p), ignored))
    if overrides:
        items = [_normalise_override(item) for item in overrides]
        layers.append(_checked_layer(OmegaConf.from_dotlist(items), "command line", ignored))
    for verdict in ignored.values():  # once per key, whichever layers set it
        log.warning("ignoring verl key %s", verdict.message)
    try:
        merged = OmegaConf.merge(base, *layers)
        OmegaConf.set_readonly(merged, None)  # the copy is ours to resolve; the shared defaults stay read-only
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except (ValidationError, ConfigKeyError) as e:
        # OmegaConf's message puts the key on a later line among its internals: name the key first.
        key = getattr(e, "full_key", None)
        if key:
            raise ConfigError(f"invalid value for config key '{key}': {str(e).splitlines()[0]}") from None
        raise ConfigError(f"invalid config value: {e}") from None
    return cfg


def to_dict(cfg) -> dict:
    """A loaded config (or a section of one) as plain nested dicts and lists. load_config's result is already
    resolved dataclasses, so dataclasses.asdict gives what OmegaConf's round trip gives at ~1/100 of the cost
    (0.5 ms against 77 ms; the verl-compat tests call it hundreds of times); anything else takes OmegaConf's way."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def save_resolved(cfg, path) -> Path:
    """The whole config as the run used it (defaults, file and overrides resolved) as YAML, so a run directory
    says how it was made and tools read the layout from it instead of re-deriving it from overrides."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))
    return path
