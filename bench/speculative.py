"""Speculative decoding vs the baselines users would pick, side by side in one process.

    .venv/bin/python bench/speculative.py [--max-new-tokens 128] [--repeats 1] [--quick]

On the default model (SmolLM2-135M-Instruct, fp32 target, greedy), two prompt sets:
input-grounded (summarize / extract / rewrite a passage given in the prompt) and open chat.
Methods, each run on every prompt in an interleaved order so machine noise hits all alike:
    ours-ar              our engine, plain autoregressive decoding
    ours-sd-ngram        our engine, prompt-lookup drafts, adaptive k
    ours-sd-bf16         our engine, self-draft with the target's weights in bf16, adaptive k; what it was not
                         told and the target's KV holds (the prompt, ...) copied from there (`self_draft`)
    ours-sd-bf16-fed     the same, feeding all it is told through its own forwards (a Draft service's way)
    ours-sd-int8         our engine, self-draft with int8 weight-only quantized weights, adaptive k
    ours-sd-q4_1         our engine, self-draft with the weights in 4-bit Q4_1 blocks, adaptive k
    hf-generate          transformers generate (fp32)
    hf-assisted-bf16     transformers assisted generation with the same bf16 draft
    hf-prompt-lookup     transformers prompt lookup decoding
Reported per set: median tokens/s, speedup over ours-ar and over hf-assisted-bf16 (the median of each
prompt-and-repeat's own ratio: the methods of one prompt run back to back), mean accepted length, acceptance rate,
and the Leviathan et al. bound (1 - a^(k+1)) / ((1 - a)(k c + 1)) for the measured per-token
acceptance a, mean draft length k and cost ratio c = draft ms per token / target ms per forward.
Every method must emit the same tokens as ours-ar (greedy exactness); mismatches are reported.
Writes bench/results/speculative.json and bench/results/speculative.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specmesh.decoding.adaptive import AdaptiveK  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.drafters.model import ModelDrafter, self_draft  # noqa: E402
from specmesh.drafters.ngram import PromptLookupDrafter  # noqa: E402
from specmesh.generator import load_self_draft  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.engine import measure_step  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps, flows along the border between Germany and "
    "France, and reaches the North Sea in the Netherlands. It is about 1,230 kilometres long. For "
    "centuries the Rhine has been one of the most important trade routes in Europe: barges carry coal, "
    "grain, chemicals and containers between the port of Rotterdam and cities such as Duisburg, Cologne "
    "and Basel. The river also supplies drinking water to millions of people, and its valley between "
    "Bingen and Koblenz, with its castles and vineyards, is a UNESCO World Heritage Site."
)
GROUNDED_PROMPTS = [
    f"Summarize the following passage in five detailed sentences, reusing its key phrases.\n\n{PASSAGE}",
    f"Rewrite the following passage as a numbered list of facts, one fact per line, using the passage's own "
    f"words.\n\n{PASSAGE}",
    f"Answer these questions using only the passage: Where does the Rhine begin? How long is it? What do barges "
    f"carry? Which cities are on it? What is special about its valley?\n\n{PASSAGE}",
    f"Rewrite the following passage in simpler words for a ten-year-old, keeping all the facts, in at least six "
    f"sentences.\n\n{PASSAGE}",
]
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between cats and dogs as pets?",
    "Explain how a rainbow forms.",
]


def leviathan_bound(acceptance: float, k: float, cost_ratio: float) -> float:
    """Expected speedup of speculative decoding: (1 - a^(k+1)) / ((1 - a)(k c + 1))."""
    if k <= 0:
        return 1.0
    a = min(acceptance, 0.9999)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * cost_ratio + 1))


class Ours:
    def __init__(self, verifier, drafter_factory, draft_engine=None):
        self.verifier, self.drafter_factory, self.draft_engine = verifier, drafter_factory, draft_engine

    def run(self, ids, max_new_tokens):
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        drafter = self.drafter_factory() if self.drafter_factory else None
        start = time.perf_counter()
        result = generate(self.verifier, drafter, ids, params, k_policy=AdaptiveK() if drafter else None)
        elapsed = time.perf_counter() - start
        s = result.stats
        rounds = max(1, s.num_target_forwards - 1)
        return dict(
            tokens=result.token_ids,
            seconds=elapsed,
            mean_accepted_length=s.mean_accepted_length,
            acceptance=s.acceptance_rate,
            mean_k=s.num_draft_tokens / max(1, s.num_drafts),
            draft_ms_per_token=s.draft_ms / max(1, s.num_draft_tokens),
            verify_ms_per_forward=s.verify_ms / max(1, s.num_target_forwards),
            rounds=rounds,
        )


class HF:
    def __init__(self, model, eos_ids, **kwargs):
        self.model, self.eos_ids, self.kwargs = model, eos_ids, kwargs

    def run(self, ids, max_new_tokens):
        input_ids = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0], **self.kwargs,
            )
        elapsed = time.perf_counter() - start
        return dict(tokens=out[0, len(ids):].tolist(), seconds=elapsed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs per prompt and method")
    parser.add_argument("--quick", action="store_true", help="one prompt per set, 32 tokens (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.max_new_tokens = 32
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print("loading engines and transformers models ...", flush=True)
    target = load_engine(folder, dtype="float32")
    bf16 = load_engine(folder, dtype="bfloat16")
    int8 = load_engine(folder, dtype="float32", quantize="int8")
    q4_1 = load_self_draft(folder, "q4_1")
    for engine in (target, bf16, int8, q4_1):  # as `specmesh generate --local` does: the costs known before a first round
        measure_step(engine)
    verifier = TargetVerifier(target)
    hf_fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    eos = list(target.eos_token_ids)
    methods = {
        "ours-ar": Ours(verifier, None),
        "ours-sd-ngram": Ours(verifier, lambda: PromptLookupDrafter(min_n=1, max_n=4)),
        "ours-sd-bf16": Ours(verifier, lambda: self_draft(bf16, target)),
        "ours-sd-bf16-fed": Ours(verifier, lambda: ModelDrafter(bf16)),  # the same draft feeding its own prompt
        "ours-sd-int8": Ours(verifier, lambda: self_draft(int8, target)),
        "ours-sd-q4_1": Ours(verifier, lambda: self_draft(q4_1, target)),
        "hf-generate": HF(hf_fp32, eos),
        "hf-assisted-bf16": HF(hf_fp32, eos, assistant_model=hf_bf16),
        "hf-prompt-lookup": HF(hf_fp32, eos, prompt_lookup_num_tokens=10),
    }
    sets = {"input-grounded": GROUNDED_PROMPTS, "chat": CHAT_PROMPTS}
    if args.quick:
        sets = {name: prompts[:1] for name, prompts in sets.items()}
    for method in methods.values():  # warm-up: first-call allocations and oneDNN kernel selection
        method.run(chat_prompt_ids(tokenizer, "Hi"), 8)

    runs: dict = {s: {m: [] for m in methods} for s in sets}
    mismatches = []
    for set_name, prompts in sets.items():
        for prompt_index, prompt in enumerate(prompts):
            ids = chat_prompt_ids(tokenizer, prompt)
            for repeat in range(args.repeats):
                order = list(methods) if (prompt_index + repeat) % 2 == 0 else list(reversed(methods))
                reference = None
                outputs = {}
                for name in order:
                    result = methods[name].run(ids, args.max_new_tokens)
                    result["tokens_per_s"] = len(result["tokens"]) / result["seconds"]
                    outputs[name] = result
                reference = outputs["ours-ar"]["tokens"]
                for name, result in outputs.items():
                    result["exact"] = result["tokens"] == reference
                    if not result["exact"]:
                        first = next((i for i, (a, b) in enumerate(zip(result["tokens"], reference)) if a != b),
                                     min(len(result["tokens"]), len(reference)))
                        mismatches.append(dict(set=set_name, prompt=prompt_index, method=name, first_difference=first))
                    tokens = result.pop("tokens")
                    result["num_tokens"] = len(tokens)
                    runs[set_name][name].append(result)
                line = ", ".join(f"{n} {outputs[n]['tokens_per_s']:.1f}" for n in methods)
                print(f"[{set_name} #{prompt_index} r{repeat}] tok/s: {line}", flush=True)

    summary = {}
    for set_name, by_method in runs.items():
        ar_ms = statistics.median(r["verify_ms_per_forward"] for r in by_method["ours-ar"])
        rows = {}

        def paired(results: list[dict], base: list[dict]) -> float:
            """The median of each (prompt, repeat)'s own ratio (runs are listed in the same order for every method):
            the machine's drift between prompts and repeats cancels, where a ratio of medians would mix them."""
            return statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results, base, strict=True))

        for name, results in by_method.items():
            tps = statistics.median(r["tokens_per_s"] for r in results)
            row = dict(tokens_per_s=tps, speedup_vs_ours_ar=paired(results, by_method["ours-ar"]),
                       exact=all(r["exact"] for r in results), num_runs=len(results))
            if "mean_accepted_length" in results[0] and name != "ours-ar":
                acceptance = statistics.median(r["acceptance"] for r in results)
                mean_k = statistics.median(r["mean_k"] for r in results)
                cost_ratio = statistics.median(r["draft_ms_per_token"] for r in results) / ar_ms
                row.update(
                    mean_accepted_length=statistics.median(r["mean_accepted_length"] for r in results),
                    acceptance_rate=acceptance, mean_k=mean_k, cost_ratio_c=cost_ratio,
                    leviathan_bound=leviathan_bound(acceptance, mean_k, cost_ratio),
                    speedup_vs_hf_assisted=paired(results, by_method["hf-assisted-bf16"]),
                )
            rows[name] = row
        taken, fed = by_method["ours-sd-bf16"], by_method["ours-sd-bf16-fed"]
        ratios = [t["tokens_per_s"] / f["tokens_per_s"] for t, f in zip(taken, fed, strict=True)]
        rows["ours-sd-bf16"]["speedup_vs_fed"] = statistics.median(ratios)
        rows["ours-sd-bf16"]["speedup_vs_fed_range"] = [min(ratios), max(ratios)]
        summary[set_name] = rows

    meta = dict(
        model="SmolLM2-135M-Instruct (default), fp32 target, greedy",
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, torch=torch.__version__,
        threads=torch.get_num_threads(), machine=platform.machine(), python=platform.python_version(),
        command="python bench/speculative.py" + (" --quick" if args.quick else "") +
                (f" --repeats {args.repeats}" if args.repeats != 1 else ""),
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "speculative.json").write_text(json.dumps(dict(meta=meta, summary=summary, runs=runs, mismatches=mismatches), indent=2))
    lines = [
        "# Speculative decoding vs baselines (bench/speculative.py)", "",
        f"`{meta['command']}` — {meta['model']}, {args.max_new_tokens} new tokens max (stops at EOS), "
        f"medians over prompts x repeats, torch {meta['torch']}, {meta['threads']} threads.", "",
    ]
    for set_name, rows in summary.items():
        lines += [f"## {set_name}", "",
                  "| method | tok/s | vs ours-ar | vs hf-assisted | mean acc. len | acceptance | mean k | c | Leviathan bound | exact |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in rows.items():
            def fmt(key, spec=".2f"):
                return format(row[key], spec) if key in row else "–"
            lines.append(
                f"| {name} | {row['tokens_per_s']:.1f} | {row['speedup_vs_ours_ar']:.2f}x | {fmt('speedup_vs_hf_assisted')} "
                f"| {fmt('mean_accepted_length')} | {fmt('acceptance_rate', '.0%')} | {fmt('mean_k', '.1f')} "
                f"| {fmt('cost_ratio_c', '.3f')} | {fmt('leviathan_bound')} | {'yes' if row['exact'] else 'NO'} |"
            )
        fed = rows["ours-sd-bf16"]
        lines += ["", f"The KV taken from the target: ours-sd-bf16 / ours-sd-bf16-fed tokens/s, paired per prompt and "
                      f"repeat: median {fed['speedup_vs_fed']:.3f}x (lowest {fed['speedup_vs_fed_range'][0]:.3f}x, "
                      f"highest {fed['speedup_vs_fed_range'][1]:.3f}x).", ""]
    lines += ["## Per prompt: speedup over ours-ar (median over repeats)", "",
              "| set | prompt | tokens | ours-ar tok/s | " + " | ".join(n for n in methods if n != "ours-ar") + " |",
              "|---|---|---|---|" + "---|" * (len(methods) - 1)]
    for set_name, by_method in runs.items():
        num_prompts = len(sets[set_name])
        for prompt_index in range(num_prompts):
            def per_prompt(name):
                return by_method[name][prompt_index * args.repeats:(prompt_index + 1) * args.repeats]
            ar = statistics.median(r["tokens_per_s"] for r in per_prompt("ours-ar"))
            cells = [f"{statistics.median(r['tokens_per_s'] for r in per_prompt(n)) / ar:.2f}x"
                     for n in methods if n != "ours-ar"]
            tokens = per_prompt("ours-ar")[0]["num_tokens"]
            lines.append(f"| {set_name} | {prompt_index} | {tokens} | {ar:.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    if mismatches:
        lines += ["Token mismatches vs ours-ar (first differing index):", ""]
        lines += [f"- {m['set']} #{m['prompt']} {m['method']}: {m['first_difference']}" for m in mismatches]
    (RESULTS / "speculative.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
