"""Load a config: schema defaults <- YAML file <- command-line dotlist overrides.

Unknown keys fail here, before any process starts, naming the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from hybridflow.config.schema import HybridFlowConfig


class ConfigError(ValueError):
    pass


def _valid_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        keys.append(path)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += _valid_keys(type(default), path + ".")
    return keys


def _check_keys(node: dict, cls, prefix: str, source: str) -> None:
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key not in names:
            valid = _valid_keys(cls, prefix)
            near = difflib.get_close_matches(path, valid, n=1, cutoff=0.5) or difflib.get_close_matches(
                path, _valid_keys(HybridFlowConfig), n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"unknown config key '{path}' in {source}{hint}")
        f = names[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            _check_keys(value, type(default), path + ".", source)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> HybridFlowConfig:
    base = OmegaConf.structured(HybridFlowConfig)
    layers = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        file_cfg = OmegaConf.load(p)
        _check_keys(OmegaConf.to_container(file_cfg, resolve=False), HybridFlowConfig, "", str(p))
        layers.append(file_cfg)
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override '{item}' is not key=value")
        cli = OmegaConf.from_dotlist(list(overrides))
        _check_keys(OmegaConf.to_container(cli, resolve=False), HybridFlowConfig, "", "command line")
        layers.append(cli)
    try:
        merged = OmegaConf.merge(base, *layers)
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except (ValidationError, ConfigKeyError) as e:
        raise ConfigError(f"invalid config value: {e}") from None
    return cfg


def to_dict(cfg) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def save_resolved(cfg, path) -> Path:
    """The whole config as the run used it (defaults, file and overrides resolved) as YAML, so a run directory
    says how it was made and tools read the layout from it instead of re-deriving it from overrides."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))
    return path
