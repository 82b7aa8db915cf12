"""Simulator speed: virtual seconds simulated per wall second on a planning-sized cluster.

    .venv/bin/python bench/sim_speed.py [--config configs/sim/fleet.yaml] [--set workload.rate_per_s=8 ...]

Default: configs/sim/fleet.yaml, 600 virtual seconds (10 minutes) of 256 draft devices (phones and
laptops) and 16 H100 target servers at a load that keeps the targets about 60% busy. Goal: the whole
run in under a minute on this 2-core machine. Reports wall time, virtual s per wall s, requests and
speculation rounds simulated (and rounds per wall second), with the run's headline figures.
Writes bench/results/sim_speed.json and bench/results/sim_speed.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specmesh.sim.cli import _overrides  # noqa: E402
from specmesh.sim.cluster import Simulation  # noqa: E402
from specmesh.sim.config import config_from_dict  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "sim" / "fleet.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    data = yaml.safe_load(Path(args.config).read_text())
    config = config_from_dict(data, _overrides(args.set), str(Path(args.config).parent))
    sim = Simulation(config)
    start = time.perf_counter()
    result = sim.run()
    wall_s = time.perf_counter() - start
    s = result.summary
    num_rounds = sum(r.num_rounds for r in result.requests)
    report = {
        "config": str(Path(args.config).relative_to(ROOT) if Path(args.config).is_relative_to(ROOT) else args.config),
        "overrides": args.set,
        "num_drafts": s["num_drafts"], "num_targets": s["num_targets"], "virtual_s": config.duration_s,
        "wall_s": wall_s, "virtual_s_per_wall_s": config.duration_s / wall_s,
        "num_requests": len(result.requests), "num_rounds": num_rounds, "rounds_per_wall_s": num_rounds / wall_s,
        "throughput_tokens_per_s": s["throughput_tokens_per_s"], "goodput_tokens_per_s": s["goodput_tokens_per_s"],
        "target_utilisation_mean": s["target_utilisation_mean"], "draft_utilisation_mean": s["draft_utilisation_mean"],
        "batch_rows_mean": s["batch_rows_mean"], "ttft_p95_ms": s["ttft"]["p95_ms"], "tpot_p95_ms": s["tpot"]["p95_ms"],
        "e2e_p95_ms": s["e2e"]["p95_ms"], "python": platform.python_version(), "machine": platform.machine(),
        "goal": "600 virtual s of 256 drafts x 16 targets in < 60 wall s", "goal_met": wall_s < 60,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_speed.json").write_text(json.dumps(report, indent=1) + "\n")
    md = [
        "# Simulator speed", "",
        f"`{' '.join(['.venv/bin/python bench/sim_speed.py', *('--set ' + x for x in args.set)])}` ({report['config']})", "",
        "| drafts | targets | virtual s | wall s | virtual s / wall s | requests | rounds | rounds / wall s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {report['num_drafts']} | {report['num_targets']} | {config.duration_s:.0f} | {wall_s:.1f} | {report['virtual_s_per_wall_s']:.1f} "
        f"| {report['num_requests']} | {num_rounds} | {report['rounds_per_wall_s']:.0f} |", "",
        f"Simulated load: {s['throughput_tokens_per_s']:.0f} tok/s (goodput {s['goodput_tokens_per_s']:.0f}), targets "
        f"{s['target_utilisation_mean']:.0%} busy with {s['batch_rows_mean']:.1f} rows per batch, drafts {s['draft_utilisation_mean']:.0%} busy; "
        f"p95 TTFT {s['ttft']['p95_ms']:.0f} ms, TPOT {s['tpot']['p95_ms']:.1f} ms, end to end {s['e2e']['p95_ms']:.0f} ms.", "",
        f"Goal (whole run under a minute): {'met' if report['goal_met'] else 'NOT met'}.", "",
    ]
    (out / "sim_speed.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
