"""`default_mode: auto` on list questions: does it pick Skeleton-of-Thought only where SoT is faster?

    .venv/bin/python bench/auto_mode.py [--runs 2] [--new-tokens 96] [--threads 2] [--model default]

A Verify service and a Coordinator (`default_mode: auto`, the start-up probe on, n-gram drafts on the
Verify service) in this process on loopback, default model, float32, greedy. Six list questions (each
routed to SoT by the rule table), each asked three ways per run, in an order that rotates: no mode
(auto decides), speculative by name, skeleton by name. The measure is the gate's: wall ms per answer
token (a SoT answer's plan tokens are not answer tokens). The goal (issue 27): auto never runs SoT on a
question where SoT by name was slower than speculative by name. What the probe measured at start and
every routed reason are reported. Writes bench/results/auto_mode.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.options import CoordinatorOptions  # noqa: E402
from coordinator.server import create_server as create_coordinator  # noqa: E402
from servicekit.background import BackgroundServices  # noqa: E402
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from target_service.options import VerifyOptions  # noqa: E402
from target_service.server import create_server as create_verify  # noqa: E402

RESULTS = ROOT / "bench" / "results"
QUESTIONS = (
    "What are some ways to reduce stress at work?",
    "List the benefits of learning a second language.",
    "Give me tips for saving money on groceries.",
    "What are the pros and cons of remote work?",
    "What are some strategies for studying effectively?",
    "Suggest ideas for a rainy weekend at home.",
)
WAYS = {"auto": coordinator_pb2.GENERATION_MODE_UNSPECIFIED, "speculative": coordinator_pb2.GENERATION_MODE_SPECULATIVE,
        "skeleton": coordinator_pb2.GENERATION_MODE_SKELETON}
MODE_NAMES = {coordinator_pb2.GENERATION_MODE_SPECULATIVE: "speculative", coordinator_pb2.GENERATION_MODE_SKELETON: "skeleton"}


async def ask(address: str, question: str, mode: int, new_tokens: int) -> dict:
    request = coordinator_pb2.GenerateRequest(
        chat=coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role="user", content=question)]),
        mode=mode, drafter="ngram", sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=new_tokens))
    start_s = time.perf_counter()
    async with grpc.aio.insecure_channel(address) as channel:
        final = None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=600):
            if response.branch_id == -1 and response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                final = response
    wall_ms = (time.perf_counter() - start_s) * 1e3
    assert final is not None
    summary = final.skeleton
    ran = MODE_NAMES[final.mode_choice.mode]
    if ran == "skeleton":
        tokens = (sum(b.num_tokens for b in summary.branches) if summary.branches
                  else final.stats.num_generated_tokens - summary.num_skeleton_tokens)
    else:
        tokens = final.stats.num_generated_tokens
    return {"ran": ran, "reason": final.mode_choice.reason, "wall_ms": round(wall_ms, 1), "tokens": tokens,
            "ms_per_token": round(wall_ms / max(tokens, 1), 2), "direct_reason": summary.direct_reason if ran == "skeleton" else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", default=str(RESULTS / "auto_mode"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    services = BackgroundServices()
    try:
        verify = services.start(create_verify(VerifyOptions(model=args.model, dtype="float32", port=0)))
        coordinator = services.start(create_coordinator(CoordinatorOptions(
            model=args.model, port=0, verify_addresses=f"127.0.0.1:{verify.port}", default_mode="auto",
            default_drafter="ngram")))
        address = f"127.0.0.1:{coordinator.port}"
        gate = coordinator.servicer.skeleton_gate
        probe_start_s = time.perf_counter()
        while gate.probing and time.perf_counter() - probe_start_s < 600:
            time.sleep(0.2)
        probe = {"seconds": round(time.perf_counter() - probe_start_s, 1), "verdict": gate.closed_reason() or "open",
                 "plain_ms_per_token": round(gate.plain_median_ms or 0.0, 2)}
        print(f"probe: {probe}", flush=True)

        rows = {q: {way: [] for way in WAYS} for q in QUESTIONS}
        for run in range(args.runs):
            for i, question in enumerate(QUESTIONS):
                ways = list(WAYS)
                shift = (run + i) % len(ways)
                for way in ways[shift:] + ways[:shift]:
                    result = ask(address, question, WAYS[way], args.new_tokens)
                    result = asyncio.run(result)
                    rows[question][way].append(result)
                    print(f"run {run} {way:<11} ran {result['ran']:<11} {result['ms_per_token']:7.2f} ms/token "
                          f"{result['tokens']:3d} tokens  {question}  [{result['reason']}]", flush=True)
    finally:
        services.close()

    table, violations = [], 0
    for question, ways in rows.items():
        median = {way: statistics.median(r["ms_per_token"] for r in results) for way, results in ways.items()}
        skeleton_slower = median["skeleton"] > median["speculative"]
        auto_skeleton = sum(r["ran"] == "skeleton" for r in ways["auto"])
        violations += auto_skeleton if skeleton_slower else 0
        table.append({"question": question, "median_ms_per_token": median, "skeleton_slower": skeleton_slower,
                      "auto_ran_skeleton": auto_skeleton, "runs": ways,
                      "skeleton_direct_reasons": sorted({r["direct_reason"] for r in ways["skeleton"] if r["direct_reason"]})})
    summary = {"command": "python bench/auto_mode.py " + " ".join(sys.argv[1:]), "model": args.model,
               "cpu": platform.processor() or platform.machine(), "threads": args.threads, "runs": args.runs,
               "new_tokens": args.new_tokens, "probe": probe, "questions": table,
               "auto_ran_skeleton_where_slower": violations}
    Path(args.out + ".json").write_text(json.dumps(summary, indent=1))
    lines = ["# default_mode auto on list questions", "",
             f"`{summary['command']}`: model {args.model}, float32, greedy, {args.new_tokens} new tokens at most, "
             f"{args.threads} torch threads, a Verify service and a Coordinator (auto, probe on, n-gram drafts on "
             f"the Verify service) in one process on loopback; medians of {args.runs} runs, ways rotated per question.", "",
             f"Start-up probe: {probe['seconds']} s; verdict: {probe['verdict']}; plain answers "
             f"{probe['plain_ms_per_token']} ms per token.", "",
             "| question | speculative ms/token | skeleton ms/token | auto ms/token | SoT slower | auto ran SoT | SoT by name answered directly because |",
             "|---|---|---|---|---|---|---|"]
    for row in table:
        m = row["median_ms_per_token"]
        lines.append(f"| {row['question']} | {m['speculative']:.1f} | {m['skeleton']:.1f} | {m['auto']:.1f} | "
                     f"{'yes' if row['skeleton_slower'] else 'no'} | {row['auto_ran_skeleton']}/{args.runs} | "
                     f"{'; '.join(row['skeleton_direct_reasons']) or '-'} |")
    lines += ["", f"Auto ran SoT on a question where SoT was slower: {violations} time(s).", "",
              "Routed reasons (auto):", ""]
    lines += sorted({f"- {r['reason']}" for row in table for r in row["runs"]["auto"]})
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
