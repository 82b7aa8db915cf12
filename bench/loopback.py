"""Target-only decoding through the Verify service over loopback against the same decoding in-process.

    .venv/bin/python bench/loopback.py [--runs 5] [--new-tokens 64] [--threads 2] [--quick]

Default model (SmolLM2-135M-Instruct), float32, greedy, EOS ignored (every run makes --new-tokens tokens),
time including the prefill, the prompts of bench/engine.py. Three ways to decode, alternating prompt by
prompt (the order reverses every run):
    in-process    `generate` with no drafter in this process (what `specmesh generate --local` runs)
    Run           a Verify service in its own process (`python -m target_service`, loopback), driven as the
                  Coordinator drives a target-only request: OpenSession, then one streamed Run
                  (`speculative_stream_async`, plan SERVER_RUN) whose rounds the service steps itself
    Generate      the same service's one-call `Verify.Generate`, streamed
Only one of them computes at a time: the service idles while this process decodes, and this process
waits on the stream while the service decodes; each gets --threads threads. Per prompt the median over
--runs; the goal (issue 30): each service path >= 0.90x in-process tokens/s. Every path must give the
same tokens. Writes bench/results/loopback.{json,md}.
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
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engine import PEER_PROMPTS  # noqa: E402
from servicekit.remote import RemoteVerifier  # noqa: E402
from specmesh.decoding.async_driver import speculative_stream_async  # noqa: E402
from specmesh.decoding.plan import Plan  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402
from specmesh.proto.v1 import common_pb2, verify_pb2, verify_pb2_grpc  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GOAL = 0.90
METHODS = ("in-process", "Run", "Generate")


def start_service(threads: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    """A Verify service on the default model in its own process; (process, address) once it listens."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", "default", "--dtype", "float32",
                             "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split("listening on", 1)[1].split(",")[0].strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the Verify service did not start; see {log_path}")


async def run_local(verifier: TargetVerifier, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    return generate(verifier, None, prompt_ids, params).token_ids  # (blocks the loop: nothing else runs here)


async def run_stream(stub, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    verifier = RemoteVerifier(stub)
    tokens: list[int] = []
    async for event in speculative_stream_async(verifier, None, prompt_ids, params, plan=Plan.SERVER_RUN):
        tokens += event.token_ids
    return tokens


async def run_generate(stub, prompt_ids: list[int], num_new: int) -> list[int]:
    request = verify_pb2.VerifyGenerateRequest(prompt_token_ids=prompt_ids, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=num_new, ignore_eos=True))
    tokens: list[int] = []
    async for response in stub.Generate(request, timeout=600):
        tokens += response.token_ids
    return tokens


async def measure(args, verifier: TargetVerifier, prompts: list[list[int]], address: str) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rows: list[dict] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        calls = {
            "in-process": lambda ids: run_local(verifier, ids, params),
            "Run": lambda ids: run_stream(stub, ids, params),
            "Generate": lambda ids: run_generate(stub, ids, args.new_tokens),
        }
        for method in METHODS:  # warm-up: first calls, the service's first session
            await calls[method](prompts[0][:8])
        for run in range(args.runs):
            for index, ids in enumerate(prompts):
                order = METHODS if (run + index) % 2 == 0 else tuple(reversed(METHODS))
                for method in order:
                    start = time.perf_counter()
                    tokens = await calls[method](ids)
                    seconds = time.perf_counter() - start
                    rows.append(dict(run=run, prompt=index, method=method, tokens=tokens,
                                     tokens_per_s=len(tokens) / seconds))
                line = ", ".join(f"{r['method']} {r['tokens_per_s']:.1f}" for r in rows[-len(METHODS):])
                print(f"[run {run} prompt {index}] tok/s: {line}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="3 prompts, 1 run, 16 tokens (smoke run)")
    parser.add_argument("--note", default="", help="a line for the report (e.g. the machine's load)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.new_tokens = 1, 16
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    folder = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [chat_prompt_ids(tokenizer, p) for p in PEER_PROMPTS[: 3 if args.quick else None]]
    verifier = TargetVerifier(load_engine(folder, dtype="float32"))
    proc, address = start_service(args.threads, Path("/tmp/specmesh-bench-loopback-verify.log"))
    try:
        rows = asyncio.run(measure(args, verifier, prompts, address))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    per_prompt = []
    for index in range(len(prompts)):
        med = {m: statistics.median(r["tokens_per_s"] for r in rows if r["prompt"] == index and r["method"] == m)
               for m in METHODS}
        mine = [r for r in rows if r["prompt"] == index]
        reference = next(r["tokens"] for r in mine if r["method"] == "in-process")
        same = all(r["tokens"] == reference for r in mine)
        per_prompt.append(dict(prompt=index, **{f"{m}_tokens_per_s": v for m, v in med.items()},
                               run_vs_in_process=med["Run"] / med["in-process"],
                               generate_vs_in_process=med["Generate"] / med["in-process"], same_tokens=same))
    summary = {key: dict(median=statistics.median(p[key] for p in per_prompt), lowest=min(p[key] for p in per_prompt))
               for key in ("run_vs_in_process", "generate_vs_in_process")}
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.machine(), cpus=os.cpu_count(),
                torch=torch.__version__, threads=args.threads, runs=args.runs, new_tokens=args.new_tokens, note=args.note,
                command="python bench/loopback.py" + (" --quick" if args.quick else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loopback.json").write_text(json.dumps(dict(meta=meta, summary=summary, per_prompt=per_prompt,
                                                           runs=rows), indent=2))
    lines = ["# Target-only decoding: the Verify service over loopback vs in-process", "",
             f"Run {meta['date']} on {meta['machine']} {meta['cpus']} cpus, torch {meta['torch']}, {args.threads} threads "
             "each (the service in its own process).", "", f"Command: `{meta['command']}`", ""]
    if args.note:
        lines += [f"Note: {args.note}", ""]
    lines += [f"Default model in float32, greedy, {args.new_tokens} new tokens (EOS ignored), time including the prefill, "
              f"median of {args.runs} runs per prompt, the three ways alternating prompt by prompt. Run: OpenSession + "
              "one streamed Run (how the Coordinator serves a target-only request); Generate: the one-call RPC. "
              f"Goal: each >= {GOAL}x in-process.", "",
              "| prompt | in-process tok/s | Run tok/s | Generate tok/s | Run / in-process | Generate / in-process "
              "| same tokens |", "|---|---|---|---|---|---|---|"]
    for p in per_prompt:
        lines.append(f"| {p['prompt']} | {p['in-process_tokens_per_s']:.1f} | {p['Run_tokens_per_s']:.1f} | "
                     f"{p['Generate_tokens_per_s']:.1f} | {p['run_vs_in_process']:.3f}x | {p['generate_vs_in_process']:.3f}x "
                     f"| {'yes' if p['same_tokens'] else 'NO'} |")
    lines += ["", f"- Run / in-process: median prompt {summary['run_vs_in_process']['median']:.3f}x, lowest "
              f"{summary['run_vs_in_process']['lowest']:.3f}x.",
              f"- Generate / in-process: median prompt {summary['generate_vs_in_process']['median']:.3f}x, lowest "
              f"{summary['generate_vs_in_process']['lowest']:.3f}x."]
    report = "\n".join(lines) + "\n"
    (RESULTS / "loopback.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
