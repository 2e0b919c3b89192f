"""Step metrics as Prometheus gauges (`trainer.logger: [..., prometheus]`).

Naming (pure, `series_of`): a metric key becomes `hybridflow_<key>` with every character Prometheus does not
allow in a name turned into `_` (`critic/score/mean` -> `hybridflow_critic_score_mean`, `@` spelled `_at_`:
`val-core/x/reward/mean@1` -> `hybridflow_val_core_x_reward_mean_at_1`). The name keeps the whole key, so a
jsonl key maps to exactly one gauge and back. Labels: `project`, `experiment`, and `role` when a role's
workers measured the metric (`role_of`).

Where the gauges go (`resolve_mode`, trainer.prometheus.mode):
- `ray`: through `ray.util.metrics`, into the metrics agent of the driver's Ray node; Ray's own Prometheus
  export (every node's metrics port, listed in Ray's service-discovery file) serves them next to Ray's node
  metrics, under Ray's `ray_` namespace prefix (`ray_hybridflow_critic_score_mean`).
- `http`: a prometheus_client endpoint of this driver on trainer.prometheus.host:port (127.0.0.1 unless set),
  serving the newest step as one consistent snapshot (a scrape never mixes two steps).
- `auto`: `ray` when the trainer joined a running cluster (trainer.ray.address set: that cluster outlives the
  run and is what a Prometheus is pointed at), `http` when it started its own local one (which dies with the
  run and keeps its metrics port unadvertised).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time

log = logging.getLogger(__name__)

PREFIX = "hybridflow_"
MODES = ("auto", "ray", "http")
# Worker groups whose own processes measure metrics named `<role>/...` (update losses, clip fractions, perf).
ROLES = ("actor", "critic", "ref", "rollout", "reward_model")
# verl files these under actor/ and critic/, but the driver computes them from the batch (metrics.py
# data_metrics, the KL controller): no role's workers measured them, so they carry no role label.
DRIVER_COMPUTED = ("critic/score/", "critic/rm_score/", "critic/rewards/", "critic/advantages/",
                   "critic/returns/", "critic/values/", "critic/vf_explained_var", "actor/kl_coef",
                   "actor/reward_kl_penalty", "rollout/logprob_diff_", "rollout/prob_diff_")

_INVALID = re.compile(r"[^a-zA-Z0-9_]+")  # colons are legal but reserved for recording rules


def sanitize_name(key: str) -> str:
    """`hybridflow_` + the key with every run of characters outside [a-zA-Z0-9_] as one `_` (`@` as `_at_`)."""
    if not key:
        raise ValueError("an empty metric key has no Prometheus name")
    body = _INVALID.sub("_", key.replace("@", "_at_")).strip("_")
    body = re.sub("_+", "_", body)
    return PREFIX + (body or "unnamed")


def role_of(key: str) -> str | None:
    """The worker group that measured `key`: its first path segment when that names a role, except verl's
    driver-computed data metrics filed under actor/ and critic/ (DRIVER_COMPUTED)."""
    head, sep, _ = key.partition("/")
    if not sep or head not in ROLES:
        return None
    if any(key == d.rstrip("/") or key.startswith(d) for d in DRIVER_COMPUTED):
        return None
    return head


def series_of(key: str) -> tuple[str, str | None]:
    """(gauge name, role label or None) of a step metric key."""
    return sanitize_name(key), role_of(key)


def resolve_mode(mode: str, joined_cluster: bool) -> str:
    if mode not in MODES:
        raise ValueError(f"trainer.prometheus.mode={mode!r}: choose from {list(MODES)}")
    if mode == "auto":
        return "ray" if joined_cluster else "http"
    return mode


class _Series:
    """Step keys -> gauge names, refusing (once, with a warning) a key whose name another key already took."""

    def __init__(self):
        self._name_of: dict[str, tuple[str, str | None]] = {}
        self._owner: dict[str, str] = {}

    def get(self, key: str) -> tuple[str, str | None] | None:
        if key not in self._name_of:
            name, role = series_of(key)
            owner = self._owner.setdefault(name, key)
            if owner != key:
                log.warning("prometheus: %r and %r both map to %s; only %r is exported", owner, key, name, owner)
                self._name_of[key] = None
            else:
                self._name_of[key] = (name, role)
        return self._name_of[key]


class HttpExporter:
    """prometheus_client's HTTP server over a custom collector that yields the newest step's snapshot."""

    def __init__(self, project: str, experiment: str, host: str = "127.0.0.1", port: int = 0,
                 linger_s: float = 0.0):
        from prometheus_client import CollectorRegistry, start_http_server

        self.project, self.experiment, self.linger_s = project, experiment, linger_s
        self._series = _Series()
        self._lock = threading.Lock()
        self._snapshot: dict[str, float] = {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise OSError(f"trainer.prometheus: cannot serve on {host}:{port} ({e}); pick another "
                          f"trainer.prometheus.port (0: a free one)") from e
        self.host, self.port = host, self._server.server_address[1]
        self.url = f"http://{host}:{self.port}/metrics"

    def update(self, metrics: dict[str, float]) -> None:
        snapshot = dict(self._snapshot)
        snapshot.update(metrics)  # keys a later row lacks (validation-only ones) keep their last value
        with self._lock:
            self._snapshot = snapshot

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            snapshot = self._snapshot
        for key, value in snapshot.items():
            series = self._series.get(key)
            if series is None:
                continue
            name, role = series
            labels = ["project", "experiment"] + (["role"] if role else [])
            g = GaugeMetricFamily(name, f"HybridFlow step metric {key}", labels=labels)
            g.add_metric([self.project, self.experiment] + ([role] if role else []), value)
            yield g

    def close(self) -> None:
        _linger(self.linger_s)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


class RayExporter:
    """ray.util.metrics gauges, one per step key, recorded into the driver node's Ray metrics agent."""

    def __init__(self, project: str, experiment: str, linger_s: float = 0.0):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("trainer.prometheus.mode=ray needs the driver connected to Ray")
        self.project, self.experiment, self.linger_s = project, experiment, linger_s
        self._series = _Series()
        self._gauges: dict[str, object] = {}
        self.url = None

    def update(self, metrics: dict[str, float]) -> None:
        from ray.util.metrics import Gauge

        for key, value in metrics.items():
            series = self._series.get(key)
            if series is None:
                continue
            name, role = series
            tags = {"project": self.project, "experiment": self.experiment, **({"role": role} if role else {})}
            if name not in self._gauges:
                self._gauges[name] = Gauge(name, description=f"HybridFlow step metric {key}", tag_keys=tuple(tags))
            self._gauges[name].set(value, tags=tags)

    def close(self) -> None:
        _linger(self.linger_s)  # Ray's agent drops the driver's series some time after it disconnects


def _linger(seconds: float) -> None:
    """Keep the last step's values up this long after the run: a run that ends right after its last step
    would otherwise end before the next scrape (Prometheus scrapes every 5-60 s) and that step is never seen."""
    if seconds > 0:
        log.info("prometheus: serving the last step for %.0f s more (trainer.prometheus.linger_s)", seconds)
        time.sleep(seconds)


def make_exporter(project: str, experiment: str, mode: str = "auto", host: str = "127.0.0.1", port: int = 0,
                  joined_cluster: bool = False, linger_s: float = 0.0):
    """The exporter trainer.prometheus asks for; http prints its URL at start."""
    resolved = resolve_mode(mode, joined_cluster)
    if resolved == "ray":
        exporter = RayExporter(project, experiment, linger_s)
        log.info("prometheus: step gauges go to Ray's metrics export (names prefixed ray_hybridflow_)")
        return exporter
    exporter = HttpExporter(project, experiment, host, port, linger_s)
    print(f"prometheus metrics: {exporter.url}", file=sys.stderr, flush=True)
    return exporter
