"""16 concurrent clients through the cluster with the Draft service drafting ahead, against autoregressive
decoding through the same cluster (issue 29: speculative with draft-ahead >= autoregressive aggregate tok/s).

The placement of bench/draft_ahead.py and the shipped config: a bf16 self-draft Draft service drafting ahead
pinned to core 0, the fp32 Verify service pinned to core 1, one thread each, and a Coordinator. Each client
asks the prompts of bench/cluster.py one after the other (`cluster.concurrent`: greedy, 32 new tokens each,
the same work in every mode). Modes, through the one Coordinator:
- speculative, Draft service drafting ahead: `--mode speculative --drafter service`, adaptive k (the measured
  costs decide whether a round drafts, and how far ahead);
- speculative, n-gram drafts: `--drafter ngram` (made in the Coordinator: this Verify service hosts none);
- autoregressive;
- the shipped placement (configs/local.yaml: the two services lending each other their cores, no drafting
  ahead), through a Coordinator of its own: speculative with the Draft service, adaptive k, and autoregressive.
The modes take turns (the order reversed every other round), REPEATS rounds; medians, and per round the
speculative / autoregressive ratio (runs of one round are close in time). Every request's tokens must equal
the autoregressive run's for the same client and prompt.

    .venv/bin/python bench/draft_ahead_clients.py [--clients 16] [--repeats 5]   # ~10 minutes
    -> bench/results/draft_ahead_clients.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster import AR, CONCURRENT_NEW_TOKENS, PROMPTS, SPEC, concurrent  # noqa: E402
from draft_ahead import config  # noqa: E402
from engine import cpu_model  # noqa: E402

from client.cluster import Cluster  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402

LENDING_BASE = "autoregressive, lending cores"
MODES = {  # name: (coordinator of draft_ahead.config, mode, drafter, the row it is paired with)
    "speculative, Draft service drafting ahead": ("ahead", SPEC, "service", "autoregressive"),
    "speculative, n-gram drafts": ("ahead", SPEC, "ngram", "autoregressive"),
    "autoregressive": ("ahead", AR, "", "autoregressive"),
    # configs/local.yaml's placement: each service lends its core to the other while it runs no job, no drafting ahead
    "speculative, lending cores, Draft service (shipped)": ("lend", SPEC, "service", LENDING_BASE),
    LENDING_BASE: ("lend", AR, "", LENDING_BASE),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folder = str(resolve_model_spec("default"))
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_text(yaml.safe_dump(config(folder)))
        with Cluster.from_yaml(path, log_dir=tmp) as cluster:
            addresses = cluster.addresses
            for where, mode, drafter, _ in MODES.values():  # warm-up: kernels, and the coordinators' measured costs
                asyncio.run(concurrent(addresses[where], 2, mode, drafter))
            for repeat in range(args.repeats):
                for name in (list(MODES) if repeat % 2 == 0 else list(MODES)[::-1]):
                    where, mode, drafter, _ = MODES[name]
                    runs[name].append(asyncio.run(concurrent(addresses[where], args.clients, mode, drafter, outputs=True)))
                print(f"round {repeat + 1}/{args.repeats}: " + ", ".join(
                    f"{name} {r[-1]['tokens_per_s']:.1f} tok/s" for name, r in runs.items()), flush=True)

    rows = []
    for name, name_runs in runs.items():
        base = MODES[name][3]
        exact = all(run["outputs"] == ref["outputs"] for run, ref in zip(name_runs, runs["autoregressive"]))
        paired = [run["tokens_per_s"] / ref["tokens_per_s"] for run, ref in zip(name_runs, runs[base])]
        rows.append({"mode": name, "base": base, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in name_runs),
                     "paired_ratios": paired, "exact": exact,
                     "drafted_per_round": statistics.median(r["drafted_per_round"] for r in name_runs),
                     "acceptance": statistics.median(r["acceptance"] for r in name_runs)})
    base_tps = {row["mode"]: row["tokens_per_s"] for row in rows}
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / base_tps[row["base"]]
    out = {"command": f".venv/bin/python bench/draft_ahead_clients.py --clients {args.clients} --repeats {args.repeats}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{cpu_model()}, {os.cpu_count()} cpus",
           "clients": args.clients, "repeats": args.repeats, "tokens": CONCURRENT_NEW_TOKENS, "load_average": os.getloadavg()[0],
           "rows": [{k: v for k, v in row.items()} for row in rows]}
    results = ROOT / "bench" / "results"
    (results / "draft_ahead_clients.json").write_text(json.dumps(out, indent=1) + "\n")
    text = render(out)
    (results / "draft_ahead_clients.md").write_text(text)
    print(text)
    return 0 if all(row["exact"] for row in rows) else 1


def render(out: dict) -> str:
    lines = [f"# {out['clients']} concurrent clients: drafting ahead against autoregressive, through the cluster", "",
             f"Run {out['date']} on {out['machine']}; load average at the end {out['load_average']:.1f}.", "",
             f"Command: `{out['command']}`", "",
             "Draft service (bf16 self-draft, drafting ahead) pinned to core 0, Verify service (fp32) to core 1, one "
             "thread each, one Coordinator; the lending rows: another such pair and Coordinator placed as "
             "configs/local.yaml ships it (each service also runs a job on the other's core while that one runs none; "
             f"no drafting ahead). Default model, greedy, {out['tokens']} new tokens a request, each client "
             f"asking the {len(PROMPTS)} prompts of bench/cluster.py in turn. The modes take turns, {out['repeats']} "
             "rounds; medians. Paired: the mode / its autoregressive row (the same placement) within each round "
             "(lowest, median, highest). Exact: every request's tokens equal the autoregressive run's of the same round.",
             "", "| mode | aggregate tok/s | / autoregressive (same placement) | paired (lowest / median / highest) | "
             "drafted per round | acceptance | exact |", "|---|---|---|---|---|---|---|"]
    for row in out["rows"]:
        paired = row["paired_ratios"]
        lines.append(f"| {row['mode']} | {row['tokens_per_s']:.1f} | {row['ratio']:.3f}x | {min(paired):.2f} / "
                     f"{statistics.median(paired):.2f} / {max(paired):.2f} | {row['drafted_per_round']:.2f} | "
                     f"{row['acceptance']:.2f} | {'yes' if row['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
