"""Cluster benchmark: the Coordinator + Draft + Verify processes against the same algorithm in-process.

1. Overhead, one session (greedy, default model, CPU): wall time per token through the cluster
   (processes on loopback, started as `make run-cluster` starts them) over the in-process run of
   the same algorithm, for target-only decoding, n-gram drafts (made in the coordinator, or on the
   Verify service: speculative mode's default placement when it hosts that drafter) and a bf16
   self-draft (the Draft service; adaptive k, and k = 4 so both sides run the same rounds); with
   the per-round draft / verify time each side measured, so the RPC cost per round shows.
2. Aggregate tokens/s at 1, 4 and 16 concurrent clients through the coordinator: speculative with
   n-gram drafts (placed on the Verify service), the same with the drafts made in the coordinator
   (a second coordinator, `ngram_placement: coordinator`), and autoregressive: each client asks the
   prompts one after the other (the same work in every mode); the modes take turns,
   AGGREGATE_REPEATS times, and the medians are compared.

    .venv/bin/python bench/cluster.py            # ~15 minutes; writes bench/results/cluster.{json,md}
    SPECMESH_BENCH_PARTS=concurrency .venv/bin/python bench/cluster.py   # one part (overhead, concurrency)
Medians over prompts and repeats; ratios come from one run.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.cluster import Cluster  # noqa: E402
from servicekit.channels import open_channel as channel  # noqa: E402
from specmesh.decoding.adaptive import AdaptiveK, FixedK  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.drafters.model import self_draft  # noqa: E402
from specmesh.drafters.ngram import PromptLookupDrafter  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

THREADS = 2
MAX_NEW_TOKENS = 64
REPEATS = 2
PROMPTS = [
    "List the planets of the solar system in order, then list them again in reverse order.",
    "Write a Python function that adds two numbers, then one that subtracts them, then one that multiplies them.",
    "Explain how a rainbow forms.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
]
CONCURRENCY = (1, 4, 16)
CONCURRENT_NEW_TOKENS = 32
AGGREGATE_REPEATS = {1: 3, 4: 5, 16: 9}  # runs per mode; the loaded, noisiest row gets the most
SPEC, FUSED, AR = (coordinator_pb2.GENERATION_MODE_SPECULATIVE, coordinator_pb2.GENERATION_MODE_FUSED,
                   coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE)
HERE = "coordinator-ngram-here"  # a second coordinator, ngram_placement: coordinator (n-gram drafts made there)
# name: (in-process drafter kind, coordinator, mode, drafter, fixed k or 0 for adaptive k, in-process plain stretches)
ALGORITHMS = {
    "target only": ("none", "coordinator", AR, "", 0, False),
    "n-gram, drafted in the coordinator": ("ngram", HERE, SPEC, "ngram", 0, True),
    # speculative mode's default placement: the Verify service hosts the n-gram drafter and steps the
    # rounds itself (the fused mode's rounds; its own state, without plain stretches)
    "n-gram, on the Verify service (speculative mode)": ("ngram", "coordinator", SPEC, "ngram", 0, False),
    "bf16 self-draft, Draft service": ("bf16", "coordinator", SPEC, "service", 0, True),
    # adaptive k picks from the costs each side measures (an RPC's included), so the rounds differ;
    # a fixed k makes both sides run the same rounds, and the ratio is the wire's cost alone
    "bf16 self-draft, Draft service, k = 4": ("bf16", "coordinator", SPEC, "service", 4, True),
}


def cluster_config(folder: str) -> dict:
    common = {"model": folder, "port": 0, "torch_threads": THREADS}
    return {"defaults": {"device": "cpu", "host": "127.0.0.1"}, "services": {
        "draft": {"kind": "draft", "drafter": "model", "dtype": "bfloat16", **common},
        "verify": {"kind": "verify", "dtype": "float32", "fused_drafter": "ngram", **common},
        "coordinator": {"kind": "coordinator", "port": 0},
        HERE: {"kind": "coordinator", "port": 0, "ngram_placement": "coordinator"},
    }}


async def through_cluster(address: str, prompt: str, mode: int, drafter: str, max_new_tokens: int, k: int = 0, *,
                          cascade: str = "", cascade_lambda: float | None = None) -> dict:
    """One greedy chat request through the Coordinator at `address`, streamed to its end: its tokens, wall
    time and the final stats' round figures. `cascade` / `cascade_lambda`: the request's cascade fields."""
    request = coordinator_pb2.GenerateRequest(
        chat=coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role="user", content=prompt)]),
        mode=mode, drafter=drafter, num_draft_tokens=k, cascade=cascade,
        sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=max_new_tokens))
    if cascade_lambda is not None:
        request.cascade_lambda = cascade_lambda
    async with channel(address) as ch:
        start = time.perf_counter()
        tokens, stats = [], None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=600):
            tokens += response.token_ids
            if response.HasField("stats"):
                stats = response.stats
        wall = time.perf_counter() - start
    assert stats is not None
    rounds = max(1, stats.num_target_forwards - 1)
    return {"tokens": tokens, "wall_s": wall, "rounds": rounds, "drafted": stats.num_draft_tokens,
            "accepted": stats.num_accepted_tokens,
            "draft_ms_per_round": stats.draft_ms / rounds, "verify_ms_per_round": stats.verify_ms / rounds}


def in_process(verifier: TargetVerifier, drafter, ids: list[int], k: int = 0, plain_stretches: bool = False) -> dict:
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS)
    start = time.perf_counter()
    k_policy = None if drafter is None else FixedK(k) if k else AdaptiveK()
    result = generate(verifier, drafter, ids, params, k_policy=k_policy, plain_stretches=plain_stretches)
    wall = time.perf_counter() - start
    rounds = max(1, result.stats.num_target_forwards - 1)
    return {"tokens": result.token_ids, "wall_s": wall, "rounds": rounds,
            "draft_ms_per_round": result.stats.draft_ms / rounds, "verify_ms_per_round": result.stats.verify_ms / rounds}


def default_pair(threads: int = THREADS):
    """The default model's folder, tokenizer, fp32 target verifier and bf16 engine (its self-draft's), on `threads`."""
    from transformers import AutoTokenizer

    folder = str(resolve_model_spec("default"))
    torch.set_num_threads(threads)
    return folder, AutoTokenizer.from_pretrained(folder), TargetVerifier(load_engine(folder, dtype="float32")), \
        load_engine(folder, dtype="bfloat16")


def overhead(addresses: dict[str, str], folder: str, tokenizer) -> list[dict]:
    torch.set_num_threads(THREADS)
    verifier = TargetVerifier(load_engine(folder, dtype="float32"))
    bf16 = load_engine(folder, dtype="bfloat16")
    drafters = {"none": lambda: None, "ngram": lambda: PromptLookupDrafter(min_n=1, max_n=4), "bf16": lambda: self_draft(bf16, verifier.engine)}
    rows = []
    for name, (kind, coordinator, mode, drafter, k, stretches) in ALGORITHMS.items():
        local, remote, exact = [], [], True
        address = addresses[coordinator]
        asyncio.run(through_cluster(address, PROMPTS[0], mode, drafter, 8, k))  # warm-up (kernels, caches)
        for _ in range(REPEATS):
            for prompt in PROMPTS:
                ids = chat_prompt_ids(tokenizer, prompt)
                # speculative requests drafted away from the Verify service run plain stretches (Verify.Run);
                # the same rule in-process
                a = in_process(verifier, drafters[kind](), ids, k, plain_stretches=stretches)
                b = asyncio.run(through_cluster(address, prompt, mode, drafter, MAX_NEW_TOKENS, k))
                exact &= a["tokens"] == b["tokens"]
                local.append(a)
                remote.append(b)

        def per_token_ms(runs: list[dict]) -> float:
            return statistics.median(r["wall_s"] * 1e3 / max(1, len(r["tokens"])) for r in runs)

        def median(runs: list[dict], key: str) -> float:
            return statistics.median(r[key] for r in runs)

        rows.append({
            "algorithm": name, "exact": exact,
            "in_process_ms_per_token": per_token_ms(local), "cluster_ms_per_token": per_token_ms(remote),
            "ratio": per_token_ms(remote) / per_token_ms(local),
            "in_process_tokens_per_round": statistics.median(len(r["tokens"]) / r["rounds"] for r in local),
            "cluster_tokens_per_round": statistics.median(len(r["tokens"]) / r["rounds"] for r in remote),
            "in_process_draft_ms_per_round": median(local, "draft_ms_per_round"),
            "in_process_verify_ms_per_round": median(local, "verify_ms_per_round"),
            "cluster_draft_ms_per_round": median(remote, "draft_ms_per_round"),
            "cluster_verify_ms_per_round": median(remote, "verify_ms_per_round"),
        })
        print(f"  {name}: cluster / in-process = {rows[-1]['ratio']:.3f}, exact {exact}", flush=True)
    return rows


async def concurrent(address: str, n: int, mode: int, drafter: str, outputs: bool = False) -> dict:
    """n clients, each asking every prompt in turn (client i starts at prompt i); with `outputs`, also
    each request's tokens by its prompt (client i's prompts end in " (i)")."""
    async def client(i: int) -> list[dict]:
        runs = []
        for j in range(len(PROMPTS)):
            prompt = PROMPTS[(i + j) % len(PROMPTS)] + f" ({i})"
            runs.append({**await through_cluster(address, prompt, mode, drafter, CONCURRENT_NEW_TOKENS), "prompt": prompt})
        return runs

    start = time.perf_counter()
    results = [r for runs in await asyncio.gather(*(client(i) for i in range(n))) for r in runs]
    wall = time.perf_counter() - start
    tokens = sum(len(r["tokens"]) for r in results)
    out = {"clients": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
           "drafted_per_round": sum(r["drafted"] for r in results) / sum(r["rounds"] for r in results),
           "acceptance": sum(r["accepted"] for r in results) / max(1, sum(r["drafted"] for r in results))}
    if outputs:
        out["outputs"] = {r["prompt"]: r["tokens"] for r in results}
    return out


def aggregate(addresses: dict[str, str]) -> list[dict]:
    """The modes take turns (which goes first alternates too); medians."""
    modes = {"speculative": ("coordinator", SPEC, "ngram"),  # n-gram drafts on the Verify service (default placement)
             "coordinator_ngram": (HERE, SPEC, "ngram"),  # n-gram drafts made in the coordinator
             "autoregressive": ("coordinator", AR, "")}
    rows = []
    for n in CONCURRENCY:
        runs: dict[str, list[dict]] = {name: [] for name in modes}
        for repeat in range(AGGREGATE_REPEATS[n]):
            for name in (list(modes) if repeat % 2 == 0 else list(modes)[::-1]):
                coordinator, mode, drafter = modes[name]
                runs[name].append(asyncio.run(concurrent(addresses[coordinator], n, mode, drafter)))
        row = {"clients": n, "runs": runs}
        for name in modes:
            row[name] = statistics.median(r["tokens_per_s"] for r in runs[name])
        for name in ("speculative", "coordinator_ngram"):
            row[f"{name}_drafted_per_round"] = statistics.median(r["drafted_per_round"] for r in runs[name])
            row[f"{name}_acceptance"] = statistics.median(r["acceptance"] for r in runs[name])
        row["ratio"] = row["speculative"] / row["autoregressive"]
        row["coordinator_ngram_ratio"] = row["coordinator_ngram"] / row["autoregressive"]
        # runs of one repeat are close in time: their ratios show the noise between repeats
        row["paired_ratios"] = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["speculative"], runs["autoregressive"])]
        print(f"  {n} clients: speculative / autoregressive = {row['ratio']:.2f}, n-gram in the coordinator / "
              f"autoregressive = {row['coordinator_ngram_ratio']:.2f} ({row['speculative']:.1f} / "
              f"{row['coordinator_ngram']:.1f} / {row['autoregressive']:.1f} tok/s)", flush=True)
        rows.append(row)
    return rows


def render(out: dict) -> str:
    lines = [
        "# Cluster benchmark (Coordinator + Draft + Verify processes vs in-process)", "",
        f"`.venv/bin/python bench/cluster.py`: model {out['model']}, CPU ({out['machine']}), {THREADS} torch threads per "
        f"model process and in-process, greedy, {MAX_NEW_TOKENS} new tokens, {len(PROMPTS)} chat prompts x {REPEATS}; "
        "medians. Wall time per token includes the stream to the client.", "",
        "## Overhead, one session", "",
        "| algorithm | exact | in-process ms/token | cluster ms/token | cluster / in-process | tokens/round (in-process / cluster) | "
        "draft ms/round (in-process / cluster) | verify ms/round (in-process / cluster) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out.get("overhead", []):
        lines.append(f"| {r['algorithm']} | {r['exact']} | {r['in_process_ms_per_token']:.1f} | {r['cluster_ms_per_token']:.1f} | "
                     f"{r['ratio']:.3f} | {r['in_process_tokens_per_round']:.2f} / {r['cluster_tokens_per_round']:.2f} | "
                     f"{r['in_process_draft_ms_per_round']:.1f} / {r['cluster_draft_ms_per_round']:.1f} | "
                     f"{r['in_process_verify_ms_per_round']:.1f} / {r['cluster_verify_ms_per_round']:.1f} |")
    lines += ["", "Cluster draft / verify ms per round are measured by the coordinator around its RPCs (network, "
              "batching window and the services' queues included); in-process ones around the calls. Target-only and "
              "fused requests run on the Verify service's own rounds (Verify.Run, streamed: no round waits for a round "
              "trip), and their cluster verify ms per round is the time between rounds landing at the coordinator; "
              "so do speculative requests whose n-gram drafts are placed on the Verify service (the default when it "
              "hosts that drafter). With adaptive k each side picks k from the costs it measures (an RPC's included), "
              "so their rounds differ; the fixed-k row runs the same rounds on both sides. Speculative requests drafted "
              "away from the Verify service hand their plain stretches (rounds that accepted no draft token) to "
              "Verify.Run; in-process the same stretches are stepped one round at a time (generate(..., "
              "plain_stretches=True)), so the rounds match.", "",
              f"## Aggregate tokens/s through the coordinator ({CONCURRENT_NEW_TOKENS} new tokens per request)", "",
              f"Each client asks the {len(PROMPTS)} prompts in turn; the modes take turns (the order reversed every other "
              f"run), {', '.join(f'{r} runs each at {n} clients' for n, r in AGGREGATE_REPEATS.items())}; medians. Speculative: `--mode speculative --drafter ngram` as a user "
              "asks for it: the n-gram drafts are made on the Verify service, which hosts that drafter and steps the "
              "rounds itself (Verify.Run; fused mode runs the same rounds). N-gram in the coordinator: the same request "
              "to a coordinator with `ngram_placement: coordinator` (what runs when the Verify service hosts no n-gram "
              "drafter): a Verify call per round that may draft, and the plain stretches between (rounds that accepted "
              "nothing: 1, 2, 4, ... 16 rounds) as one bounded Verify.Run each. Drafted per round and acceptance: "
              "adaptive k's. Paired: speculative / autoregressive within each repeat (lowest, median, "
              "highest): the noise between repeats.", "",
              "| clients | speculative tok/s | n-gram in the coordinator tok/s | autoregressive tok/s | speculative / "
              "autoregressive | n-gram in the coordinator / autoregressive | drafted per round (speculative / in the "
              "coordinator) | acceptance (speculative / in the coordinator) | paired speculative / autoregressive |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in out.get("concurrency", []):
        pairs = row["paired_ratios"]
        lines.append(f"| {row['clients']} | {row['speculative']:.1f} | {row['coordinator_ngram']:.1f} | "
                     f"{row['autoregressive']:.1f} | {row['ratio']:.2f} | {row['coordinator_ngram_ratio']:.2f} | "
                     f"{row['speculative_drafted_per_round']:.2f} / {row['coordinator_ngram_drafted_per_round']:.2f} | "
                     f"{row['speculative_acceptance']:.2f} / {row['coordinator_ngram_acceptance']:.2f} | "
                     f"{min(pairs):.2f} / {statistics.median(pairs):.2f} / {max(pairs):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from transformers import AutoTokenizer

    parts = os.environ.get("SPECMESH_BENCH_PARTS", "overhead,concurrency").split(",")
    folder = str(resolve_model_spec("default"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out: dict = {"model": "default (SmolLM2-135M-Instruct)", "machine": platform.processor() or platform.machine()}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "cluster.yaml"
        config.write_text(yaml.safe_dump(cluster_config(folder)))
        with Cluster.from_yaml(config, log_dir=tmp) as cluster:
            addresses = cluster.addresses
            if "overhead" in parts:
                print("overhead, one session:", flush=True)
                out["overhead"] = overhead(addresses, folder, tokenizer)
            if "concurrency" in parts:
                print("aggregate tokens/s:", flush=True)
                out["concurrency"] = aggregate(addresses)
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "cluster.json").write_text(json.dumps(out, indent=2))
    text = render(out)
    (results / "cluster.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
