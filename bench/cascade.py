"""Cascades on the default model's CPU stages: lossless pipelines, and the adaptive (lossy) curve over lambda.

    .venv/bin/python bench/cascade.py [--max-new-tokens 48] [--repeats 2] [--threads 1] [--lambdas 0 4 16 64 256 inf]
                                      [--quick] [--predictor specmesh/cascade/data/predictor-smollm2-MID-fp32.json]

SmolLM2-135M-Instruct (default), fp32 target, greedy, bench/speculative.py's input-grounded and chat
prompts, everything in-process. Steps:
1. Stage costs, measured: ms of one forward of each CPU variant (fp32, int8 dynamic, bf16) on 1 token
   and on k + 1 = 5 tokens after 150 cached tokens (3 interleaved rounds of 3-forward medians; the best
   round, as contention from other jobs only adds time). The middle stage MID is the cheaper of int8
   and bf16 by this measurement; the base is the n-gram (prompt lookup, free).
2. Lossless (each must emit exactly the target-only tokens; checked; a row drafted by a model keeps its adaptive
   k's acceptance across the run's requests, as the Coordinator does): target-only decoding; the 2-stage
   pipelines n-gram -> fp32 and mid -> fp32 (model drafter), adaptive k; the 3-stage n-gram -> mid
   (a Stage, extending 1 token) -> fp32, adaptive k; the shipped cascade's levels in one process (n-gram
   -> bf16 Stage filling the target's k -> fp32: configs/local-cascade.yaml with no service in between,
   the most its cluster could reach), adaptive k and k = 4 fixed, and adaptive k with its stage running every
   round (`CascadeBook.pass_agreed` off: a stage that agreed with a whole draft sits out otherwise); and the levels it shipped before
   (int8 model drafter -> bf16 Stage extending 1 token -> fp32), adaptive k.
3. Adaptive (lossy, opt-in): MID (a Stage extending 4 tokens, no base: the chunks the predictor was
   trained on, `specmesh cascade collect --chunk-tokens 4`) -> fp32 with k = 4, one chunk per round;
   for each lambda a fresh `AdaptiveStopper` (the shipped predictor, stage costs from step 1) shared by
   the set's prompts, so its Beta posteriors learn across requests as in serving. Quality against the
   target-only output of the same prompt: token agreement (position-wise matches / the longer length),
   common-prefix fraction, and exact-match rate.
Each (prompt, repeat) runs every method back to back, in alternating order; tokens/s are medians over
prompts x repeats, speedups medians of per-run ratios (each against target-only of the same prompt
and repeat, run moments apart). The machine's load average is recorded before and after. torch runs
1 thread by default: on a shared 2-core machine with other CPU jobs, 2 OpenMP threads per process
thrash (measured here under load 7: an fp32 forward took 420 ms with 1 thread, 3,100 ms with 2).
Writes bench/results/cascade.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.speculative import CHAT_PROMPTS, GROUNDED_PROMPTS  # noqa: E402
from specmesh.cascade.costs import chunk_stage_costs, measure_forward_ms  # noqa: E402
from specmesh.cascade.identity import parse_stage_spec, stage_identity  # noqa: E402
from specmesh.cascade.pipeline import CascadeDrafter  # noqa: E402
from specmesh.cascade.plan import StageSpec  # noqa: E402
from specmesh.cascade.policy import AdaptiveStopper  # noqa: E402
from specmesh.cascade.stage_model import StageModel  # noqa: E402
from specmesh.decoding.adaptive import AcceptanceMemories, AdaptiveK, FixedK, KPolicy  # noqa: E402
from specmesh.decoding.proposal import Drafter  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.drafters.model import ModelDrafter  # noqa: E402
from specmesh.drafters.ngram import PromptLookupDrafter  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PREDICTORS = Path(__file__).resolve().parent.parent / "specmesh" / "cascade" / "data"  # predictor-smollm2-{mid}-fp32.json
LAMBDAS = [0.0, 4.0, 16.0, 64.0, 256.0, math.inf]  # stop iff lambda * (1 - a) <= 1: a >= 0, .75, .94, .98, .996, never
ADAPTIVE_K = 4  # tokens per chunk = the predictor's training chunks
COST_CONTEXT = 150  # cached tokens before the timed forwards (about a prompt's length here)


def lam_name(lam: float) -> str:
    return "inf" if math.isinf(lam) else f"{lam:g}"


def token_agreement(out: list[int], ref: list[int]) -> float:
    """Position-wise matches / the longer length (1.0 iff identical)."""
    longest = max(len(out), len(ref))
    return sum(a == b for a, b in zip(out, ref)) / longest if longest else 1.0


def prefix_fraction(out: list[int], ref: list[int]) -> float:
    common = 0
    while common < min(len(out), len(ref)) and out[common] == ref[common]:
        common += 1
    return common / max(len(ref), 1) if out != ref else 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (module docstring)")
    parser.add_argument("--lambdas", type=float, nargs="+", default=LAMBDAS, help="adaptive lambdas (inf = lossless)")
    parser.add_argument("--quick", action="store_true", help="one prompt per set, 12 tokens, lambdas 0 4 inf (smoke run)")
    parser.add_argument("--predictor", default="", help="default: the shipped one for the measured middle stage")
    args = parser.parse_args()
    if args.quick:
        args.max_new_tokens, args.repeats, args.lambdas = 12, 1, [0.0, 4.0, math.inf]
    torch.set_num_threads(args.threads)
    lambdas = list(args.lambdas)
    load_before = os.getloadavg()
    started = time.perf_counter()
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    folder = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print("loading engines ...", flush=True)
    variants = {"fp32": load_engine(folder, dtype="float32"), "int8": load_engine(folder, dtype="float32", quantize="int8"),
                "bf16": load_engine(folder, dtype="bfloat16")}

    # 1. measured costs; the middle stage is the cheaper variant
    rounds: dict = {name: {"step_ms": [], "verify_ms": []} for name in variants}
    for _ in range(3):
        for name, e in variants.items():
            rounds[name]["step_ms"].append(measure_forward_ms(e, 1, COST_CONTEXT, repeats=3))
            rounds[name]["verify_ms"].append(measure_forward_ms(e, ADAPTIVE_K + 1, COST_CONTEXT, repeats=3))
    costs = {name: {key: min(values) for key, values in r.items()} for name, r in rounds.items()}
    for cost in costs.values():
        cost["verify_vs_fp32"] = cost["verify_ms"] / costs["fp32"]["verify_ms"]
        cost["step_vs_fp32"] = cost["step_ms"] / costs["fp32"]["step_ms"]
    mid_name = min(("int8", "bf16"), key=lambda n: costs[n]["verify_ms"] + costs[n]["step_ms"])
    print("forward ms: " + ", ".join(f"{n} {c['step_ms']:.1f} / {c['verify_ms']:.1f}" for n, c in costs.items())
          + f"; middle stage: {mid_name}", flush=True)
    target, mid = variants["fp32"], variants[mid_name]
    verifier = TargetVerifier(target)
    # the adaptive pipeline's chunk: the stage's first forward feeds the news (no draft), then 3 one-token forwards
    stage_costs = chunk_stage_costs([costs[mid_name]["step_ms"], costs["fp32"]["verify_ms"]], [costs[mid_name]["step_ms"]],
                                    [ADAPTIVE_K])
    identities = [stage_identity(parse_stage_spec(f"default@{mid_name}")), stage_identity(parse_stage_spec("default@fp32"))]
    predictor_path = Path(args.predictor) if args.predictor else PREDICTORS / f"predictor-smollm2-{mid_name}-fp32.json"
    if not predictor_path.exists():
        print(f"{predictor_path} missing; make it with `specmesh cascade collect/train` (specmesh/cascade/data/README.md)")
        return 2
    from specmesh.cascade.predictor import AgreementPredictor
    predictor = AgreementPredictor.load(predictor_path, expected_stages=identities)

    def shipped_cascade(pass_agreed: bool = True) -> CascadeDrafter:
        return CascadeDrafter(PromptLookupDrafter(), [StageModel(variants["bf16"])], [StageSpec(fill=True)],
                              pass_agreed=pass_agreed)

    # a row drafted by a model (a model drafter, or a stage) keeps its acceptance across requests, as the Coordinator and
    # in-process generation keep a model drafter's or a cascade's (`AcceptanceMemories`): without it each request's
    # adaptive k starts from acceptance 0.7, where at a bf16 stage's cost its gate sits at the edge (one run drafted
    # little, 0.85x input-grounded, another minutes before 1.52x); the n-gram row starts afresh, as they do
    memories = AcceptanceMemories()

    def remembered(row: str) -> AdaptiveK:
        return memories.policy(row, greedy=True)

    lossless: dict[str, Callable[[], tuple[Drafter | None, KPolicy | None]]] = {
        "target-only": lambda: (None, None),
        "2-stage ngram->fp32": lambda: (PromptLookupDrafter(), AdaptiveK()),
        f"2-stage {mid_name}->fp32": lambda: (ModelDrafter(mid), remembered(f"2-stage {mid_name}")),
        f"3-stage ngram->{mid_name}->fp32": lambda: (CascadeDrafter(PromptLookupDrafter(), [StageModel(mid)], [StageSpec(1)]),
                                                     remembered(f"3-stage {mid_name}")),
        # the levels configs/local-cascade.yaml ships (an n-gram Draft service, a bf16 Stage filling the target's k):
        # adaptive k, and k = 4 fixed, which drafts on every round whatever the costs say
        "3-stage ngram->bf16 fill->fp32 (shipped levels)": lambda: (shipped_cascade(), remembered("shipped")),
        "3-stage ngram->bf16 fill->fp32, k = 4 fixed": lambda: (shipped_cascade(), FixedK(ADAPTIVE_K)),
        # the same levels with the stage running every round (`CascadeBook.pass_agreed` off), as before 2026-11-29
        "3-stage ngram->bf16 fill->fp32, the stage never sitting out": lambda: (shipped_cascade(pass_agreed=False),
                                                                               remembered("shipped, never sitting out")),
        "3-stage int8->bf16->fp32 (levels shipped before)": lambda: (
            CascadeDrafter(ModelDrafter(variants["int8"]), [StageModel(variants["bf16"])], [StageSpec(1)]), remembered("int8")),
    }
    adaptive_names = {lam: f"adaptive lambda={lam_name(lam)}" for lam in lambdas}
    sets = {"input-grounded": GROUNDED_PROMPTS, "chat": CHAT_PROMPTS}
    if args.quick:
        sets = {name: prompts[:1] for name, prompts in sets.items()}
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)

    def run_one(drafter, k_policy, ids):
        start = time.perf_counter()
        result = generate(verifier, drafter, ids, params, k_policy=k_policy)
        return result, time.perf_counter() - start

    warm = chat_prompt_ids(tokenizer, "Hi")
    for factory in lossless.values():
        run_one(*factory(), warm)

    runs: dict = {s: {name: [] for name in [*lossless, *adaptive_names.values()]} for s in sets}
    mismatches = []
    for set_name, prompts in sets.items():
        for repeat in range(args.repeats):
            stoppers = {lam: AdaptiveStopper(predictor, stage_costs, lam) for lam in lambdas}  # fresh per set and repeat
            for prompt_index, prompt in enumerate(prompts):
                ids = chat_prompt_ids(tokenizer, prompt)
                jobs: list[tuple[str, float | None]] = [(name, None) for name in lossless] + [(adaptive_names[lam], lam) for lam in lambdas]
                if (prompt_index + repeat) % 2:
                    jobs.reverse()
                outputs = {}
                for name, lam in jobs:
                    if lam is None:
                        result, seconds = run_one(*lossless[name](), ids)
                        extra: dict = {}
                    else:
                        cascade = CascadeDrafter(None, [StageModel(mid)], [StageSpec(ADAPTIVE_K)], stopper=stoppers[lam], lam=lam)
                        result, seconds = run_one(cascade, FixedK(ADAPTIVE_K), ids)
                        state = cascade.last_state
                        assert state is not None
                        stats = state.stage_stats[0]
                        extra = dict(chunks_stopped_at_stage=stats.num_chunks_stopped, chunks_to_target=state.num_chunks_to_target,
                                     chunks_judged=stats.num_chunks_judged, chunks_agreed=stats.num_chunks_agreed)
                    outputs[name] = dict(tokens=result.token_ids, seconds=seconds, tokens_per_s=len(result.token_ids) / seconds,
                                         lossy=result.lossy, num_target_forwards=result.stats.num_target_forwards, **extra)
                reference = outputs["target-only"]["tokens"]
                for name, record in outputs.items():
                    tokens = record.pop("tokens")
                    record.update(num_tokens=len(tokens), exact=tokens == reference,
                                  token_agreement=token_agreement(tokens, reference), prefix_fraction=prefix_fraction(tokens, reference),
                                  speedup=record["tokens_per_s"] / outputs["target-only"]["tokens_per_s"])
                    if name in lossless and not record["exact"]:
                        mismatches.append(dict(set=set_name, prompt=prompt_index, method=name))
                    runs[set_name][name].append(record)
                print(f"[{set_name} #{prompt_index} r{repeat}] " + ", ".join(
                    f"{name.replace('adaptive lambda=', 'L')} {outputs[name]['tokens_per_s']:.1f}" for name in runs[set_name]), flush=True)

    summary: dict = {}
    for set_name, by_method in runs.items():
        rows = {}
        for name, records in by_method.items():
            row: dict = dict(tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
                       speedup_vs_target_only=statistics.median(r["speedup"] for r in records),
                       token_agreement=statistics.mean(r["token_agreement"] for r in records),
                       prefix_fraction=statistics.mean(r["prefix_fraction"] for r in records),
                       exact_match_rate=statistics.mean(r["exact"] for r in records),
                       lossy_runs=sum(r["lossy"] for r in records), num_runs=len(records))
            if "chunks_to_target" in records[0]:
                stopped = sum(r["chunks_stopped_at_stage"] for r in records)
                total = stopped + sum(r["chunks_to_target"] for r in records)
                judged = sum(r["chunks_judged"] for r in records)
                row.update(stopped_at_stage_fraction=stopped / total if total else 0.0,
                           measured_agreement=sum(r["chunks_agreed"] for r in records) / judged if judged else None)
            rows[name] = row
        summary[set_name] = rows

    load_after = os.getloadavg()
    meta = dict(model="SmolLM2-135M-Instruct (default), fp32 target, greedy", middle_stage=mid_name,
                max_new_tokens=args.max_new_tokens, repeats=args.repeats, torch=torch.__version__,
                threads=torch.get_num_threads(), cpus=os.cpu_count(), machine=platform.machine(),
                load_average_before=list(load_before), load_average_after=list(load_after),
                seconds=time.perf_counter() - started, predictor=str(predictor_path.name),
                predictor_evaluation=predictor.info.evaluation, stage_costs_per_chunk=stage_costs,
                lambdas=[lam_name(lam) for lam in lambdas], command="python " + " ".join(sys.argv))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cascade.json").write_text(json.dumps(dict(meta=meta, forward_costs=costs, summary=summary, runs=runs,
                                                          mismatches=mismatches), indent=2))
    write_markdown(meta, costs, summary, lossless, adaptive_names, mismatches)
    plot(summary, adaptive_names)
    print((RESULTS / "cascade.md").read_text())
    return 0 if not mismatches else 1


def write_markdown(meta, costs, summary, lossless, adaptive_names, mismatches) -> None:
    lb, la = meta["load_average_before"], meta["load_average_after"]
    lines = [
        "# Cascades on CPU: lossless pipelines and the adaptive curve (bench/cascade.py)", "",
        f"`{meta['command']}` — {meta['model']}, {meta['max_new_tokens']} new tokens max, {meta['repeats']} repeats, "
        f"torch {meta['torch']}, {meta['threads']} torch thread(s) on {meta['cpus']} CPUs (shared machine: load average "
        f"{lb[0]:.1f} / {lb[1]:.1f} / {lb[2]:.1f} before, {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} after); "
        f"{meta['seconds']:.0f} s in all.", "",
        "## Stage costs (measured here: ms per forward after 150 cached tokens; best of 3 interleaved rounds of 3-forward medians)", "",
        "| variant | 1 token | 5 tokens | 1 token vs fp32 | 5 tokens vs fp32 |", "|---|---|---|---|---|",
    ]
    for name, c in costs.items():
        lines.append(f"| {name} | {c['step_ms']:.1f} | {c['verify_ms']:.1f} | {c['step_vs_fp32']:.2f} | {c['verify_vs_fp32']:.2f} |")
    lines += ["", f"Middle stage: **{meta['middle_stage']}** (the cheaper of int8 and bf16 here). Adaptive: {meta['middle_stage']} -> fp32, stage costs per "
              f"4-token chunk, target-forward equivalents: "
              + ", ".join(f"{c:.2f}" for c in meta["stage_costs_per_chunk"]) + ".", ""]
    for set_name, rows in summary.items():
        lines += [f"## {set_name}: lossless", "", "| pipeline | tok/s | vs target-only | exact |", "|---|---|---|---|"]
        for name in lossless:
            r = rows[name]
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_target_only']:.2f}x | "
                         f"{'yes' if r['exact_match_rate'] == 1.0 else 'NO'} |")
        lines += ["", f"## {set_name}: adaptive (lossy unless lambda = inf)", "",
                  "| lambda | tok/s | vs target-only | token agreement | common prefix | exact-match rate | chunks stopped at the stage | measured agreement |",
                  "|---|---|---|---|---|---|---|---|"]
        for lam, name in adaptive_names.items():
            r = rows[name]
            agreement = "–" if r["measured_agreement"] is None else f"{r['measured_agreement']:.2f}"
            lines.append(f"| {lam_name(lam)} | {r['tokens_per_s']:.1f} | {r['speedup_vs_target_only']:.2f}x | "
                         f"{r['token_agreement']:.3f} | {r['prefix_fraction']:.3f} | {r['exact_match_rate']:.2f} | "
                         f"{r['stopped_at_stage_fraction']:.0%} | {agreement} |")
        lines.append("")
    lines += ["The adaptive pipeline at lambda = inf is itself a lossless 2-stage pipeline (the middle stage as a Stage "
              "extending 4 tokens per round, k = 4 fixed); the 2-stage model-drafter row above uses adaptive k.", "",
              "Token agreement: position-wise matches with the target-only output / the longer length; common prefix: "
              "the share of the target-only output before the first difference; measured agreement: of the chunks that "
              "went on, the share the target accepted whole (what feeds the stopper's Beta posterior).", "",
              f"Predictor: `{meta['predictor']}`, held-out evaluation {json.dumps(meta['predictor_evaluation'])}.", ""]
    if mismatches:
        lines += ["LOSSLESS MISMATCHES (must not happen): " + json.dumps(mismatches), ""]
    (RESULTS / "cascade.md").write_text("\n".join(lines) + "\n")


def plot(summary, adaptive_names) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4.5), squeeze=False)
    for ax, (set_name, rows) in zip(axes[0], summary.items()):
        names = list(adaptive_names.values())
        x = [rows[n]["tokens_per_s"] for n in names]
        ax.plot(x, [rows[n]["token_agreement"] for n in names], "o-", label="token agreement")
        ax.plot(x, [rows[n]["exact_match_rate"] for n in names], "s--", label="exact-match rate")
        for i, (lam, xi, yi) in enumerate(zip(adaptive_names, x, [rows[n]["token_agreement"] for n in names])):
            ax.annotate(f"λ={lam_name(lam)}", (xi, yi), textcoords="offset points", xytext=(4, -14 - 11 * (i % 4)), fontsize=8)
        ax.axvline(rows["target-only"]["tokens_per_s"], color="gray", linestyle=":", label="target-only tok/s")
        ax.set_title(f"{set_name}: adaptive cascade")
        ax.set_xlabel("tokens/s (median)")
        ax.set_ylabel("quality vs target-only output")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(RESULTS / "cascade.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
