"""The prometheus logger: gauge names and labels (pure), the loopback endpoint, and a real 2-step tiny PPO run
scraped over HTTP while it runs, against the rows its metrics.jsonl records; the Grafana dashboard's queries
against what that run exported."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from pathlib import Path

import pytest

from hybridflow.trainer.prometheus import HttpExporter, resolve_mode, role_of, sanitize_name, series_of

REPO = Path(__file__).resolve().parents[1]
NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")  # Prometheus' name grammar without the reserved colon


# ---------------------------------------------------------------------------------------------- pure rules

@pytest.mark.parametrize("key,name", [
    ("critic/score/mean", "hybridflow_critic_score_mean"),
    ("timing_s/update_actor", "hybridflow_timing_s_update_actor"),
    ("perf/mfu/actor", "hybridflow_perf_mfu_actor"),
    ("val-core/synthetic/reward/mean@1", "hybridflow_val_core_synthetic_reward_mean_at_1"),
    ("response_length/clip_ratio", "hybridflow_response_length_clip_ratio"),
    ("a//b..c", "hybridflow_a_b_c"),
    ("/x/", "hybridflow_x"),
    ("1st/µ", "hybridflow_1st"),  # the prefix keeps a leading digit legal; non-ASCII goes
])
def test_names_follow_the_prometheus_grammar(key, name):
    assert sanitize_name(key) == name
    assert NAME_RE.match(name)


def test_an_empty_key_has_no_name():
    with pytest.raises(ValueError, match="empty"):
        sanitize_name("")


@pytest.mark.parametrize("key,role", [
    ("actor/pg_loss", "actor"), ("actor/perf/peak_rss_gb", "actor"), ("actor/entropy_rollout", "actor"),
    ("critic/vf_loss", "critic"), ("critic/perf/update_s_per_micro_batch", "critic"),
    ("rollout/gen_s_per_replica", "rollout"),
    # verl files these under actor/ and critic/, but the driver computes them from the batch
    ("critic/score/mean", None), ("critic/rewards/mean", None), ("critic/advantages/max", None),
    ("critic/values/mean", None), ("critic/vf_explained_var", None), ("critic/rm_score/mean", None),
    ("actor/kl_coef", None), ("actor/reward_kl_penalty", None), ("actor/reward_kl_penalty_coeff", None),
    ("rollout/logprob_diff_mean", None), ("rollout/prob_diff_mean", None),
    ("timing_s/update_actor", None), ("perf/throughput", None), ("actor", None), ("actors/x", None),
])
def test_role_label_rule(key, role):
    assert role_of(key) == role
    assert series_of(key) == (sanitize_name(key), role)


def test_mode_rule():
    assert resolve_mode("auto", joined_cluster=False) == "http"
    assert resolve_mode("auto", joined_cluster=True) == "ray"
    assert resolve_mode("http", joined_cluster=True) == "http"
    assert resolve_mode("ray", joined_cluster=False) == "ray"
    with pytest.raises(ValueError, match="trainer.prometheus.mode"):
        resolve_mode("pushgateway", False)


@pytest.mark.bad_input
@pytest.mark.parametrize("override,match", [("trainer.prometheus.mode=push", "trainer.prometheus.mode"),
                                            ("trainer.prometheus.port=70000", "trainer.prometheus.port"),
                                            ("trainer.prometheus.port=-1", "trainer.prometheus.port"),
                                            ("trainer.prometheus.linger_s=-5", "trainer.prometheus.linger_s")])
def test_bad_prometheus_keys_are_named_before_ray(override, match):
    from hybridflow.config import checks
    from hybridflow.config.load import load_config

    cfg = load_config(None, [override])
    with pytest.raises(ValueError, match=match):
        checks.trainer_keys(cfg.trainer)


# ---------------------------------------------------------------------------------------------- the endpoint

def _scrape(url: str, timeout: float = 5.0) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return {f.name: [(dict(s.labels), s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_endpoint_serves_the_newest_row_on_loopback_only():
    e = HttpExporter("proj", "exp", port=0)
    try:
        assert e.url.startswith("http://127.0.0.1:") and e._server.server_address[0] == "127.0.0.1"
        e.update({"critic/score/mean": 0.1 + 0.2, "actor/pg_loss": -1.25e-17, "timing_s/gen": 3.0})
        e.update({"timing_s/gen": 2.5, "critic/score_mean": 7.0})  # a name collision: the first key keeps it
        got = _scrape(e.url)
        assert got["hybridflow_critic_score_mean"] == [({"project": "proj", "experiment": "exp"}, 0.1 + 0.2)]
        assert got["hybridflow_actor_pg_loss"] == [({"project": "proj", "experiment": "exp", "role": "actor"},
                                                    -1.25e-17)]
        assert got["hybridflow_timing_s_gen"][0][1] == 2.5
    finally:
        e.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(e.url, timeout=2)


def test_tracking_writes_the_jsonl_row_and_serves_it(tmp_path, capsys):
    from hybridflow.trainer.tracking import Tracking, read_jsonl

    tr = Tracking(["jsonl", "prometheus"], tmp_path, "p", "e", prometheus={"mode": "auto", "port": 0})
    assert f"prometheus metrics: {tr._prom.url}" in capsys.readouterr().err  # auto, no cluster joined: http
    tr.log({"critic/score/mean": 1 / 3, "perf/throughput": 12.5, "bad": float("nan")}, step=1)
    got = _scrape(tr._prom.url)
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert got["hybridflow_critic_score_mean"][0][1] == row["critic/score/mean"] == 1 / 3
    assert got["hybridflow_perf_throughput"][0][1] == 12.5
    assert "hybridflow_bad" not in got  # non-finite values are dropped, as for every backend
    tr.finish()
    with pytest.raises(OSError):
        urllib.request.urlopen(tr._prom.url, timeout=2)


def test_a_busy_port_names_the_key():
    e = HttpExporter("p", "e", port=0)
    try:
        with pytest.raises(OSError, match="trainer.prometheus.port"):
            HttpExporter("p", "e", port=e.port)
    finally:
        e.close()


# ---------------------------------------------------------------------------------------------- a real run

@pytest.fixture(scope="module")
def scraped_run(observed_run):
    """The shared 2-step tiny PPO run (tests/observed_run.py: TP=2 actor/ref/vLLM, colocated critic) with the
    prometheus logger on a free loopback port, scraped every 0.1 s while it ran: (scrapes, jsonl rows, console)."""
    return observed_run["scrapes"], observed_run["rows"], observed_run["console"]


@pytest.mark.slow
def test_a_running_job_serves_each_step_as_metrics_jsonl_records_it(scraped_run):
    scrapes, rows, log_text = scraped_run
    assert "prometheus metrics: http://127.0.0.1:" in log_text  # the URL is printed, on loopback
    assert scrapes, "no scrape saw a step while the run was running"
    by_step = {r["step"]: r for r in rows}
    assert sorted(by_step) == [1, 2]
    seen_steps = set()
    for got in scrapes:
        step = int(got["hybridflow_training_global_step"][0][1])
        seen_steps.add(step)
        row = by_step[step]
        # Every scalar of the step, and each with the value metrics.jsonl has for that step (one snapshot).
        for key, value in row.items():
            if key == "step":
                continue
            name, role = series_of(key)
            assert name in got, f"{key} ({name}) missing from the scrape of step {step}"
            (labels, scraped), = got[name]
            want = {"project": "promtest", "experiment": "tiny2", **({"role": role} if role else {})}
            assert labels == want, (key, labels)
            # the step-1 critic update is an injected NaN (observed_run.py): NaN is exported as NaN
            assert scraped == value or (math.isnan(scraped) and math.isnan(value)), (key, scraped, value)
    assert 1 in seen_steps or 2 in seen_steps
    for stage in ("gen", "reshard", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
                  "update_actor"):
        assert f"timing_s/{stage}" in rows[-1], stage
    assert "critic/score/mean" in rows[-1] and "critic/rewards/mean" in rows[-1]


@pytest.mark.slow
def test_workers_report_their_memory_and_micro_batch_time(scraped_run):
    _, rows, _ = scraped_run
    for row in rows:
        for role, stage in (("actor", "update_actor"), ("critic", "update_critic")):
            # a real megatron worker process (torch + megatron-core + the model) holds far more than 100 MB
            assert 0.1 < row[f"{role}/perf/peak_rss_gb"] < 24, row[f"{role}/perf/peak_rss_gb"]
            per_micro = row[f"{role}/perf/update_s_per_micro_batch"]
            # 16 rows per mini-batch on 1 DP rank, micro-batch 64: one micro-batch per update, two updates a step;
            # the driver's stage timer encloses both plus the Ray round trip.
            assert 0 < 2 * per_micro < row[f"timing_s/{stage}"], (role, per_micro, row[f"timing_s/{stage}"])


@pytest.mark.slow
def test_every_grafana_query_names_a_metric_the_run_exports(scraped_run):
    from launch.grafana.make_dashboard import CONDITIONAL, OUT, render

    scrapes, _, _ = scraped_run
    exported = set().union(*(set(s) for s in scrapes))
    text = OUT.read_text()
    assert text == render(), "launch/grafana/hybridflow.json is stale: run python -m launch.grafana.make_dashboard"
    dash = json.loads(text)
    assert dash["schemaVersion"] >= 36
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dash["templating"]["list"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    optional = {sanitize_name(k) for k in CONDITIONAL}
    queried = set()
    for expr in exprs:
        names = re.findall(r"\$\{prefix\}([a-zA-Z_][a-zA-Z0-9_]*)", expr)
        assert names, f"a query without a ${{prefix}}<gauge>: {expr}"
        queried.update(names)
    missing = queried - exported - optional
    assert not missing, f"the dashboard queries gauges the run did not export: {sorted(missing)}"
    assert len(queried & exported) >= 20
    # the panels are there
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for word in ("reward", "kl", "stage", "throughput", "transition", "memory"):
        assert word in titles, word


# ---------------------------------------------------------------------------------------------- mode=ray

def test_ray_mode_reaches_rays_own_prometheus_export(ray_cluster):
    """The driver's step gauges and a worker process's own gauges come out of the node's Ray metrics export
    (the port Ray advertises for Prometheus), with Ray's `ray_` prefix and our labels."""
    import ray

    from hybridflow.trainer.prometheus import make_exporter

    @ray.remote(num_cpus=0)
    class FakeRank:  # a real worker process exporting as megatron_workers do (the role-method helper)
        def export(self):
            from megatron_workers.perf import export_to_ray

            export_to_ray({"peak_rss_gb": 1.5}, "critic", 1)

    exporter = make_exporter("rayproj", "rayexp", mode="ray")
    exporter.update({"critic/score/mean": 0.375, "actor/pg_loss": -0.5})
    rank = FakeRank.remote()
    ray.get(rank.export.remote(), timeout=60)
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    want = {"ray_hybridflow_critic_score_mean": ({"project": "rayproj", "experiment": "rayexp"}, 0.375),
            "ray_hybridflow_actor_pg_loss": ({"project": "rayproj", "experiment": "rayexp", "role": "actor"}, -0.5),
            "ray_hybridflow_worker_peak_rss_gb": ({"role": "critic", "rank": "1"}, 1.5)}
    deadline, got = time.monotonic() + 90, {}
    # This cluster is shared (the pairs phase's trainer runs join it and their ranks export the same gauge names),
    # so wait for these labels' samples, not for the names.
    matching = lambda name, labels: [v for lab, v in got.get(name, [])
                                     if all(lab.get(k) == x for k, x in labels.items())]
    try:
        while time.monotonic() < deadline:  # the agent publishes every few seconds
            try:
                got = _scrape(f"http://127.0.0.1:{port}/metrics", timeout=5)
            except OSError:
                got = {}
            if all(matching(name, labels) for name, (labels, _) in want.items()):
                break
            time.sleep(1)
        for name, (labels, value) in want.items():
            assert name in got, f"{name} not in Ray's export after 90 s"
            assert matching(name, labels) == [value], (name, got[name])
    finally:
        ray.kill(rank)
        exporter.close()
