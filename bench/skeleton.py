"""Skeleton-of-Thought benchmark: a 4-point answer with its branches batched vs the same tokens decoded
one after another, through a Verify service and a Coordinator (default model, CPU, greedy).

Scenarios, each through the coordinator's Generate stream (client-side wall time):
- SoT, target only / SoT, n-gram drafts: a fixed plan of 4 independent points (forced whole with
  `skeleton_prefix`, so the skeleton is its prompt's prefill and one EOS: SmolLM2-135M copies the
  prompt's example plan, dependencies included, which chains its points); the 4 branches are forked
  from the skeleton session and decoded side by side (max_parallel 4), in each branch layout:
  batching (a sequence per branch, rows of one forward) and one_sequence (regions of one sequence,
  one attention row per round). Both layouts must give the same tokens (checked).
- sequential branches: the same 4 point prompts decoded one after another as plain requests (chat
  messages: each prompt prefilled), target only / n-gram: the same tokens (greedy), checked.
- plain answer: the question alone decoded with max_new_tokens = the SoT answer's branch tokens
  (ignore_eos), target only / n-gram: "the same number of tokens, sequentially".
- the model's own plan: "[PLAN]\\n" forced, the rest written by the model under the grammar, n-gram
  drafts: what a real request costs with this small model (its plan, its dependencies, its time).

    .venv/bin/python bench/skeleton.py        # ~3 minutes on 2 CPU cores; writes bench/results/skeleton.{json,md}
    SPECMESH_BENCH_QUESTION=groceries .venv/bin/python bench/skeleton.py   # a second question -> skeleton_groceries.*

The Verify service and the Coordinator run as two processes, started as `make run-cluster` starts
them (client.cluster.Cluster); medians of REPEATS, scenarios interleaved. One machine, one run: the
ratios are what this run measured. Each SoT run also counts, from the Verify service's /metrics, its
engine's forwards, the sequences in them (its branches' rounds batched together, or split into
groups) and their attention rows; the load average is recorded (other jobs slow every scenario).
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.cluster import Cluster  # noqa: E402
from client.health import metric_values  # noqa: E402
from servicekit.channels import open_channel as channel  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from specmesh.skeleton.automaton import SkeletonFormat  # noqa: E402
from specmesh.skeleton.parse import parse_skeleton  # noqa: E402
from specmesh.skeleton.prompts import point_messages  # noqa: E402
from specmesh.skeleton.types import Skeleton  # noqa: E402

THREADS = int(os.environ.get("SPECMESH_BENCH_THREADS", "2"))
REPEATS = int(os.environ.get("SPECMESH_BENCH_REPEATS", "3"))
MAX_NEW_TOKENS = 96  # per branch
QUESTIONS = {  # SPECMESH_BENCH_QUESTION picks one; results go to skeleton.{md,json}, or skeleton_<name>.{md,json}
    "sleep": ("What are some tips for better sleep?",
              "[PLAN]\n1.<80><None>[-]Keep a regular schedule\n2.<80><None>[-]Make the bedroom dark and quiet\n"
              "3.<80><None>[-]Limit caffeine and screens\n4.<80><None>[-]Relax before bed\n[END]"),
    "groceries": ("How can I save money on groceries?",
                  "[PLAN]\n1.<80><None>[-]Plan meals and make a list\n2.<80><None>[-]Buy store brands\n"
                  "3.<80><None>[-]Cook at home in batches\n4.<80><None>[-]Use sales and coupons\n[END]"),
}
QUESTION_NAME = os.environ.get("SPECMESH_BENCH_QUESTION", "sleep")
QUESTION, PLAN = QUESTIONS[QUESTION_NAME]
FORMAT = SkeletonFormat(max_points=8)  # the coordinator's default skeleton_max_points
MODES = {"sot": coordinator_pb2.GENERATION_MODE_SKELETON, "ar": coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE,
         "spec": coordinator_pb2.GENERATION_MODE_SPECULATIVE}


def chat(messages: list[dict[str, str]]) -> coordinator_pb2.ChatMessages:
    return coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                  for m in messages])


async def run(address: str, request: coordinator_pb2.GenerateRequest) -> dict:
    """One request: wall time, tokens per branch, the last message."""
    async with channel(address) as ch:
        start = time.perf_counter()
        tokens: dict[int, list[int]] = {}
        texts: dict[int, str] = {}
        last = None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=900):
            tokens.setdefault(response.branch_id, []).extend(response.token_ids)
            texts[response.branch_id] = texts.get(response.branch_id, "") + response.text
            last = response
        return {"wall_s": time.perf_counter() - start, "tokens": tokens, "texts": texts, "last": last}


LAYOUTS = {"batching": common_pb2.BRANCH_LAYOUT_BATCHING, "one_sequence": common_pb2.BRANCH_LAYOUT_ONE_SEQUENCE}


def sot_request(prefix: str, drafter: str, layout: str = "batching") -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        chat=chat([{"role": "user", "content": QUESTION}]), mode=MODES["sot"], drafter=drafter, skeleton_prefix=prefix,
        max_parallel=4, sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS),
        skeleton_layout=LAYOUTS[layout])


def plain_request(messages: list[dict[str, str]], drafter: str, max_new_tokens: int, ignore_eos: bool = False):
    return coordinator_pb2.GenerateRequest(
        chat=chat(messages), mode=MODES["spec"] if drafter == "ngram" else MODES["ar"], drafter=drafter,
        sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))


def engine_counts(metrics_url: str) -> tuple[int, ...]:
    """(forwards, sequences forwarded, attention rows) of the Verify service's engine so far (its /metrics)."""
    values = metric_values(metrics_url)
    return tuple(int(values["specmesh_engine_" + name]) for name in ("forwards", "sequences_forwarded", "attention_rows"))


async def counted(address: str, request: coordinator_pb2.GenerateRequest, metrics_url: str) -> dict:
    """`run`, with the engine's forwards, sequences and rows during it (the only request running)."""
    before = engine_counts(metrics_url)
    result = await run(address, request)
    result["forwards"], result["sequences"], result["rows"] = (a - b for a, b in zip(engine_counts(metrics_url), before))
    return result


def sot_summary(result: dict) -> dict:
    last = result["last"]
    branches = [{"point_id": b.point_id, "title": b.title, "tokens": b.num_tokens, "rounds": b.num_rounds,
                 "wall_ms": round(b.wall_ms, 1), "start_ms": round(b.start_ms, 1)} for b in last.skeleton.branches]
    branch_tokens = [b["tokens"] for b in branches]
    return {
        "wall_s": result["wall_s"], "skeleton_ms": last.skeleton.skeleton_ms, "branches_ms": last.skeleton.branches_ms,
        "skeleton_share": last.skeleton.skeleton_ms / 1e3 / result["wall_s"],
        "num_skeleton_tokens": last.skeleton.num_skeleton_tokens, "branch_tokens": branch_tokens,
        "generated_tokens": last.stats.num_generated_tokens, "tokens_per_s": last.stats.num_generated_tokens / result["wall_s"],
        "mean_accepted_length": last.stats.mean_accepted_length, "estimate": last.skeleton.parallel_speedup_estimate,
        "prefilled_branches": last.skeleton.num_prefilled_branches, "branches": branches,
        "plan": result["texts"].get(0, ""), "direct_reason": last.skeleton.direct_reason,
        "forwards": result.get("forwards", 0), "sequences": result.get("sequences", 0), "rows": result.get("rows", 0),
        "tokens": {str(k): v for k, v in result["tokens"].items() if k > 0},
    }


async def sequential_branches(address: str, drafter: str, skeleton: Skeleton, sot: dict) -> dict:
    """The SoT answer's point prompts, one after another; their tokens must equal the SoT branches'."""
    start = time.perf_counter()
    generated, same = 0, True
    for point in skeleton.points:
        messages = point_messages(QUESTION, PLAN, point, (), (), FORMAT)
        result = await run(address, plain_request(messages, drafter, MAX_NEW_TOKENS))
        generated += len(result["tokens"][-1])
        same &= result["tokens"][-1] == sot["tokens"][point.id]
    wall_s = time.perf_counter() - start
    return {"wall_s": wall_s, "generated_tokens": generated, "tokens_per_s": generated / wall_s, "same_tokens_as_sot": same}


async def plain_answer(address: str, drafter: str, num_tokens: int) -> dict:
    result = await run(address, plain_request([{"role": "user", "content": QUESTION}], drafter, num_tokens, ignore_eos=True))
    generated = len(result["tokens"][-1])
    return {"wall_s": result["wall_s"], "generated_tokens": generated, "tokens_per_s": generated / result["wall_s"],
            "mean_accepted_length": result["last"].stats.mean_accepted_length}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


async def scenarios(address: str, metrics_url: str) -> dict:
    skeleton = parse_skeleton(PLAN)
    assert isinstance(skeleton, Skeleton)
    runs: dict[str, list[dict]] = {}
    load = [os.getloadavg()[0]]
    await run(address, sot_request(PLAN, "ngram"))  # warm-up: the grammar compiles, the first forwards settle
    for _ in range(REPEATS):
        for drafter in ("none", "ngram"):
            one = sot_summary(await counted(address, sot_request(PLAN, drafter, "one_sequence"), metrics_url))
            runs.setdefault(f"sot_{drafter}_one_sequence", []).append(one)
            sot = await counted(address, sot_request(PLAN, drafter), metrics_url)
            runs.setdefault(f"sot_{drafter}", []).append(sot_summary(sot))
            one["same_tokens_as_batching"] = one.pop("tokens") == runs[f"sot_{drafter}"][-1].pop("tokens")
            runs.setdefault(f"sequential_{drafter}", []).append(await sequential_branches(address, drafter, skeleton, sot))
            num_tokens = sum(sot_summary(sot)["branch_tokens"])
            runs.setdefault(f"plain_{drafter}", []).append(await plain_answer(address, drafter, num_tokens))
        load.append(os.getloadavg()[0])
    own = sot_summary(await counted(address, sot_request("[PLAN]\n", "ngram"), metrics_url))
    own.pop("tokens")
    return {"runs": runs, "own_plan": own, "load_average_1min": load}


def render(out: dict) -> str:
    runs = out["runs"]
    med = {name: {key: median_of(rs, key) for key in ("wall_s", "tokens_per_s")} for name, rs in runs.items()}
    sot_none, sot_ngram = runs["sot_none"], runs["sot_ngram"]
    lines = [
        "# Skeleton-of-Thought benchmark",
        "",
        f"`.venv/bin/python bench/skeleton.py`: model default (SmolLM2-135M-Instruct, float32), CPU ({out['machine']}, "
        f"{out['cpus']} cores), {out['threads']} torch threads, a Verify service and a Coordinator as two processes (as run-cluster starts them); greedy; "
        f"question \"{QUESTION}\"; a fixed plan of 4 independent points (forced whole), at most {MAX_NEW_TOKENS} tokens "
        f"per branch, max_parallel 4; medians of {REPEATS} runs, scenarios interleaved. Load average (1 min) during "
        f"the run: {min(out['load_average_1min']):.1f}-{max(out['load_average_1min']):.1f} on {out['cpus']} cores "
        "(other jobs on the machine slow every scenario).",
        "",
        "## A 4-point answer: branches batched vs the same tokens one after another",
        "",
        "| scenario | wall s | tokens | tokens/s | vs SoT target-only |",
        "|---|---|---|---|---|",
    ]
    rows = [("SoT, target-only branches (batching layout)", "sot_none"),
            ("SoT, target-only branches (one-sequence layout)", "sot_none_one_sequence"),
            ("SoT, n-gram speculative branches (batching layout)", "sot_ngram"),
            ("SoT, n-gram speculative branches (one-sequence layout)", "sot_ngram_one_sequence"),
            ("sequential branches, target only (same tokens)", "sequential_none"),
            ("sequential branches, n-gram (same tokens)", "sequential_ngram"),
            ("plain answer, target only (same number of tokens)", "plain_none"),
            ("plain answer, n-gram (same number of tokens)", "plain_ngram")]
    for label, name in rows:
        tokens = median_of(runs[name], "generated_tokens")
        lines.append(f"| {label} | {med[name]['wall_s']:.2f} | {tokens:.0f} | {med[name]['tokens_per_s']:.1f} | "
                     f"{med[name]['wall_s'] / med['sot_none']['wall_s']:.2f}x |")
    speedups = {
        "SoT target-only vs sequential branches target-only": med["sequential_none"]["wall_s"] / med["sot_none"]["wall_s"],
        "SoT target-only, one-sequence layout, vs sequential branches target-only":
            med["sequential_none"]["wall_s"] / med["sot_none_one_sequence"]["wall_s"],
        "SoT target-only vs plain answer target-only": med["plain_none"]["wall_s"] / med["sot_none"]["wall_s"],
        "SoT n-gram vs sequential branches n-gram": med["sequential_ngram"]["wall_s"] / med["sot_ngram"]["wall_s"],
        "SoT n-gram, one-sequence layout, vs sequential branches n-gram":
            med["sequential_ngram"]["wall_s"] / med["sot_ngram_one_sequence"]["wall_s"],
        "SoT n-gram vs plain answer target-only (SoT + speculation vs plain decoding)":
            med["plain_none"]["wall_s"] / med["sot_ngram"]["wall_s"],
        "SoT n-gram vs plain answer n-gram": med["plain_ngram"]["wall_s"] / med["sot_ngram"]["wall_s"],
    }
    out["speedups"] = speedups
    lines += ["", "| speedup (latency ratio) | measured |", "|---|---|"]
    lines += [f"| {name} | {value:.2f}x |" for name, value in speedups.items()]
    lines += ["", "SoT runs in detail (the first run of each):", "",
              "| SoT run | skeleton ms | skeleton share | branch tokens | branch wall ms | mean accepted length | "
              "stats' speedup bound | prefilled branches | target forwards | sequences per forward | attention rows per forward |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, rs in (("target-only branches", sot_none), ("target-only branches, one sequence", runs["sot_none_one_sequence"]),
                      ("n-gram branches", sot_ngram), ("n-gram branches, one sequence", runs["sot_ngram_one_sequence"]),
                      ("model's own plan, n-gram", [out["own_plan"]])):
        r = rs[0]
        lines.append(f"| {label} | {r['skeleton_ms']:.0f} | {r['skeleton_share']:.0%} | {r['branch_tokens']} | "
                     f"{[b['wall_ms'] for b in r['branches']]} | {r['mean_accepted_length']:.2f} | {r['estimate']:.2f}x | "
                     f"{r['prefilled_branches']} | {r['forwards']} | {r['sequences'] / max(1, r['forwards']):.2f} | "
                     f"{r['rows'] / max(1, r['forwards']):.2f} |")
    own = out["own_plan"]
    spread = sot_none[0]["branch_tokens"]
    # a target-only round emits one token per sequence: the plain answer's ms per forward (1 sequence)
    # against the SoT branch phase's ms per round of its longest branch (up to 4 sequences per forward)
    plain_round_ms = statistics.median(r["wall_s"] * 1e3 / r["generated_tokens"] for r in runs["plain_none"])
    sot_round_ms = statistics.median(r["branches_ms"] / max(b["rounds"] for b in r["branches"]) for r in sot_none)
    one_round_ms = statistics.median(r["branches_ms"] / max(b["rounds"] for b in r["branches"])
                                     for r in runs["sot_none_one_sequence"])
    out["round_ms"] = {"plain_target_only": plain_round_ms, "sot_target_only_branch_phase": sot_round_ms,
                       "sot_target_only_branch_phase_one_sequence": one_round_ms}
    lines += [
        "",
        f"Branch length spread (fixed plan, target only): {min(spread)}-{max(spread)} tokens (cap {MAX_NEW_TOKENS}). "
        f"Sequential branches produced the same tokens as the SoT branches: "
        f"{all(r['same_tokens_as_sot'] for name in ('sequential_none', 'sequential_ngram') for r in runs[name])}. "
        "The one-sequence layout produced the same tokens as the batching layout: "
        f"{all(r['same_tokens_as_batching'] for name in ('sot_none_one_sequence', 'sot_ngram_one_sequence') for r in runs[name])}.",
        "",
        "The model's own plan (\"[PLAN]\\n\" forced, the rest written under the grammar):",
        "",
        "```",
        own["plan"].strip(),
        "```",
        "",
        f"{own['direct_reason'] or 'parsed'}; {own['wall_s']:.1f} s in all, skeleton {own['skeleton_ms'] / 1e3:.1f} s "
        f"({own['skeleton_share']:.0%}), branch tokens {own['branch_tokens']}, start times (ms) "
        f"{[b['start_ms'] for b in own['branches']]}: its dependencies decide how many branches run at once.",
        "",
        f"Reading: a target-only round cost {plain_round_ms:.0f} ms with one sequence (plain answer, wall per token) and "
        f"{sot_round_ms:.0f} ms in the SoT branch phase (its wall over its longest branch's rounds, 2-4 sequences per "
        f"forward; {one_round_ms:.0f} ms in the one-sequence layout): batching is not free on 2 CPU cores, and the answer's length is set by its longest branch "
        f"({max(spread)} of {sum(spread)} tokens), so the ideal gain over the plain answer here is "
        f"{sum(spread) / max(spread):.2f}x. The target-only SoT run took {sot_none[0]['forwards']} target forwards "
        f"for its longest branch's {max(b['rounds'] for b in sot_none[0]['branches'])} rounds, the plan's prefill "
        "and 4 forks: the branches' rounds leave the coordinator together (a round gate), so each round is one "
        "forward of every running branch (a round that missed the Verify batcher's 2 ms window would ride in a "
        "forward of its own). The fixed plan's skeleton is only its prompt's "
        "prefill; a plan the model writes adds its tokens as sequential time before any branch starts, and its "
        "dependencies serialize branches. Sequential branches prefill each point prompt again; SoT forks them "
        "from the skeleton session and feeds only each prompt's tail (4 forks, one forward each, before the "
        "branches' first round). The stats' speedup bound is (skeleton + the sum of the branch wall times) / "
        "total: an upper bound, above the measured gains.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    folder = str(resolve_model_spec("default"))
    out: dict = {"model": "default (SmolLM2-135M-Instruct)", "machine": platform.processor() or platform.machine(),
                 "cpus": os.cpu_count(), "threads": THREADS, "repeats": REPEATS, "max_new_tokens_per_branch": MAX_NEW_TOKENS,
                 "question": QUESTION, "plan": PLAN}
    config = {"defaults": {"device": "cpu", "host": "127.0.0.1"}, "services": {
        "verify": {"kind": "verify", "model": folder, "port": 0, "dtype": "float32", "torch_threads": THREADS, "metrics_port": 0},
        "coordinator": {"kind": "coordinator", "port": 0, "default_drafter": "ngram"}}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_text(yaml.safe_dump(config))
        with Cluster.from_yaml(path, log_dir=tmp) as cluster:
            verify = next(spec for spec in cluster.specs if spec.kind == "verify")
            metrics_url = f"http://127.0.0.1:{verify.options['metrics_port']}/metrics"
            out.update(asyncio.run(scenarios(cluster.addresses["coordinator"], metrics_url)))
    text = render(out)
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    stem = "skeleton" if QUESTION_NAME == "sleep" else f"skeleton_{QUESTION_NAME}"
    (results / f"{stem}.json").write_text(json.dumps(out, indent=2, default=str))
    (results / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
