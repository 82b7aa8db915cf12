"""Scaling study from the simulator: draft devices x target servers, batching saturation, routers.

    .venv/bin/python bench/sim_scaling.py [--config configs/sim/fleet.yaml] [--duration-s 40] [--jobs 2] [--quick]

The cluster is configs/sim/fleet.yaml's planning scenario: H100 target servers serving Llama-3.1-8B,
phones drafting with SmolLM2-135M over 20 ms links, both priced by the roofline model
(specmesh/sim/cost.py) with the simulator whose host and batching model bench/sim_validate.py checks
against the live CPU cluster. Prompts lognormal (median 300 tokens), answers lognormal (median 200),
k = 4, the fleet's acceptance. Three studies, each point one seeded run (`--duration-s` virtual
seconds, the first quarter burn-in):

1. drafts x targets: 1 -> 256 draft devices (a pool: the draft router picks one per session, and a
   device batches its sessions' Propose calls) x 1 -> 16 targets, closed loop with
   `--clients-per-target` clients per target (the load grows with the targets). Tokens/s, latency.
2. Batching saturation: one target, one phone per client (drafting never queues), 1 -> 1024
   closed-loop clients. Cross-session batching saturates where more sessions stop adding
   throughput: the knee is the first point whose doubling adds less than 25% more tokens/s.
3. Routers (`specmesh.routing` as-is): 8 H100 + 8 A100 targets, 256 phones, Poisson conversations
   (the fleet's multi-turn workload) at two rates; random, round robin, JSQ(2), weighted JSQ(2).

Writes bench/results/sim_scaling.json, .md and .png.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specmesh.sim.cluster import Simulation  # noqa: E402
from specmesh.sim.config import config_from_dict  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DRAFTS = [1, 4, 16, 64, 256]
TARGETS = [1, 2, 4, 8, 16]
CLIENTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
ROUTERS = ["random", "round_robin", "jsq2", "weighted_jsq2"]
KNEE_GAIN = 0.25  # study 2: a doubling of the sessions that adds less than this is past the knee


def closed_loop(base: dict, duration_s: float, num_clients: int) -> dict:
    data = copy.deepcopy(base)
    data.update(duration_s=duration_s, burn_in_s=duration_s / 4)
    data["workload"].update(arrival="closed", num_clients=num_clients, turns=1, think_time_s=0.0)
    return data


def grid_point(base: dict, duration_s: float, num_drafts: int, num_targets: int, clients_per_target: int) -> dict:
    data = closed_loop(base, duration_s, clients_per_target * num_targets)
    data["targets"][0]["count"] = num_targets
    data["drafts"] = [{"count": num_drafts, "device": "phone", "node": "edge"}]
    data["draft_assignment"] = "routed"
    return data


def saturation_point(base: dict, duration_s: float, num_clients: int) -> dict:
    data = closed_loop(base, duration_s, num_clients)
    data["targets"][0]["count"] = 1
    data["drafts"] = [{"count": num_clients, "device": "phone", "node": "edge"}]
    data["draft_assignment"] = "per_client"
    return data


def router_point(base: dict, duration_s: float, router: str, rate_per_s: float) -> dict:
    data = copy.deepcopy(base)
    data.update(duration_s=duration_s, burn_in_s=duration_s / 4, router={"name": router})
    data["devices"]["a100"] = {"roofline": "a100-80g"}
    data["targets"] = [{**data["targets"][0], "count": 8}, {**data["targets"][0], "count": 8, "device": "a100", "weight": 0.6}]
    data["drafts"] = [{"count": 256, "device": "phone", "node": "edge"}]
    data["workload"]["rate_per_s"] = rate_per_s
    return data


def run_point(args: tuple[str, dict[str, Any], dict, str]) -> dict:
    study, labels, data, base_dir = args
    start = time.perf_counter()
    result = Simulation(config_from_dict(data, base_dir=base_dir)).run()
    s = result.summary
    targets = [d for d in result.devices if d.kind == "target"]
    return {"study": study, **labels, "throughput_tokens_per_s": s["throughput_tokens_per_s"],
            "goodput_tokens_per_s": s["goodput_tokens_per_s"], "requests_done": s["num_requests_done"],
            "e2e_p50_ms": s["e2e"]["p50_ms"], "e2e_p95_ms": s["e2e"]["p95_ms"], "ttft_p50_ms": s["ttft"]["p50_ms"],
            "ttft_p95_ms": s["ttft"]["p95_ms"], "tpot_p50_ms": s["tpot"]["p50_ms"], "tpot_p95_ms": s["tpot"]["p95_ms"],
            "target_utilisation_mean": s["target_utilisation_mean"], "draft_utilisation_mean": s["draft_utilisation_mean"],
            "batch_rows_mean": s["batch_rows_mean"],
            "batch_tokens_mean": sum(d.mean_batch_tokens * d.num_batches for d in targets) / max(1, sum(d.num_batches for d in targets)),
            "wall_s": time.perf_counter() - start}


def find_knee(saturation: list[dict]) -> dict | None:
    """The first point whose doubling of sessions adds less than KNEE_GAIN more tokens/s: past it,
    more sessions mostly lengthen each forward (compute-bound) instead of filling idle time.

    >>> find_knee([{"clients": 1, "throughput_tokens_per_s": 10}, {"clients": 2, "throughput_tokens_per_s": 19},
    ...            {"clients": 4, "throughput_tokens_per_s": 22}])["clients"]
    2
    """
    for low, high in zip(saturation, saturation[1:]):
        if high["clients"] == 2 * low["clients"] and high["throughput_tokens_per_s"] < (1 + KNEE_GAIN) * low["throughput_tokens_per_s"]:
            return low
    return None


def plot(rows: list[dict], path: Path, knee: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    grid = [r for r in rows if r["study"] == "grid"]
    ax = axes[0]
    for num_targets in TARGETS:
        series = sorted((r for r in grid if r["targets"] == num_targets), key=lambda r: r["drafts"])
        ax.plot([r["drafts"] for r in series], [r["throughput_tokens_per_s"] for r in series], marker="o", label=f"{num_targets} targets")
    ax.set(xscale="log", yscale="log", xlabel="draft devices (phones)", ylabel="tokens/s", title="1. drafts x targets (closed loop)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")

    sat = sorted((r for r in rows if r["study"] == "saturation"), key=lambda r: r["clients"])
    ax = axes[1]
    ax.plot([r["clients"] for r in sat], [r["throughput_tokens_per_s"] for r in sat], marker="o", color="C0", label="tokens/s")
    ax.set(xscale="log", xlabel="concurrent sessions on one H100", ylabel="tokens/s", title="2. cross-session batching on one target")
    if knee is not None:
        ax.axvline(knee["clients"], color="grey", ls="--", lw=1)
        ax.annotate(f"knee: {knee['clients']} sessions", (knee["clients"], knee["throughput_tokens_per_s"]), fontsize=8,
                    xytext=(5, -30), textcoords="offset points")
    twin = ax.twinx()
    twin.plot([r["clients"] for r in sat], [r["tpot_p50_ms"] for r in sat], marker="s", color="C3", label="TPOT p50 ms")
    twin.set_ylabel("TPOT p50 (ms)", color="C3")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3, which="both")

    routers = [r for r in rows if r["study"] == "routers"]
    ax = axes[2]
    rates = sorted({r["rate_per_s"] for r in routers})
    width = 0.8 / len(rates)
    for i, rate in enumerate(rates):
        values = [next(r["tpot_p95_ms"] for r in routers if r["router"] == name and r["rate_per_s"] == rate) for name in ROUTERS]
        ax.bar([x + i * width for x in range(len(ROUTERS))], values, width, label=f"{rate:g} conversations/s")
    ax.set_xticks([x + width * (len(rates) - 1) / 2 for x in range(len(ROUTERS))], ROUTERS)
    ax.set(ylabel="TPOT p95 (ms)", title="3. routers: 8 H100 + 8 A100, Poisson")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "sim" / "fleet.yaml"))
    parser.add_argument("--duration-s", type=float, default=80.0, help="virtual seconds per point, a quarter of them burn-in")
    parser.add_argument("--clients-per-target", type=int, default=64)
    parser.add_argument("--rates", type=float, nargs="+", default=[40.0, 80.0], help="study 3: conversations started per second")
    parser.add_argument("--jobs", type=int, default=2, help="points simulated in parallel")
    parser.add_argument("--quick", action="store_true", help="10 virtual s per point, fewer points (a smoke run)")
    parser.add_argument("--render", action="store_true", help="only write the .md and .png again from sim_scaling.json")
    args = parser.parse_args()
    if args.render:
        out = json.loads((RESULTS / "sim_scaling.json").read_text())
    else:
        out = run_studies(args)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "sim_scaling.json").write_text(json.dumps(out, indent=1) + "\n")
    write_report(out)
    return 0


def run_studies(args: argparse.Namespace) -> dict:
    drafts, targets, clients = DRAFTS, TARGETS, CLIENTS
    if args.quick:
        args.duration_s, drafts, targets, clients = 10.0, [1, 16], [1, 4], [1, 16, 128]
    base = yaml.safe_load(Path(args.config).read_text())
    base_dir = str(Path(args.config).parent)
    points: list[tuple[str, dict[str, Any], dict, str]] = []
    for t in targets:
        for d in drafts:
            points.append(("grid", {"drafts": d, "targets": t}, grid_point(base, args.duration_s, d, t, args.clients_per_target), base_dir))
    for c in clients:
        points.append(("saturation", {"clients": c}, saturation_point(base, args.duration_s, c), base_dir))
    for rate in args.rates:
        for router in ROUTERS:
            points.append(("routers", {"router": router, "rate_per_s": rate}, router_point(base, args.duration_s, router, rate), base_dir))
    start = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for i, row in enumerate(pool.map(run_point, points)):
            rows.append(row)
            labels = {k: v for k, v in row.items() if k in ("drafts", "targets", "clients", "router", "rate_per_s")}
            print(f"[{i + 1}/{len(points)}] {row['study']} {labels}: {row['throughput_tokens_per_s']:.0f} tok/s, "
                  f"e2e p95 {row['e2e_p95_ms']:.0f} ms ({row['wall_s']:.1f} s)", flush=True)
    wall_s = time.perf_counter() - start

    sat = sorted((r for r in rows if r["study"] == "saturation"), key=lambda r: r["clients"])
    return {"config": str(Path(args.config).relative_to(ROOT) if Path(args.config).is_relative_to(ROOT) else args.config),
            "quick": args.quick, "duration_s": args.duration_s, "burn_in_s": args.duration_s / 4,
            "clients_per_target": args.clients_per_target, "drafts": drafts, "targets": targets, "wall_s": wall_s,
            "knee": find_knee(sat), "rows": rows}


def write_report(out: dict) -> None:
    rows, drafts, targets, knee = out["rows"], out["drafts"], out["targets"], out["knee"]
    sat = sorted((r for r in rows if r["study"] == "saturation"), key=lambda r: r["clients"])
    plot(rows, RESULTS / "sim_scaling.png", knee)
    cmd = f"`.venv/bin/python bench/sim_scaling.py{' --quick' if out['quick'] else ''}`"
    md = ["# Simulator scaling study", "",
          f"{cmd} ({out['config']}: H100 targets serving Llama-3.1-8B, phones drafting SmolLM2-135M over 20 ms links, roofline costs, "
          f"k = 4). {out['duration_s']:g} virtual s per point ({out['burn_in_s']:g} s burn-in), one seed; {len(rows)} runs in "
          f"{out['wall_s']:.0f} s wall. Plot: sim_scaling.png.", "",
          f"## 1. Draft devices x target servers (closed loop, {out['clients_per_target']} clients per target)", "",
          "Tokens/s (end-to-end p95 s):", "",
          "| targets \\ drafts | " + " | ".join(str(d) for d in drafts) + " |", "|---:|" + "---:|" * len(drafts)]
    for t in targets:
        cells = []
        for d in drafts:
            r = next(r for r in rows if r["study"] == "grid" and r["drafts"] == d and r["targets"] == t)
            cells.append(f"{r['throughput_tokens_per_s']:.0f} ({r['e2e_p95_ms'] / 1e3:.1f})")
        md.append(f"| {t} | " + " | ".join(cells) + " |")
    md += ["", "## 2. Cross-session batching on one H100 target (one phone per client)", "",
           "| sessions | tokens/s | rows per batch | tokens per batch | target busy | TPOT p50 ms | TTFT p95 ms | e2e p95 s |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sat:
        md.append(f"| {r['clients']} | {r['throughput_tokens_per_s']:.0f} | {r['batch_rows_mean']:.1f} | {r['batch_tokens_mean']:.0f} | "
                  f"{r['target_utilisation_mean']:.0%} | {r['tpot_p50_ms']:.1f} | {r['ttft_p95_ms']:.0f} | {r['e2e_p95_ms'] / 1e3:.1f} |")
    if knee is not None:
        after = next(r for r in sat if r["clients"] == 2 * knee["clients"])
        md += ["", f"Knee (the first doubling of sessions that adds under {KNEE_GAIN:.0%} tokens/s): {knee['clients']} concurrent "
               f"sessions, {knee['throughput_tokens_per_s']:.0f} tok/s, {knee['batch_tokens_mean']:.0f} tokens per verify forward, "
               f"target {knee['target_utilisation_mean']:.0%} busy; doubling to {after['clients']} gives "
               f"{after['throughput_tokens_per_s'] / knee['throughput_tokens_per_s'] - 1:+.0%} tokens/s for a TPOT p50 of "
               f"{after['tpot_p50_ms']:.0f} ms instead of {knee['tpot_p50_ms']:.0f} ms."]
    md += ["", "## 3. Routers (8 H100 + 8 A100 targets, weight 0.6 for the A100s in weighted JSQ(2); 256 phones; Poisson conversations)", "",
           "| rate /s | router | tokens/s | goodput | TTFT p95 ms | TPOT p95 ms | e2e p50 s | e2e p95 s |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["study"] == "routers"):
        md.append(f"| {r['rate_per_s']:g} | {r['router']} | {r['throughput_tokens_per_s']:.0f} | {r['goodput_tokens_per_s']:.0f} | "
                  f"{r['ttft_p95_ms']:.0f} | {r['tpot_p95_ms']:.1f} | {r['e2e_p50_ms'] / 1e3:.2f} | {r['e2e_p95_ms'] / 1e3:.2f} |")
    text = "\n".join(md) + "\n"
    (RESULTS / "sim_scaling.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
