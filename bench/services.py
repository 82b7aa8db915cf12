"""Services benchmark: aggregate verified tokens/s through the Verify service at 1, 4 and 16
concurrent sessions (n-gram drafts from the Draft service, default model, CPU), bytes on the wire
per round for greedy and for sampling (q dense fp32 / fp16 vs exact sparse), and the Verify round
latency of 4 sessions while a 4,096-token prompt is prefilled, unchunked vs chunked.

Writes bench/results/services.json and services.md. Ratios are measured side by side in one run.
`--prefill-scenario` runs only the prefill scenario and keeps the other results of the last run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draft_service.options import DraftOptions  # noqa: E402
from draft_service.server import create_server as create_draft  # noqa: E402
from servicekit.background import BackgroundServices  # noqa: E402
from servicekit.channels import open_channel as channel  # noqa: E402
from servicekit.wire_loop import wire_generation  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.proto.v1 import common_pb2, verify_pb2, verify_pb2_grpc  # noqa: E402
from target_service.options import VerifyOptions  # noqa: E402
from target_service.server import create_server as create_verify  # noqa: E402

CONCURRENCY = (1, 4, 16)
MAX_NEW_TOKENS = 48
K = 4
TEXTS = [
    "List the planets of the solar system in order: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune. "
    "Now list them again in order:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
]


PREFILL_PROMPT_TOKENS = 4096
PREFILL_SESSIONS = 4
IDLE_S = 2.0  # rounds measured with no prefill in flight, for reference


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer(TEXTS[i % len(TEXTS)] + f" ({i})")["input_ids"] for i in range(n)]


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer(" ".join(TEXTS) + f" ({len(ids)})")["input_ids"]
    return ids[:num_tokens]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def prefill_interleave(verify_addr: str, short: list[list[int]], long: list[int]) -> dict:
    """`short` sessions run Verify rounds back to back (k = 4 fixed draft tokens, greedy: a round costs
    its forward whatever is accepted); after IDLE_S alone, one more session opens `long`. Latency of
    the rounds that started while that OpenSession was in flight, and of the rounds before it (idle)."""
    draft = [short[0][0]] * K
    async with channel(verify_addr) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        sampling = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=4000)
        ids = [(await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=p, sampling=sampling))).session_id
               for p in short]
        rounds: list[tuple[float, float]] = []  # (start, end) of every round
        stop = asyncio.Event()

        async def loop(session_id: str) -> None:
            while not stop.is_set():
                start = time.perf_counter()
                await stub.Verify(verify_pb2.VerifyRequest(session_id=session_id, draft_token_ids=draft))
                rounds.append((start, time.perf_counter()))

        loops = [asyncio.create_task(loop(i)) for i in ids]
        await asyncio.sleep(IDLE_S)
        open_start = time.perf_counter()
        response = await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=long, sampling=sampling))
        open_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*loops)
        for session_id in [*ids, response.session_id]:
            await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id))
    idle = [(e - s) * 1e3 for s, e in rounds if e < open_start]
    during = [(e - s) * 1e3 for s, e in rounds if open_start <= s < open_end]
    return {"open_ms": (open_end - open_start) * 1e3, "rounds_during": len(during),
            "p50_ms": percentile(during, 50), "p99_ms": percentile(during, 99), "max_ms": max(during),
            "idle_p50_ms": percentile(idle, 50)}


def prefill_scenario(services: BackgroundServices, folder: str, tokenizer, chunked_addr: str) -> dict:
    """The same scenario against a Verify service that prefills in one forward and one that chunks
    (`chunked_addr`, default options), same model, one after the other."""
    unchunked = services.start(create_verify(VerifyOptions(model=folder, port=0, batch_window_ms=2.0, prefill_chunk_tokens=0)))
    small = services.start(create_verify(VerifyOptions(model=folder, port=0, batch_window_ms=2.0, prefill_chunk_tokens=128)))
    short, long = prompts(tokenizer, PREFILL_SESSIONS), long_prompt(tokenizer, PREFILL_PROMPT_TOKENS)
    out = {"prompt_tokens": len(long), "sessions": PREFILL_SESSIONS, "k": K, "rows": []}
    for chunk_tokens, addr in ((0, f"127.0.0.1:{unchunked.port}"), (128, f"127.0.0.1:{small.port}"),
                               (VerifyOptions().prefill_chunk_tokens, chunked_addr)):
        row = {"prefill_chunk_tokens": chunk_tokens, **asyncio.run(prefill_interleave(addr, short, long))}
        out["rows"].append(row)
        print(f"prefill_chunk_tokens={chunk_tokens}: {len(long)}-token OpenSession {row['open_ms'] / 1e3:.1f} s; "
              f"other sessions' rounds meanwhile p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms "
              f"({row['rounds_during']} rounds; idle p50 {row['idle_p50_ms']:.0f} ms)", flush=True)
    services.stop(unchunked)
    services.stop(small)
    return out


async def throughput(draft_addr: str, verify_addr: str, batch: list[list[int]], concurrency: int) -> dict:
    """Run `batch` in waves of `concurrency` sessions; every level gets the same prompt mix (so 1
    session runs the mix one after another), so only the concurrency differs between rows."""
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    results = []
    for first in range(0, len(batch), concurrency):
        wave = batch[first:first + concurrency]
        results += await asyncio.gather(*(wire_generation(draft_addr, verify_addr, p, params, K) for p in wave))
    wall_s = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    return {"sessions": concurrency, "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
            "mean_accepted_length": statistics.mean(r.stats.mean_accepted_length for r in results)}


def wire_overhead(draft_addr: str, verify_addr: str, engine, prompt: list[int], repeats: int = 3) -> dict:
    """One session, the same generation over gRPC (Draft + Verify services) and with the in-process
    loop on the Verify service's own engine: what the wire and the services add per round."""
    from specmesh.decoding.adaptive import FixedK
    from specmesh.decoding.speculative import generate
    from specmesh.decoding.verifier import TargetVerifier
    from specmesh.drafters.ngram import PromptLookupDrafter

    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    wire_ms, local_ms, rounds = [], [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        result = asyncio.run(wire_generation(draft_addr, verify_addr, prompt, params, K))
        wire_ms.append((time.perf_counter() - start) * 1e3)
        rounds = result.num_rounds
        start = time.perf_counter()
        generate(TargetVerifier(engine), PromptLookupDrafter(), prompt, params, k_policy=FixedK(K))
        local_ms.append((time.perf_counter() - start) * 1e3)
    wire, local = statistics.median(wire_ms), statistics.median(local_ms)
    return {"wire_ms": wire, "in_process_ms": local, "rounds": rounds, "overhead_ms_per_round": (wire - local) / max(1, rounds)}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from specmesh.models.resolve import resolve_model_spec

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill-scenario", action="store_true",
                        help="run only the long-prefill scenario; keep the other results of the last run")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    folder = str(resolve_model_spec("default"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    results = ROOT / "bench" / "results"
    out = {"model": "default (SmolLM2-135M-Instruct)", "device": "cpu", "k": K, "max_new_tokens": MAX_NEW_TOKENS,
           "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads()}
    if args.prefill_scenario and (results / "services.json").exists():
        out = {**json.loads((results / "services.json").read_text()), **out}
    with BackgroundServices() as services:
        verify = services.start(create_verify(VerifyOptions(model=folder, port=0, batch_window_ms=2.0)))
        v_addr = f"127.0.0.1:{verify.port}"
        if not args.prefill_scenario:
            run_main_scenarios(services, folder, tokenizer, verify, out)
        if not os.environ.get("SPECMESH_BENCH_SKIP_PREFILL"):  # (before/after runs of the other scenarios)
            out["prefill"] = prefill_scenario(services, folder, tokenizer, v_addr)
    results.mkdir(parents=True, exist_ok=True)
    (results / "services.json").write_text(json.dumps(out, indent=2))
    text = render_markdown(out)
    (results / "services.md").write_text(text)
    print(text)
    return 0


def run_main_scenarios(services: BackgroundServices, folder: str, tokenizer, verify, out: dict) -> None:
    """Throughput at each concurrency, wire overhead, bytes per round: into `out`."""
    ngram = services.start(create_draft(DraftOptions(model=folder, drafter="ngram", port=0)))
    model_draft = services.start(create_draft(DraftOptions(model=folder, drafter="model", port=0)))
    v_addr, n_addr, m_addr = (f"127.0.0.1:{h.port}" for h in (verify, ngram, model_draft))
    engine = verify.servicer.engine
    asyncio.run(throughput(n_addr, v_addr, prompts(tokenizer, 1), 1))  # warm-up
    rows = []
    for n in CONCURRENCY:
        forwards_before = engine.stats.num_forwards
        row = asyncio.run(throughput(n_addr, v_addr, prompts(tokenizer, max(n, len(TEXTS))), n))
        row["target_forwards"] = engine.stats.num_forwards - forwards_before
        rows.append(row)
        print(f"{n:>3} sessions: {row['tokens_per_s']:.1f} tok/s ({row['target_forwards']} forwards)", flush=True)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_1"] = row["tokens_per_s"] / base
    out["throughput"] = rows

    prompt = prompts(tokenizer, 1)[0]
    out["wire_overhead"] = wire_overhead(n_addr, v_addr, engine, prompt)
    print(f"one session, same tokens: over gRPC {out['wire_overhead']['wire_ms']:.0f} ms, "
          f"in-process {out['wire_overhead']['in_process_ms']:.0f} ms", flush=True)

    wire = []
    cases = [("greedy, n-gram drafts", n_addr, dict(temperature=0.0), {}),
             ("sampling, q dense fp32", m_addr, dict(temperature=0.8, top_k=50, seed=3), dict(q_dtype="float32")),
             ("sampling, q dense fp16", m_addr, dict(temperature=0.8, top_k=50, seed=3), dict(q_dtype="float16")),
             ("sampling, q sparse fp32 (top_k=50)", m_addr, dict(temperature=0.8, top_k=50, seed=3), dict(q_dtype="float32", sparse_q=True)),
             ("sampling, q sparse fp16 (top_k=50)", m_addr, dict(temperature=0.8, top_k=50, seed=3), dict(q_dtype="float16", sparse_q=True))]
    for name, addr, sampling, kwargs in cases:
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, **sampling)
        result = asyncio.run(wire_generation(addr, v_addr, prompt, params, K, **kwargs))
        per_round = statistics.mean(result.bytes_per_round)
        wire.append({"case": name, "rounds": result.num_rounds, "bytes_per_round": per_round})
        print(f"{name}: {per_round:,.0f} bytes/round", flush=True)
    out["wire_bytes"] = wire
    services.stop(ngram)
    services.stop(model_draft)


def render_markdown(out: dict) -> str:
    lines = ["# Services benchmark", ""]
    if "throughput" in out:
        lines += [f"Model {out['model']}, CPU ({out['torch_threads']} torch threads), "
                  f"k = {K}, {MAX_NEW_TOKENS} new tokens per session, greedy, n-gram drafts over the wire. Every row runs the "
                  f"same {max(max(CONCURRENCY), len(TEXTS))}-or-fewer prompt mix ({len(TEXTS)} texts cycled) in waves of "
                  f"`sessions` concurrent sessions, so only the concurrency differs.", "",
                  "| sessions | tokens/s | speedup vs 1 | target forwards | mean accepted length |", "|---|---|---|---|---|"]
        lines += [f"| {r['sessions']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_1']:.2f}x | {r['target_forwards']} | "
                  f"{r['mean_accepted_length']:.2f} |" for r in out["throughput"]]
    if "wire_overhead" in out:
        o = out["wire_overhead"]
        lines += ["", f"One session, the same {MAX_NEW_TOKENS} tokens, medians of 3: over gRPC {o['wire_ms']:.0f} ms, in-process "
                  f"loop on the same engine {o['in_process_ms']:.0f} ms ({o['rounds']} rounds): "
                  f"{o['overhead_ms_per_round']:.1f} ms per round for the wire and the services."]
    if "wire_bytes" in out:
        lines += ["", "Bytes on the wire per round (Propose + Verify, requests and responses, k = 4, vocab 49152):", "",
                  "| case | bytes / round |", "|---|---|"]
        lines += [f"| {w['case']} | {w['bytes_per_round']:,.0f} |" for w in out["wire_bytes"]]
    if "prefill" in out:
        p = out["prefill"]
        lines += ["", f"A long prompt beside running sessions: {p['sessions']} sessions run Verify rounds back to back "
                  f"(k = {p['k']}, greedy) while one more session opens a {p['prompt_tokens']:,}-token prompt. Latency of "
                  "their rounds that started while that OpenSession was in flight (`prefill_chunk_tokens` = 0: the prefill "
                  "is one engine job and a round waits for all of it; chunked: rounds run between the chunks, so a round "
                  "waits for about one chunk), same model, same run "
                  f"({out.get('torch_threads', '?')} torch threads):", "",
                  "| prefill_chunk_tokens | long OpenSession | rounds meanwhile | round p50 | round p99 | round max | "
                  "round p50 with no prefill |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['prefill_chunk_tokens']} | {r['open_ms'] / 1e3:.1f} s | {r['rounds_during']} | {r['p50_ms']:,.0f} ms | "
                  f"{r['p99_ms']:,.0f} ms | {r['max_ms']:,.0f} ms | {r['idle_p50_ms']:,.0f} ms |" for r in p["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
