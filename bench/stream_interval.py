"""`make demo`'s two cluster lines at several stream intervals, each timed against in-process in the same round.

    .venv/bin/python bench/stream_interval.py [--intervals 0,50] [--rounds 7] [--new-tokens 96]

The cluster is `configs/local.yaml` as shipped (Draft, Verify and Coordinator processes; the demo's
placement), in-process is `LocalGenerator("default", drafter="bf16")` in this process, as `make demo`
runs both. Lines: the demo's chat prompt (the bf16 self-draft: in the cluster the one the Verify service
hosts, `model_placement: verify`; before 2026-11-29 the Draft service's) and its passage (n-gram drafts; on
the Verify service in the cluster); with
--target-only the same prompts with no drafting on either side (the cluster's autoregressive mode). Each
round times every line once in-process and once through the Coordinator per interval
(GenerateRequest.stream_interval_ms, which the Coordinator also asks of the Verify service's Run), in
an order that turns round by round (SETTLE_S apart: another process's OpenMP team still spinning
after its work slowed whichever request came right after it by up to 20%); a line's figure per interval is the median over rounds of
cluster / in-process wall time (whole request, greedy), so both sides of a ratio see the same moment
of a shared machine. Also per interval: the messages the client got per request, the longest gap
between two of them, and the CPU each process spent per token (`/proc`, this process's threads as
the client and the in-process side are apart: only the cluster's requests count). Writes
bench/results/stream_interval.{json,md} (--target-only: stream_interval_target_only.{json,md}).
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

from bench.sim_validate import process_cpu_s  # noqa: E402
from client.cluster import Cluster, load_cluster_config  # noqa: E402
from client.coordinator_client import CoordinatorClient  # noqa: E402
from client.demo import CHAT_PROMPT, GROUNDED_PROMPT  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SETTLE_S = 0.5  # before each timed request: the other side's idle OpenMP threads stop spinning
LINES = {"chat": (CHAT_PROMPT, "bf16", "service"), "passage": (GROUNDED_PROMPT, "ngram", "ngram")}


async def cluster_request(client: CoordinatorClient, prompt: str, drafter: str, new_tokens: int,
                          interval_ms: int) -> dict:
    """One request through the Coordinator: its wall time, tokens, text, messages and longest gap."""
    start = last = time.perf_counter()
    tokens, texts, gaps = [], [], []
    mode = "autoregressive" if drafter == "none" else "speculative"
    async for chunk in client.generate([{"role": "user", "content": prompt}], mode=mode, drafter=drafter if drafter != "none" else "",
                                       max_new_tokens=new_tokens, stream_interval_ms=interval_ms):
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        tokens += chunk.token_ids
        texts.append(chunk.text)
    return {"wall_s": time.perf_counter() - start, "tokens": tokens, "text": "".join(texts), "messages": len(gaps),
            "longest_gap_ms": 1e3 * max(gaps[1:], default=0.0)}


def in_process(generator, prompt: str, drafter: str, new_tokens: int) -> tuple[float, str]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    start = time.perf_counter()
    text = "".join(generator.stream_text(prompt, params, drafter=drafter))
    return time.perf_counter() - start, text


async def measure(address: str, pids: dict[str, int], generator, intervals: list[int], rounds: int,
                  new_tokens: int, target_only: bool) -> dict:
    out: dict = {}
    async with CoordinatorClient(address) as client:
        for line, (prompt, local_drafter, drafter) in LINES.items():
            if target_only:
                line, local_drafter, drafter = f"{line}, target only", "none", "none"
            reference = in_process(generator, prompt, local_drafter, new_tokens)[1]  # (warm)
            for interval in intervals:
                await cluster_request(client, prompt, drafter, 8, interval)
            ratios: dict[int, list[float]] = {i: [] for i in intervals}
            walls: dict[int, list[float]] = {i: [] for i in intervals}
            local: list[float] = []
            cpu = {i: dict.fromkeys(pids, 0.0) for i in intervals}
            tokens = dict.fromkeys(intervals, 0)
            messages: dict[int, list[int]] = {i: [] for i in intervals}
            gaps: dict[int, list[float]] = {i: [] for i in intervals}
            identical = True
            for r in range(rounds):
                order = [None, *intervals]  # None: in-process
                order = order[r % len(order):] + order[:r % len(order)]
                if r % 2:
                    order.reverse()
                cluster_s = {}
                for what in order:
                    time.sleep(SETTLE_S)
                    if what is None:
                        wall, text = in_process(generator, prompt, local_drafter, new_tokens)
                        local.append(wall)
                        identical &= text == reference
                        continue
                    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
                    got = await cluster_request(client, prompt, drafter, new_tokens, what)
                    for name, pid in pids.items():
                        cpu[what][name] += process_cpu_s(pid) - before[name]
                    identical &= got["text"] == reference
                    cluster_s[what] = got["wall_s"]
                    tokens[what] += len(got["tokens"])
                    messages[what].append(got["messages"])
                    gaps[what].append(got["longest_gap_ms"])
                for interval, wall in cluster_s.items():
                    ratios[interval].append(wall / local[-1])
                    walls[interval].append(wall)
            num_tokens = tokens[intervals[0]] // rounds
            out[line] = {
                "tokens": num_tokens, "identical": identical,
                "in_process_tok_s": num_tokens / statistics.median(local),
                "intervals": {str(i): {
                    "ratio_median": statistics.median(ratios[i]), "ratios": ratios[i],
                    "cluster_tok_s": num_tokens / statistics.median(walls[i]),
                    "messages_median": statistics.median(messages[i]),
                    "longest_gap_ms_median": statistics.median(gaps[i]),
                    "cpu_ms_per_token": {name: 1e3 * s / tokens[i] for name, s in cpu[i].items()},
                } for i in intervals},
            }
            print(json.dumps({line: {i: round(v["ratio_median"], 3) for i, v in out[line]["intervals"].items()}}), flush=True)
    return out


def write(results: dict, args: argparse.Namespace) -> Path:
    RESULTS.mkdir(exist_ok=True)
    name = "stream_interval_target_only" if args.target_only else "stream_interval"
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# `make demo`'s cluster lines at several stream intervals (bench/stream_interval.py)", "",
        f"`{results['command']}`, {results['when']}, {results['machine']}. Cluster: `configs/local.yaml` as shipped; "
        "in-process: this process, 2 threads. Per round each line once in-process and once per interval through the "
        f"Coordinator, the order turning; {args.rounds} rounds; ratio = cluster / in-process wall time of the same round "
        "(whole request, greedy), median over rounds. CPU: per generated token, the cluster's requests only.", "",
        "| line | interval ms | cluster / in-process (median) | rounds' ratios | in-process / cluster tok/s | messages per "
        "request | longest gap ms | CPU ms/token: verify, coordinator, draft, client |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line, data in results["lines"].items():
        for interval, v in data["intervals"].items():
            cpu = v["cpu_ms_per_token"]
            lines.append(
                f"| {line} ({data['tokens']} tokens, output {'identical' if data['identical'] else 'DIFFERENT'}) | "
                f"{interval} | **{v['ratio_median']:.2f}x** | {', '.join(f'{x:.2f}' for x in v['ratios'])} | "
                f"{data['in_process_tok_s']:.1f} / {v['cluster_tok_s']:.1f} | {v['messages_median']:.0f} | "
                f"{v['longest_gap_ms_median']:.0f} | {cpu.get('verify', 0):.2f}, {cpu.get('coordinator', 0):.2f}, "
                f"{cpu.get('draft', 0):.2f}, {cpu.get('client', 0):.2f} |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    return RESULTS / f"{name}.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--intervals", default="0,50", help="stream_interval_ms values, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--target-only", action="store_true",
                        help="no drafting on either side (the cluster's autoregressive mode): the transport's cost alone")
    args = parser.parse_args()
    intervals = [int(x) for x in args.intervals.split(",")]

    from client.local import LocalGenerator

    generator = LocalGenerator("default", drafter="bf16")
    specs = [s for s in load_cluster_config(str(ROOT / "configs" / "local.yaml")) if s.kind != "gateway"]
    for spec in specs:
        spec.options["port"] = 0
        spec.options.pop("metrics_port", None)
    with Cluster(specs) as cluster:
        pids = {name: proc.pid for name, proc in cluster.processes.items()}
        pids["client"] = os.getpid()  # (its in-process requests fall outside the counted spans)
        lines = asyncio.run(measure(cluster.addresses_of("coordinator")[0], pids, generator, intervals, args.rounds,
                                    args.new_tokens, args.target_only))
    results = {"command": "python bench/stream_interval.py " + " ".join(sys.argv[1:]),
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "lines": lines}
    print(write(results, args).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
