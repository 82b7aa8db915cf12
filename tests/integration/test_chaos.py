"""The short chaos run (bench/chaos.py) on a tiny model: a launcher cluster with 2 Verify replicas and
a Draft under a steady mixed load while model processes are killed; no request is lost, every greedy
output is exact, every killed process comes back."""

from __future__ import annotations

import json
import subprocess
import sys

from client.cluster import ROOT


def test_a_short_chaos_run_loses_nothing(tiny_model_dir, tmp_path):
    target = str(tiny_model_dir("llama", init_std=0.2))
    run = subprocess.run([sys.executable, "bench/chaos.py", "--model", target, "--dtype", "float64", "--draft-dtype", "float64",
                          "--duration-s", "20", "--kill-every-s", "2", "--clients", "2", "--num-prompts", "2",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode in (0, 1), run.stdout + run.stderr
    result = json.loads((tmp_path / "chaos.json").read_text())
    assert result["num_kills"] >= 1 and result["num_restarts"] >= result["num_kills"], result
    assert result["num_completed"] > 0
    assert (result["num_lost"], result["num_not_exact"], result["num_not_back"]) == (0, 0, 0), result
    assert result["greedy modes equal to autoregressive before chaos"], result
