"""Cross-pool weight sync over real separate processes, without Ray (hybridflow/resharding/cross_pool.py).

Transport (pure torch, synthetic shards): tests/reshard_scripts/cross_pool_transport.py. End to end (a Megatron
training pool, a vLLM rollout pool, the sync group between them): tests/reshard_scripts/check_cross_pool.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from hybridflow.ports import free_port, free_ports

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests/reshard_scripts"


# Which launch server a process forks from (tests/rank_launch.py, PRELOADS): each pool preloads only its own side.
PRELOAD_OF_ROLE = {"train": "megatron", "rollout": "vllm"}


def run_all(cmds: list[list[str]], timeout: float, grace: float = 15) -> list[tuple[int, str]]:
    """Start every process at once (the pools rendezvous with each other); (returncode, output) of each.

    A process that fails leaves its peers waiting on it: they get `grace` seconds to fail on their own (their
    errors name what they waited for), then are killed, so a failure costs seconds rather than the whole timeout
    and every process's output is returned (the first to fail is usually the one that tells why).

    The processes are forks of the tests' launch servers (tests/rank_launch.py), each from one that preloaded only
    what its role imports: the training pool megatron (never vLLM), the rollout pool vLLM (never megatron), the
    transport check torch; so the import checks below still see each pool's own imports."""
    from rank_launch import Proc, run_group

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [Proc(c[1:], env, preload=PRELOAD_OF_ROLE.get(c[2], "torch")) for c in cmds]
    return [(r.returncode, r.stdout + r.stderr) for r in run_group(procs, ROOT, timeout, grace)]


def failures(cmds: list[list[str]], results: list[tuple[int, str]]) -> str:
    """Each failed process: its role and rank, return code (-9: killed after a peer failed or at the timeout) and
    output tail."""
    return "\n\n".join(f"{' '.join(c[2:4])} rc={rc}:\n{out[-3000:]}"
                        for c, (rc, out) in zip(cmds, results) if rc != 0)


def transport(mode: str, tmp_path: Path, T: int, P: int, t_g: int, R: int, timeout: float = 180) -> dict[int, dict]:
    port = free_port()
    cmds = [[sys.executable, str(SCRIPTS / "cross_pool_transport.py"), mode, str(s), str(port), str(tmp_path),
             str(T), str(P), str(t_g), str(R)] for s in range(T + R)]
    results = run_all(cmds, timeout)
    assert all(rc == 0 for rc, _ in results), failures(cmds, results)
    return {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in range(T + R)}


def test_transport_delivers_exact_shards_and_a_send_overlapped_by_an_update(tmp_path):
    """t=1, p=2 -> t_g=2 (2 + 2 processes): every rollout rank gets exactly its rows of every parameter; the
    second send is send(wait=False) followed at once by an in-place update, and the rollout still gets the
    weights of the moment of the send."""
    out = transport("check", tmp_path, T=2, P=2, t_g=2, R=2)
    for r in (2, 3):
        for sync in ("sync1", "sync2"):
            assert out[r][sync]["mismatched"] == [], (r, sync)
            assert out[r][sync]["bytes"] == out[r][sync]["expected_bytes"] > 0
    for s in (0, 1):
        assert out[s]["sync1"]["bytes"] == out[s]["sync1"]["expected_bytes"] > 0  # each stage sends its own
        assert 0 < out[s]["sync2"]["snapshot_bytes"]


@pytest.mark.serial  # a wall-time bound that a second test on the two cores could break
def test_a_missing_sender_fails_within_the_timeout_naming_the_message(tmp_path):
    start = time.monotonic()
    out = transport("timeout", tmp_path, T=1, P=1, t_g=1, R=1, timeout=60)
    err = out[1]["error"]
    assert err and "timed out" in err and "embedding.word_embeddings.weight" in err and "training rank 0" in err, err
    assert time.monotonic() - start < 45


LAYOUTS = {  # (T training ranks, P stages, t_g, R rollout ranks)
    "t2-to-tg1x2": (2, 1, 1, 2),  # 2 training + 2 independent t_g=1 replicas (4 processes)
    "t1-to-tg2": (1, 1, 2, 2),  # 1 training + one t_g=2 replica (3 processes)
    "t2p2-to-tg2": (4, 2, 2, 2),  # 4 training (t=2, p=2) + one t_g=2 replica (6 processes; ~110 s on 2 cores)
}


def max_diff(a, b) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_rollout_pool_matches_trainer_after_every_sync(tmp_path, layout):
    from hybridflow.models.tiny import save_tiny_model

    T, P, t_g, R = LAYOUTS[layout]
    w0 = save_tiny_model(tmp_path / "w0", seed=0)
    w1 = save_tiny_model(tmp_path / "w1", seed=1)
    ports = free_ports(3)
    common = [str(tmp_path), str(w0), str(w1), *map(str, (T, P, t_g, R, *ports))]
    script = str(SCRIPTS / "check_cross_pool.py")
    cmds = ([[sys.executable, script, "train", str(i), *common] for i in range(T)]
            + [[sys.executable, script, "rollout", str(r), *common] for r in range(R)])
    start = time.monotonic()
    results = run_all(cmds, timeout=600)
    assert all(rc == 0 for rc, _ in results), failures(cmds, results)
    wall = time.monotonic() - start
    train = [json.loads((tmp_path / f"train{i}.json").read_text()) for i in range(T)]
    roll = [json.loads((tmp_path / f"rollout{r}.json").read_text()) for r in range(R)]
    ref = train[0]
    bw = ref["bandwidth_Bps"]

    # separate processes: the trainer never imported vLLM, the rollout never imported megatron
    assert not any(t["vllm_imported"] for t in train) and not any(o["megatron_imported"] for o in roll)
    for t in train:
        assert t["sync1"]["bytes"] == t["sync2"]["bytes"] == t["send_bytes"]
    for o in roll:
        # bytes received = planned = this rank's vLLM shard
        assert o["sync1"]["bytes"] == o["sync2"]["bytes"] == o["planned_bytes"] == o["shard_bytes"], o["rank"]
        # the weights moved: vLLM started from other weights, then equals the trainer's log-probs (fp32)
        assert max_diff(o["lp_before"], ref["lp1"]) > 1e-2
        assert max_diff(o["lp_after1"], ref["lp1"]) < 1e-5
        # second sync after an update: before it the rollout is stale (a sync that did nothing fails here) ...
        assert max_diff(o["lp_after1"], ref["lp2"]) > 1e-3
        assert max_diff(o["lp_after2"], ref["lp2"]) < 1e-5
        # ... and the update that overlapped the send did not leak into it (the snapshot)
        assert max_diff(o["lp_after2"], ref["lp3"]) > 1e-3
    for q in range(R // t_g):
        ranks = roll[q * t_g:(q + 1) * t_g]
        # a replica receives the model M once; replicated parameters (norms) go to each of its t_g ranks
        once = ranks[0]["model_bytes"] + (t_g - 1) * ranks[0]["replicated_bytes"]
        assert sum(o["shard_bytes"] for o in ranks) == once
        if t_g == 1:
            assert ranks[0]["shard_bytes"] == ranks[0]["model_bytes"]
    summary = {"layout": layout, "processes": T + R, "wall_s": round(wall, 1), "bandwidth_GiBps": round(bw / 2**30, 2),
               "per_rollout_rank": [{"bytes": o["shard_bytes"], "sync_s": [round(o["sync1"]["seconds"], 4),
                                                                          round(o["sync2"]["seconds"], 4)],
                                     "recv_wait_s": round(o["sync2"]["wait_s"], 4),
                                     "bound_s": round(o["shard_bytes"] / bw, 6)} for o in roll]}
    print(json.dumps(summary))
