"""Safe defaults: weights-only checkpoint loads, Ray on loopback only, a sandboxed user reward function.

(No credentials in a run's files: tests/test_fault.py greps every file of its restart run.)
"""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
OUR_CODE = ("hybridflow", "megatron_workers", "launch")


def test_every_torch_load_in_our_code_is_weights_only():
    calls = []
    for pkg in OUR_CODE:
        for file in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                    ok = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                             for k in node.keywords)
                    calls.append((f"{file.relative_to(REPO)}:{node.lineno}", ok))
    assert calls, "the checkpoint loader's weights-only pre-check (megatron_workers/dist_ckpt.py) is gone"
    assert all(ok for _, ok in calls), [c for c, ok in calls if not ok]


class _Payload:
    """Unpickling this runs code: it creates a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
def test_a_planted_pickle_payload_in_a_checkpoint_is_refused(tmp_path):
    import pickle

    import torch

    from megatron_workers.dist_ckpt import load_checkpoint

    ckpt, marker = tmp_path / "global_step_1" / "actor", tmp_path / "pwned"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist", "common_backend": "torch"}')
    torch.save({"common": {"extra": _Payload(str(marker))}}, ckpt / "common.pt")
    with pytest.raises(pickle.UnpicklingError, match="common.pt: refused, not a weights-only file"):
        load_checkpoint(ckpt, model=[None])
    assert not marker.exists()
    # Even with torch's escape hatch set, the pre-check stays weights-only.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with pytest.raises(pickle.UnpicklingError):
            load_checkpoint(ckpt, model=[None])
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
    assert not marker.exists()


def _ray_listeners() -> tuple[list, list]:
    """(listening sockets (process name, ip, port), cmdlines) of the Ray processes this test process started."""
    procs = [p for p in psutil.Process().children(recursive=True) if any("ray" in a for a in _cmdline(p))]
    listening = []
    for p in procs:
        try:
            listening += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return listening, [" ".join(_cmdline(p)) for p in procs]


def _is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # the gRPC servers report 127.0.0.1 as ::ffff:127.0.0.1
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


def _exposed(listening: list) -> list:
    return [s for s in listening if not _is_loopback(s[1])]


def _gcs_call(host: str, port: int):
    import grpc

    return grpc.insecure_channel(f"{host}:{port}").unary_unary(
        "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", request_serializer=lambda _: b"",
        response_deserializer=lambda b: b)


def test_local_ray_has_no_dashboard_and_refuses_callers_without_its_token(ray_cluster):
    """The shared test cluster is started by hybridflow.controller.init_ray, as the trainer starts its own."""
    import grpc

    listening, cmdlines = _ray_listeners()
    assert any("gcs_server" in c for c in cmdlines), cmdlines
    assert not [c for c in cmdlines if "dashboard/dashboard.py" in c and "--host=127.0.0.1" not in c]
    assert not [s for s in listening if s[2] == 8265], "the dashboard UI is up"
    assert os.environ.get("RAY_AUTH_MODE") == "token"
    # A local caller without the cluster's token gets UNAUTHENTICATED, not an answer.
    gcs = next(port for name, _, port in listening if name == "gcs_server")
    with pytest.raises(grpc.RpcError) as refused:
        _gcs_call("127.0.0.1", gcs)(None, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    print(f"\n{len(listening)} listening sockets of the Ray processes; the GCS at 127.0.0.1:{gcs} refused a call "
          "without the token")


def test_local_ray_listens_on_loopback_only(ray_cluster):
    """Every socket of the local cluster (GCS, raylet, core workers, agents, metrics exporters) is on loopback,
    and the GCS port cannot be reached on the machine's own address."""
    import socket

    import grpc

    listening, _ = _ray_listeners()
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names, names
    assert not _exposed(listening), f"Ray sockets not on loopback: {_exposed(listening)}"
    ips = [a.address for name, addrs in psutil.net_if_addrs().items() if name != "lo" for a in addrs
           if a.family == socket.AF_INET]
    gcs = next(port for name, _, port in listening if name == "gcs_server")
    for ip in ips:
        with pytest.raises(grpc.RpcError) as unreachable:
            _gcs_call(ip, gcs)(None, timeout=10)
        assert unreachable.value.code() == grpc.StatusCode.UNAVAILABLE, (ip, unreachable.value)
    print(f"\n{len(listening)} listening sockets, all on loopback; GCS port {gcs} unreachable on {ips}")


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


# ---------------------------------------------------------------- sandboxed user reward

REWARDS = {
    "good": "import os\nopen(os.environ['MARK'], 'w').write(str(os.getpid()))\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    return float(solution_str == ground_truth)\n",
    "hangs": "import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
             "    time.sleep(60)\n    return 1.0\n",
    "hog": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
           "    block = bytearray(2 * 1024**3)\n    return float(len(block) > 0)\n",
    "nan": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
           "    return float('nan') if solution_str == 'b' else 1.0\n",
}


def _manager(tmp_path, kind: str, **over):
    from hybridflow.config.schema import CustomRewardConfig
    from hybridflow.rewards.manager import RewardManager

    file = tmp_path / f"{kind}.py"
    file.write_text(REWARDS[kind])
    cfg = CustomRewardConfig(path=str(file), sandbox=True, sandbox_timeout_s=over.get("timeout", 10.0),
                             memory_mb=over.get("memory_mb", 512))
    return RewardManager.from_config(cfg)


def _score(manager, responses=("a", "b", "c")):
    return manager.score(list(responses), ["a", "x", "c"], ["src"] * len(responses), [None] * len(responses))


@pytest.mark.fault
def test_sandboxed_reward_scores_in_a_child_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MARK", str(tmp_path / "pid"))
    scores, metrics = _score(_manager(tmp_path, "good"))
    assert scores.tolist() == [1.0, 0.0, 1.0]
    assert metrics["reward/sandbox_failures"] == 0 and metrics["reward/num_errors"] == 0
    assert int((tmp_path / "pid").read_text()) != os.getpid()  # the user's file ran elsewhere, not here


@pytest.mark.fault
def test_sandboxed_reward_over_its_time_or_memory_scores_zero_and_is_counted(tmp_path):
    t = time.perf_counter()
    scores, metrics = _score(_manager(tmp_path, "hangs", timeout=2.0))
    took = time.perf_counter() - t
    assert scores.tolist() == [0.0, 0.0, 0.0] and metrics["reward/sandbox_failures"] == 1
    assert metrics["reward/num_timeouts"] == 3 and took < 15, took
    # 2 GiB in a child capped at 512 MiB of address space: MemoryError there, this process untouched.
    before = psutil.Process().memory_info().rss
    scores, metrics = _score(_manager(tmp_path, "hog", memory_mb=512))
    assert scores.tolist() == [0.0, 0.0, 0.0] and metrics["reward/num_errors"] == 3
    assert psutil.Process().memory_info().rss - before < 256 * 1024**2
    scores, metrics = _score(_manager(tmp_path, "nan"))
    assert scores.tolist() == [1.0, 0.0, 1.0] and metrics["reward/num_errors"] == 1
    print(f"\nsandbox: a hanging batch was cut at {took:.1f} s (limit 2 s)")


@pytest.mark.bad_input
def test_sandboxed_reward_file_that_does_not_import_fails_before_any_worker(tmp_path):
    from hybridflow.config.schema import CustomRewardConfig
    from hybridflow.rewards.manager import RewardManager

    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match="broken.py.*sandboxed.*not_a_module_anywhere"):
        RewardManager.from_config(CustomRewardConfig(path=str(bad), sandbox=True))
