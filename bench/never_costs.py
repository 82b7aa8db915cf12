"""Speculation never costs: speculative decoding against our own plain decoding, prompt by prompt, on
prompts the draft gate, the plain stretches and the adaptive k policy were never tuned on.

    .venv/bin/python bench/never_costs.py [--runs 3] [--interleave rounds|requests] [--max-new-tokens 64] [--quick]

Default model (SmolLM2-135M-Instruct), greedy, EOS ignored (every run makes --max-new-tokens tokens),
time including the prefill, one process, the machine's threads. The prompts are
bench/prompts/held_out.json, a set kept apart for this bench (its "about" says so). Per target:
    fp32 target      plain | n-gram drafts (prompt lookup) | bf16 self-draft | int8 self-draft (dynamic) | q4_1 self-draft
    Q4_1 target      plain | n-gram drafts                  (the GGUF's own blocks, quantize="gguf")
every speculative method with the adaptive k policy and the draft gate, as a user's request runs (a
self-draft's policy starting from the acceptance of the requests before it, as in-process generation
and the Verify service's hosted drafters remember it; since 2026-11-29), and
plain decoding a second time (A/A): its ratio to the first is the bench's own noise.
--interleave rounds (the default): a prompt's requests on one target run together, one event (the
prefill, or a round: drafting, verifying, closing) of each in turn, and each request's time is the sum
of its own events, so all of them see the machine's speed of the same moments; requests: one whole
request after another, methods alternating (this shared VM drifts by 30% between two such requests).
Per prompt the median tok/s over --runs, and speculative / plain of the same target as the median over
runs of the run's own ratio. The report also gives plain decoding's spread from run to run per prompt.
The goal (issue 30): >= 0.97x on every prompt.
Every method's tokens must equal plain decoding's (greedy exactness); a mismatch is reported.
Writes bench/results/never_costs.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import cpu_model  # noqa: E402
from specmesh.decoding.adaptive import AcceptanceMemory, AdaptiveK  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate, speculative_stream  # noqa: E402
from specmesh.decoding.state import StepEvent  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.drafters.model import self_draft  # noqa: E402
from specmesh.drafters.ngram import PromptLookupDrafter  # noqa: E402
from specmesh.generator import load_self_draft  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.engine import measure_step  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PROMPTS_FILE = HERE / "prompts" / "held_out.json"
GOAL = 0.97


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="3 prompts, 1 run, 24 tokens (smoke run)")
    parser.add_argument("--interleave", choices=("rounds", "requests"), default="rounds",
                        help="rounds: a prompt's methods run together, one round of each in turn, each timed on its own "
                        "steps (the default: the machine's drift cancels); requests: one whole request after another")
    parser.add_argument("--note", default="", help="a line for the report (e.g. the machine's load)")
    parser.add_argument("--q4-runs", type=int, default=None, help="runs of the Q4_1 methods (default: --runs; fewer "
                        "where its kernel is slow, e.g. a build without the AVX2 or AVX-512 paths)")
    parser.add_argument("--q4-tokens", type=int, default=None, help="new tokens of the Q4_1 methods (default: "
                        "--max-new-tokens)")
    args = parser.parse_args()
    args.q4_runs = args.runs if args.q4_runs is None else args.q4_runs
    args.q4_tokens = args.max_new_tokens if args.q4_tokens is None else args.q4_tokens
    if args.quick:
        args.runs, args.max_new_tokens, args.q4_runs, args.q4_tokens = 1, 24, 1, 12
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    prompts = json.loads(PROMPTS_FILE.read_text())["prompts"][: 3 if args.quick else None]
    folder = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    fp32 = load_engine(folder, dtype="float32")
    q4 = load_engine(folder, dtype="float32", quantize="gguf")
    bf16 = load_engine(folder, dtype="bfloat16")
    int8 = load_engine(folder, dtype="float32", quantize="int8-dynamic")
    q4_1 = load_self_draft(folder, "q4_1")  # the library's q4_1 self-draft (requantized, where `q4` is the file's blocks)
    for engine in (fp32, q4, bf16, int8, q4_1):  # as `specmesh generate --local` does: the costs known before a first round
        measure_step(engine)
    targets = {"fp32": TargetVerifier(fp32), "Q4_1": TargetVerifier(q4)}
    methods = {  # name -> (target, drafter factory or None)
        "fp32 plain": ("fp32", None),
        "fp32 plain, again (A/A)": ("fp32", None),  # plain against itself: the bench's own noise
        "fp32 n-gram": ("fp32", lambda: PromptLookupDrafter(min_n=1, max_n=4)),
        "fp32 bf16 self-draft": ("fp32", lambda: self_draft(bf16, fp32)),
        "fp32 bf16 self-draft, no memory": ("fp32", lambda: self_draft(bf16, fp32)),  # each request from the prior, as before
        "fp32 int8 self-draft": ("fp32", lambda: self_draft(int8, fp32)),
        "fp32 q4_1 self-draft": ("fp32", lambda: self_draft(q4_1, fp32)),
        "Q4_1 plain": ("Q4_1", None),
        "Q4_1 n-gram": ("Q4_1", lambda: PromptLookupDrafter(min_n=1, max_n=4)),
    }
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    # as a user's process runs them (client.local.LocalGenerator): a self-draft's adaptive k starts from the acceptance
    # of the requests before (AcceptanceMemory, one per method); an n-gram lookup's from the prior
    memories = {name: AcceptanceMemory() for name in methods if "self-draft" in name and "no memory" not in name}
    for target, make in methods.values():  # warm-up: kernels, the fast path's build, first-call costs
        generate(targets[target], make() if make else None, ids[0], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True),
                 k_policy=AdaptiveK() if make else None)  # (not remembered: the runs start from the prior)

    q4_params = SamplingParams(temperature=0.0, max_new_tokens=args.q4_tokens, ignore_eos=True)
    runs: list[dict] = []
    for run in range(max(args.runs, args.q4_runs)):
        for index, prompt_ids in enumerate(ids):
            order = [n for n in methods if run < (args.q4_runs if methods[n][0] == "Q4_1" else args.runs)]
            order = order if (run + index) % 2 == 0 else order[::-1]
            streams = {name: speculative_stream(targets[methods[name][0]], methods[name][1]() if methods[name][1] else None,
                                                prompt_ids, q4_params if methods[name][0] == "Q4_1" else params,
                                                k_policy=AdaptiveK(memory=memories.get(name)) if methods[name][1] else None)
                       for name in order}
            if args.interleave == "rounds":  # each target's methods together: one engine's weights in use at a time
                timed = {name: result for target in dict.fromkeys(methods[n][0] for n in order)
                         for name, result in lockstep({n: streams[n] for n in order if methods[n][0] == target}).items()}
            else:
                timed = {name: one_by_one(stream) for name, stream in streams.items()}
            for name in order:
                events, seconds = timed[name]
                s = events[-1].stats
                tokens = [t for event in events for t in event.token_ids]
                runs.append(dict(run=run, prompt=index, method=name, target=methods[name][0], tokens=tokens,
                                 tokens_per_s=len(tokens) / seconds, num_drafts=s.num_drafts,
                                 num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                                 num_withheld_drafts=s.num_withheld_drafts, num_target_forwards=s.num_target_forwards))
            line = ", ".join(f"{r['method']} {r['tokens_per_s']:.1f}" for r in runs[-len(order):])
            print(f"[run {run} prompt {index}] tok/s: {line}", flush=True)

    summary = summarize(runs, methods, len(ids))
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.machine(),
                cpu=cpu_model(), cpus=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads(),
                max_new_tokens=args.max_new_tokens, runs=args.runs, interleave=args.interleave, num_prompts=len(ids), note=args.note,
                q4_runs=args.q4_runs, q4_tokens=args.q4_tokens,
                command="python bench/never_costs.py" + (" --quick" if args.quick else "")
                        + (f" --runs {args.runs}" if args.runs != 3 and not args.quick else "")
                        + (f" --interleave {args.interleave}" if args.interleave != "rounds" else "")
                        + (f" --q4-runs {args.q4_runs}" if args.q4_runs != args.runs and not args.quick else "")
                        + (f" --q4-tokens {args.q4_tokens}" if args.q4_tokens != args.max_new_tokens and not args.quick else "")
                        + (f" --max-new-tokens {args.max_new_tokens}" if args.max_new_tokens != 64 and not args.quick else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "never_costs.json").write_text(json.dumps(dict(meta=meta, summary=summary, prompts=prompts, runs=runs),
                                                         indent=2))
    report = render(meta, summary, prompts)
    (RESULTS / "never_costs.md").write_text(report)
    print(report)
    return 0


def one_by_one(stream: Iterator[StepEvent]) -> tuple[list[StepEvent], float]:
    """A request's events and its wall time, run to the end on its own."""
    start = time.perf_counter()
    events = list(stream)
    return events, time.perf_counter() - start


def lockstep(streams: dict[str, Iterator[StepEvent]]) -> dict[str, tuple[list[StepEvent], float]]:
    """Every request's events and its own time: the streams advanced one event (a prefill or a round,
    drafting, verifying and closing included) at a time, in turn, the turn's order reversed every
    cycle; each request's time is the sum of its own steps. The methods of a prompt so share the
    machine's moment to moment speed (this shared VM drifts by 30% within a minute), and a ratio of two
    carries their difference, not the drift between two requests run one after the other."""
    events: dict[str, list[StepEvent]] = {name: [] for name in streams}
    spent = dict.fromkeys(streams, 0.0)
    running = list(streams)
    while running:
        for name in list(running):
            start = time.perf_counter()
            event = next(streams[name], None)
            spent[name] += time.perf_counter() - start
            if event is None:
                running.remove(name)
            else:
                events[name].append(event)
        running.reverse()
    return {name: (events[name], spent[name]) for name in streams}


def summarize(runs: list[dict], methods: dict, num_prompts: int) -> dict:
    per_prompt: dict[str, list[dict]] = {}
    for name, (target, _make) in methods.items():
        plain = f"{target} plain"
        rows = []
        for index in range(num_prompts):
            mine = [r for r in runs if r["method"] == name and r["prompt"] == index]
            base = [r for r in runs if r["method"] == plain and r["prompt"] == index]
            tps = statistics.median(r["tokens_per_s"] for r in mine)
            base_by_run = {r["run"]: r["tokens_per_s"] for r in base}
            paired = statistics.median(r["tokens_per_s"] / base_by_run[r["run"]] for r in mine)
            drafted = sum(r["num_draft_tokens"] for r in mine)
            rows.append(dict(prompt=index, tokens_per_s=tps, vs_plain=paired,
                             exact=all(r["tokens"] == base[0]["tokens"] for r in mine),
                             acceptance=sum(r["num_accepted_tokens"] for r in mine) / drafted if drafted else None,
                             draft_tokens_per_run=drafted / len(mine),
                             withheld_per_run=sum(r["num_withheld_drafts"] for r in mine) / len(mine)))
        per_prompt[name] = rows
    methods_summary = {}
    for name, rows in per_prompt.items():
        ratios = [r["vs_plain"] for r in rows]
        methods_summary[name] = dict(median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in rows),
                                     median_vs_plain=statistics.median(ratios), lowest_vs_plain=min(ratios),
                                     highest_vs_plain=max(ratios), prompts_below_goal=sum(x < GOAL for x in ratios),
                                     # below the goal with nothing drafted: plain decoding's work, so the bench's noise
                                     below_goal_drafting_nothing=sum(r["vs_plain"] < GOAL and not r["draft_tokens_per_run"]
                                                                     for r in rows),
                                     all_exact=all(r["exact"] for r in rows))
    spread = {}  # plain decoding's own run-to-run spread per prompt: (highest - lowest) / median tok/s
    for target in sorted({t for t, _ in methods.values()}):
        by_prompt = [[r["tokens_per_s"] for r in runs if r["method"] == f"{target} plain" and r["prompt"] == i]
                     for i in range(num_prompts)]
        spreads = [(max(x) - min(x)) / statistics.median(x) for x in by_prompt if len(x) > 1]
        if spreads:
            spread[target] = dict(median=statistics.median(spreads), highest=max(spreads))
    return dict(per_prompt=per_prompt, methods=methods_summary, goal=GOAL, plain_spread=spread)


def render(meta: dict, summary: dict, prompts: list[str]) -> str:
    lines = ["# Speculation never costs: speculative vs our plain decoding on held-out prompts", "",
             f"Run {meta['date']} on {meta['machine']} {meta['cpus']} cpus ({meta['cpu']}), torch {meta['torch']}, "
             f"{meta['threads']} threads.", "", f"Command: `{meta['command']}`", ""]
    if meta["note"]:
        lines += [f"Note: {meta['note']}", ""]
    q4 = ("" if (meta["q4_runs"], meta["q4_tokens"]) == (meta["runs"], meta["max_new_tokens"])
          else f" (the Q4_1 target: {meta['q4_tokens']} tokens, {meta['q4_runs']} run(s))")
    lines += [f"Default model (SmolLM2-135M-Instruct), greedy, {meta['max_new_tokens']} new tokens (EOS ignored), time "
              f"including the prefill, {meta['runs']} runs per prompt{q4}, "
              + ("a prompt's requests on one target run together, one event (prefill or round) of each in turn, each "
                 "timed on its own events, so all see the machine's speed of the same moments. "
                 if meta.get("interleave", "requests") == "rounds" else "methods alternating prompt by prompt. ")
              + f"The {meta['num_prompts']} prompts are bench/prompts/held_out.json: the draft gate, the plain stretches "
              "and the adaptive k policy were never tuned on them. Every speculative method runs the adaptive k "
              f"policy with the draft gate, as a user's request does. Goal: >= {summary['goal']}x plain decoding of "
              "the same target on every prompt.", "",
              "| method | median tok/s | vs plain: median | lowest prompt | highest prompt | prompts below goal "
              "(of them, nothing drafted) | tokens = plain's |", "|---|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        lines.append(f"| {name} | {m['median_tokens_per_s']:.1f} | {m['median_vs_plain']:.3f}x | {m['lowest_vs_plain']:.3f}x | "
                     f"{m['highest_vs_plain']:.3f}x | {m['prompts_below_goal']} ({m.get('below_goal_drafting_nothing', 0)}) | "
                     f"{'yes' if m['all_exact'] else 'NO'} |")
    lines += ["", "A prompt on which a method drafted nothing in any run did plain decoding's work (the same forwards; "
              "the drafter was not run, or its lookups, microseconds each, were withheld), so its ratio there is the "
              "bench's own noise on paired runs."]
    for target, x in summary.get("plain_spread", {}).items():
        lines += ["", f"Noise: {target} plain decoding's own tok/s from run to run, (highest - lowest) / median per prompt: "
                  f"median {x['median']:.1%}, largest {x['highest']:.1%}."]
    lines += ["", "Per prompt (speculative / plain of the same target, the median of the runs' own ratios; acceptance; "
              "draft tokens and withheld drafts per run):", ""]
    spec = [n for n in summary["per_prompt"] if not n.endswith("plain")]
    lines += ["| prompt | " + " | ".join(spec) + " |", "|---" * (len(spec) + 1) + "|"]
    for index, prompt in enumerate(prompts):
        cells = []
        for name in spec:
            row = summary["per_prompt"][name][index]
            acc = "–" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
            cells.append(f"{row['vs_plain']:.2f}x ({acc}; {row['draft_tokens_per_run']:.0f} / {row['withheld_per_run']:.0f})")
        short = prompt if len(prompt) <= 48 else prompt[:45] + "..."
        lines.append(f"| {index}: {short.replace('|', '/')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
