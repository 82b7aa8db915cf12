"""A remote drafter's rounds: a unary Propose per round against one ProposeStream per session (issue 29, item 2).

    .venv/bin/python bench/draft_stream.py [--blocks 6] [--rounds 300] [--k 4] [--quick]

A Draft service with the n-gram drafter (prompt lookup: microseconds of drafting, so a round's time is
the transport's) in its own process over loopback, batch window 0, pinned to the last core; this
process (the client, `servicekit.remote.RemoteDrafter` as the Coordinator uses it) pinned to the first.
Blocks of --rounds rounds on a fresh session, alternating unary / stream (the order reverses every
block). Per round: wall time, the client's CPU (process time) and the service's CPU (/proc utime +
stime). Both ways must propose the same tokens. Medians over the blocks. Writes
bench/results/draft_stream.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servicekit.remote import RemoteDrafter  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402
from specmesh.proto.v1 import draft_pb2_grpc  # noqa: E402

RESULTS = ROOT / "bench" / "results"
WAYS = ("unary", "stream")
TEXT = ("The cat sat on the mat. The dog sat on the log. The cat saw the dog, and the dog saw the cat. "
        "On the mat the cat sat; on the log the dog sat. ") * 4


def start_service(cpu: int | None, log_path: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None else []
    log = log_path.open("w")
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "draft_service", "--model", "default", "--drafter", "ngram",
                             "--batch-window-ms", "0", "--port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split("listening on", 1)[1].split(",")[0].strip()
    proc.kill()
    raise RuntimeError(f"the Draft service did not start; see {log_path}")


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def block(stub, ids: list[int], rounds: int, k: int, stream: bool, service_pid: int) -> dict:
    drafter = RemoteDrafter(stub, stream=stream)
    session = await drafter.open(ids[:32], SamplingParams(temperature=0.0, max_new_tokens=100_000, ignore_eos=True))
    await drafter.propose(session, [], k)  # the first round (and the stream's set-up) outside the timing
    proposals = []
    cpu0, service0, start = time.process_time(), process_cpu_s(service_pid), time.perf_counter()
    for i in range(rounds):
        proposal = await drafter.propose(session, [ids[32 + i % (len(ids) - 32)]], k)
        proposals.append(proposal.token_ids)
    wall, cpu, service = time.perf_counter() - start, time.process_time() - cpu0, process_cpu_s(service_pid) - service0
    await drafter.close(session)
    assert drafter.stream is stream  # the stream was used throughout (no fall back)
    return {"way": "stream" if stream else "unary", "ms_per_round": wall / rounds * 1e3,
            "client_cpu_ms_per_round": cpu / rounds * 1e3, "service_cpu_ms_per_round": service / rounds * 1e3,
            "proposals": proposals}


async def measure(args, ids: list[int], address: str, service_pid: int) -> list[dict]:
    rows = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        for stream in (False, True):  # warm-up
            await block(stub, ids, 50, args.k, stream, service_pid)
        for b in range(args.blocks):
            for stream in ((False, True) if b % 2 == 0 else (True, False)):
                rows.append({"block": b, **await block(stub, ids, args.rounds, args.k, stream, service_pid)})
            pair = rows[-2:]
            print(f"[block {b}] " + ", ".join(f"{r['way']} {r['ms_per_round']:.3f} ms/round" for r in pair), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 blocks of 50 rounds (smoke run)")
    parser.add_argument("--note", default="", help="a line for the report (e.g. the machine's load)")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.rounds = 2, 50
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(resolve_model_spec("default"))(TEXT)["input_ids"]
    cores = os.cpu_count() or 1
    if cores >= 2:
        os.sched_setaffinity(0, {0})
    proc, address = start_service(cores - 1 if cores >= 2 else None, Path("/tmp/specmesh-bench-draft-stream.log"))
    try:
        rows = asyncio.run(measure(args, ids, address, proc.pid))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    by_block = {}
    for row in rows:
        by_block.setdefault(row["block"], {})[row["way"]] = row
    same = all(pair["unary"]["proposals"] == pair["stream"]["proposals"] for pair in by_block.values())
    keys = ("ms_per_round", "client_cpu_ms_per_round", "service_cpu_ms_per_round")
    medians = {way: {key: statistics.median(r[key] for r in rows if r["way"] == way) for key in keys} for way in WAYS}
    ratios = [pair["stream"]["ms_per_round"] / pair["unary"]["ms_per_round"] for pair in by_block.values()]
    summary = {"machine": f"{platform.machine()} {cores} cpus", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "args": vars(args), "medians": medians, "stream_over_unary_per_block": ratios,
               "stream_over_unary_median": statistics.median(ratios), "same_proposals": same,
               "blocks": [{k: v for k, v in r.items() if k != "proposals"} for r in rows]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "draft_stream.json").write_text(json.dumps(summary, indent=1) + "\n")
    flags = " --quick" if args.quick else f" --blocks {args.blocks} --rounds {args.rounds} --k {args.k}"
    u, s = medians["unary"], medians["stream"]
    lines = ["# A remote drafter's rounds: unary Propose vs one ProposeStream per session", "",
             f"Run {summary['date']} on {summary['machine']}. Command: `.venv/bin/python bench/draft_stream.py{flags}`"
             + (f". Note: {args.note}" if args.note else ""), "",
             "N-gram Draft service (drafting takes microseconds: a round is the transport) in its own process on loopback, "
             "pinned to the last core, batch window 0; the client (`RemoteDrafter`, as the Coordinator drives it) pinned to "
             f"the first. k = {args.k}, {args.rounds} rounds per block, {args.blocks} blocks per way, alternating. Medians over blocks.", "",
             "| way | ms per round | client CPU ms per round | service CPU ms per round |", "|---|---:|---:|---:|",
             *(f"| {way} | {medians[way]['ms_per_round']:.3f} | {medians[way]['client_cpu_ms_per_round']:.3f} | "
               f"{medians[way]['service_cpu_ms_per_round']:.3f} |" for way in WAYS), "",
             f"- stream / unary time per round: median {summary['stream_over_unary_median']:.3f}x "
             f"(blocks: {', '.join(f'{r:.3f}' for r in ratios)}); saved per round {u['ms_per_round'] - s['ms_per_round']:.3f} ms, "
             f"client CPU {u['client_cpu_ms_per_round'] - s['client_cpu_ms_per_round']:.3f} ms, service CPU "
             f"{u['service_cpu_ms_per_round'] - s['service_cpu_ms_per_round']:.3f} ms.",
             f"- same proposals both ways in every block: {same}."]
    text = "\n".join(lines) + "\n"
    (RESULTS / "draft_stream.md").write_text(text)
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
