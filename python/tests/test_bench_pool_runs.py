"""bench/pool_runs.py, which bench/validate_sim.sh uses to pool two runs of one configuration.

Run: /usr/bin/python3 -m pytest python/tests/test_bench_pool_runs.py
"""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "pool_runs.py"
spec = importlib.util.spec_from_file_location("pool_runs", SCRIPT)
pool_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pool_runs)


def report(fwd_ser, fwd_int, bwd_ser=None, bwd_int=None):
    def summary(samples):
        return {"median_s": sorted(samples)[len(samples) // 2], "min_s": min(samples), "max_s": max(samples),
                "samples_s": samples}
    r = {"layer": {"hidden": 8}, "serialized": {"dispatch_to_combine": summary(fwd_ser)},
         "interleaved": {"dispatch_to_combine": summary(fwd_int), "schedule": "static"}}
    if bwd_ser is not None:
        r["serialized"]["backward"] = summary(bwd_ser)
        r["interleaved"]["backward"] = summary(bwd_int)
    return r


def test_slow_share_is_the_largest_over_the_summaries():
    r = report([1.0, 1.1, 1.0], [1.0, 1.0, 1.0], [2.0, 4.0, 2.6, 2.2], [2.0, 2.1, 2.0])
    assert pool_runs.slow_share(r, 1.25) == pytest.approx(0.5)  # 4.0 and 2.6 over 1.25 x 2.0
    assert pool_runs.slow_share(r, 2.5) == 0


def test_pooling_joins_samples_and_recomputes_the_median():
    slow_run = report([1.0, 2.0, 2.1], [1.0, 1.9, 2.0], [3.0, 3.1, 6.0], [3.0, 3.0, 3.2])
    more = report([1.0, 1.05, 0.98, 1.01, 1.02, 2.2], [1.0, 1.01, 0.99, 1.0, 1.03, 1.02],
                  [3.0, 3.05, 2.98, 3.01, 3.0, 3.1], [3.0, 3.0, 3.1, 3.0, 2.9, 3.0])
    pooled = pool_runs.pool([slow_run, more])
    fwd = pooled["serialized"]["dispatch_to_combine"]
    assert fwd["samples_s"] == [1.0, 2.0, 2.1, 1.0, 1.05, 0.98, 1.01, 1.02, 2.2]
    assert fwd["median_s"] == pytest.approx(1.02)  # two slow steps of three no longer make the median
    assert (fwd["min_s"], fwd["max_s"]) == (0.98, 2.2)
    assert pooled["interleaved"]["backward"]["median_s"] == pytest.approx(3.0)
    assert pooled["interleaved"]["schedule"] == "static"  # the rest of the first report is kept
    assert slow_run["serialized"]["dispatch_to_combine"]["median_s"] == 2.0  # the inputs are not changed


def test_a_forward_only_report_pools_its_forward():
    pooled = pool_runs.pool([report([1.0, 3.0], [2.0]), report([1.0], [2.0, 2.0])])
    assert pooled["serialized"]["dispatch_to_combine"]["samples_s"] == [1.0, 3.0, 1.0]
    assert "backward" not in pooled["serialized"]


def test_command_line_pools_in_place_and_refuses_reports_without_samples(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report([1.0, 5.0, 5.0], [1.0, 1.0, 1.0])))
    b.write_text(json.dumps(report([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])))
    run = lambda *args: subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert float(run("slow", str(a), "1.25").stdout) == pytest.approx(2 / 3, abs=1e-4)
    assert run("pool", str(a), str(a), str(b)).returncode == 0
    assert json.loads(a.read_text())["serialized"]["dispatch_to_combine"]["median_s"] == 1.0
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"serialized": {"dispatch_to_combine": {"median_s": 1.0}}}))
    bad = run("slow", str(old), "1.25")
    assert bad.returncode != 0 and "no samples_s" in bad.stderr and "Traceback" not in bad.stderr
    assert run("mystery").returncode != 0
