"""The GPU speed benchmark (bench/gpu.py) end to end on the CPU: `--quick --device cpu` builds the tiny
random-weight shape, measures every section (B=1 decoding, batched steps, verify, transformers, the
Verify service over loopback) and writes its JSON and markdown with no failed section."""

from __future__ import annotations

import json
import subprocess
import sys

from client.cluster import ROOT


def test_the_quick_gpu_bench_runs_every_section_on_the_cpu(tmp_path):
    run = subprocess.run([sys.executable, "bench/gpu.py", "--quick", "--device", "cpu", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    tiny = json.loads((tmp_path / "gpu-cpu.json").read_text())["shapes"]["tiny"]
    assert set(tiny) == {"model", "decode", "verify", "batch", "transformers", "services"}
    assert not [key for key, value in tiny.items() if "error" in value]
    assert tiny["decode"]["eager"]["library_tokens_per_s"] > 0
    assert [row["tokens"] for row in tiny["verify"]["eager"]["rows"]] == [5, 9, 17]
    assert [row["batch_size"] for row in tiny["batch"]["eager"]["rows"]] == [1, 4, 8]
    assert all(row["same_tokens"] for row in tiny["services"]["rows"])
    assert "| Generate |" in (tmp_path / "gpu-cpu.md").read_text()
