"""launch.benchmark.same_metrics: two runs' metrics compared step by step, the clocks left out."""

from __future__ import annotations

import json

import pytest

from launch.benchmark.same_metrics import compare, is_clock, main, read_rows


def _write(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"step": 1, "critic/score/mean": 0.25, "actor/pg_loss": -0.125, "timing_s/gen": 1.0,
         "perf/throughput": 50.0, "weight_sync/recv_s": 0.2},
        {"step": 2, "critic/score/mean": 0.5, "actor/pg_loss": 0.0625, "timing_s/gen": 2.0,
         "perf/throughput": 40.0, "weight_sync/recv_s": 0.3}]


def test_clock_keys_are_left_out_and_the_rest_must_be_bit_equal(tmp_path):
    later = [{**r, "timing_s/gen": r["timing_s/gen"] * 3, "perf/throughput": 1.0, "weight_sync/recv_s": 9.0}
             for r in ROWS]
    result = compare(read_rows(_write(tmp_path / "a", ROWS)), read_rows(_write(tmp_path / "b", later)))
    assert result["same"] and (result["steps"], result["compared"], result["equal"]) == (2, 4, 4)
    keys = ("timing_s/gen", "perf/mfu/actor", "actor/perf/peak_rss_gb", "rollout/gen_s_per_replica", "reward/time_s",
            "actor/kl_coef", "critic/score/mean", "reshard/bytes_recv_per_rank")
    assert [is_clock(k) for k in keys] == [True] * 5 + [False] * 3


def test_a_differing_metric_and_a_missing_key_are_named(tmp_path, capsys):
    changed = [dict(ROWS[0]), {**ROWS[1], "actor/pg_loss": 0.0625 + 1e-7}]
    del changed[0]["critic/score/mean"]
    a, b = _write(tmp_path / "a", ROWS), _write(tmp_path / "b", changed)
    result = compare(read_rows(a), read_rows(b))
    assert not result["same"] and result["equal"] == 2 and result["compared"] == 3
    assert result["max_abs_diff"]["step"] == 2 and result["max_abs_diff"]["key"] == "actor/pg_loss"
    assert result["max_abs_diff"]["abs_diff"] == pytest.approx(1e-7)
    assert result["only_before"] == ["critic/score/mean"] and result["only_after"] == []
    assert main([str(a), str(b)]) == 1
    assert main([str(a), str(a), "--markdown"]) == 0 and "| bit-equal | 4 of 4 |" in capsys.readouterr().out


def test_bad_input_names_the_file_and_line(tmp_path, capsys):
    run = _write(tmp_path / "a", ROWS)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    assert main([str(run), str(run)]) == 2
    assert f"{run / 'metrics.jsonl'}:3: not JSON" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), str(run)]) == 2
