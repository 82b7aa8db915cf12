"""16 concurrent chat clients through `configs/local.yaml`, the bf16 self-draft placed on the Verify service
(as shipped, `model_placement: verify`) and on the Draft service (`model_placement: draft`): aggregate tok/s
of speculative decoding against autoregressive decoding through the same cluster.

    .venv/bin/python bench/placement_clients.py [--clients 16] [--waves 4] [--new-tokens 48]

Per placement one cluster is started (settled: `Cluster.start`), one untimed wave warms it, then `--waves`
waves alternate autoregressive and speculative (drafter "service"), each wave `--clients` requests at once
(8 chat prompts in turn, greedy); aggregate tok/s = the wave's tokens / its wall time, and each wave's
speculative / autoregressive ratio is paired with the autoregressive wave just before it. Every speculative
answer is checked token for token against the autoregressive one. Writes bench/results/placement_clients.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.cluster import Cluster, load_cluster_config  # noqa: E402
from client.coordinator_client import CoordinatorClient  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PROMPTS = ["Give me three tips for writing clear code.", "Explain how a rainbow forms.", "What is a hash table?",
           "Write a short poem about the sea.", "How do vaccines work?", "Describe the water cycle.",
           "What causes the seasons?", "Explain recursion to a child."]
PLACEMENTS = ("verify", "draft")


async def wave(client: CoordinatorClient, mode: str, clients: int, new_tokens: int) -> tuple[float, list]:
    """`clients` requests at once: (aggregate tok/s, results in prompt order)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(client.collect([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], mode=mode,
                                                    drafter="service" if mode == "speculative" else "",
                                                    max_new_tokens=new_tokens) for i in range(clients)))
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start), results


async def measure(address: str, clients: int, waves: int, new_tokens: int) -> dict:
    rows = []
    async with CoordinatorClient(address) as client:
        await wave(client, "speculative", clients, new_tokens)  # untimed
        for _ in range(waves):
            plain, plain_results = await wave(client, "autoregressive", clients, new_tokens)
            spec, spec_results = await wave(client, "speculative", clients, new_tokens)
            rows.append({"autoregressive_tok_s": plain, "speculative_tok_s": spec, "ratio": spec / plain,
                         "identical": all(a.token_ids == b.token_ids for a, b in zip(plain_results, spec_results)),
                         "drafter": spec_results[0].stats.drafter, "plan": spec_results[0].stats.plan,
                         "mean_accepted_length": statistics.mean(r.stats.mean_accepted_length for r in spec_results)})
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    return {"waves": rows, "ratio_median": statistics.median(r["ratio"] for r in rows),
            "identical": all(r["identical"] for r in rows)}


def write(results: dict) -> None:
    (RESULTS / "placement_clients.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["# 16 clients: the bf16 self-draft on the Verify service vs on the Draft service (bench/placement_clients.py)", "",
             f"`{results['command']}`, {results['when']}, {results['machine']}. `configs/local.yaml` with `model_placement` "
             f"as named; {results['clients']} chat requests at once per wave, greedy, {results['new_tokens']} new tokens; "
             "each speculative wave paired with the autoregressive wave before it, through the same cluster.", "",
             "| model_placement | drafter / plan | speculative / autoregressive (median) | waves' ratios | "
             "aggregate tok/s (autoregressive, speculative; medians) | mean accepted length | tokens identical |",
             "|---|---|---|---|---|---|---|"]
    for placement, out in results["placements"].items():
        waves = out["waves"]
        lines.append(f"| {placement} | {waves[0]['drafter']} / {waves[0]['plan']} | **{out['ratio_median']:.2f}x** | "
                     + ", ".join(f"{w['ratio']:.2f}" for w in waves)
                     + f" | {statistics.median(w['autoregressive_tok_s'] for w in waves):.1f}, "
                     f"{statistics.median(w['speculative_tok_s'] for w in waves):.1f} | "
                     f"{statistics.mean(w['mean_accepted_length'] for w in waves):.2f} | {'yes' if out['identical'] else 'NO'} |")
    (RESULTS / "placement_clients.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    placements = {}
    for placement in PLACEMENTS:
        specs = [s for s in load_cluster_config(str(ROOT / "configs" / "local.yaml")) if s.kind != "gateway"]
        for spec in specs:
            spec.options["port"] = 0
            spec.options.pop("metrics_port", None)
            if spec.kind == "coordinator":
                spec.options["model_placement"] = placement
        with Cluster(specs) as cluster:
            placements[placement] = asyncio.run(measure(cluster.addresses_of("coordinator")[0], args.clients, args.waves,
                                                        args.new_tokens))
    write({"command": "python bench/placement_clients.py " + " ".join(sys.argv[1:]),
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "clients": args.clients, "new_tokens": args.new_tokens, "placements": placements})
    return 0 if all(p["identical"] for p in placements.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
