"""The two acceptance rules side by side on the default model, in one process: what the coupled rule
(seeds that reproduce in every mode) costs in acceptance and speed against the standard rule.

    .venv/bin/python bench/acceptance_rules.py [--max-new-tokens 32] [--seeds 3] [--threads 1] [--quick]
                                               [--methods ar,ngram,bf16-k3] [--out acceptance_rules]

SmolLM2-135M-Instruct (default), fp32 target, sampled at temperature 0.7 and 1.0, the prompts of
bench/speculative.py (input-grounded and chat). Two parts:

1. Expected acceptance, noise-free: along each prompt's target-only output, the target's p and a
   self-draft's q (bf16 weights, and int8 dynamic quantization: a worse drafter) at every position
   (one forward of each over the whole sequence), and the probability that a draft token drawn from q
   is accepted: sum_i min(p_i, q_i) = 1 - TV (standard) and sum_i 1 / sum_j max(p_j / p_i, q_j / q_i)
   (coupled, `specmesh.decoding.coupled`). An n-gram draft (one-hot q at x) is accepted with
   probability p(x) under both rules.
2. Measured runs, each (prompt, temperature, seed; every pair its own seeds) with every method under
   both rules, interleaved:
       ar            target-only decoding (the coupled rule's cost: its noise per token)
       ngram         prompt-lookup drafts, adaptive k
       bf16-k3       self-draft with the target's weights in bf16 at a fixed k = 3 (with one thread
                     on this CPU, bf16 drafting is slow enough that adaptive k hardly drafts)
   Reported per method and rule: acceptance rate (accepted / drafted), the first draft token's
   acceptance (per round: comparable with part 1), mean accepted length, tok/s (median; the machine
   may be shared, so timings are noisy), and whether every coupled run's tokens equal target-only
   decoding's with that seed (they must) and how many standard runs' do. The two rules sample
   different texts from the same seed, and an n-gram draft's acceptance depends mostly on whether the
   sampled text happens to copy the prompt, so measured n-gram acceptance varies a lot from run to run
   (its expectation per draft token is p(x) under both rules); part 1 is the comparison to trust.
Writes bench/results/acceptance_rules.json and bench/results/acceptance_rules.md.
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

from speculative import CHAT_PROMPTS, GROUNDED_PROMPTS  # noqa: E402

from specmesh.decoding.adaptive import AdaptiveK, FixedK  # noqa: E402
from specmesh.decoding.coupled import _CACHE, coupled_agreement, exponential_noise, standard_agreement  # noqa: E402
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, processed_probs  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.drafters.model import ModelDrafter  # noqa: E402
from specmesh.drafters.ngram import PromptLookupDrafter  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RULES = (AcceptanceRule.STANDARD, AcceptanceRule.COUPLED)
TEMPERATURES = (0.7, 1.0)


def all_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] the engine's logits after every prefix of token_ids (one forward)."""
    seq = engine.new_sequence()
    try:
        return engine.forward([SeqInput(seq, list(token_ids), list(range(len(token_ids))))])[0].float()
    finally:
        engine.free(seq)


def expected_acceptance(target, draft, prompt_ids: list[int], output: list[int], params: SamplingParams) -> dict:
    """Per-token acceptance of a bf16 draft under each rule along `output` (module docstring, part 1)."""
    sequence = [*prompt_ids, *output]
    rows = slice(len(prompt_ids) - 1, len(sequence) - 1)  # the rows that sample each output token
    p = processed_probs(all_logits(target, sequence)[rows], params)
    q = processed_probs(all_logits(draft, sequence)[rows], params)
    standard = [standard_agreement(p[i], q[i]) for i in range(len(output))]
    coupled = [coupled_agreement(p[i], q[i]) for i in range(len(output))]
    return dict(standard=statistics.fmean(standard), coupled=statistics.fmean(coupled), num_positions=len(output))


def run(verifier, drafter, ids, params, k_policy) -> dict:
    start = time.perf_counter()
    result = generate(verifier, drafter, ids, params, k_policy=k_policy)
    seconds = time.perf_counter() - start
    s = result.stats
    return dict(tokens=result.token_ids, seconds=seconds, tokens_per_s=len(result.token_ids) / seconds,
                num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens, num_drafts=s.num_drafts,
                first_accepted=(s.accepted_per_position or [0])[0], mean_accepted_length=s.mean_accepted_length)


def noise_ms(vocab_size: int, repeats: int = 50) -> float:
    """Milliseconds to make one position's noise (uncached)."""
    _CACHE.clear()
    start = time.perf_counter()
    for position in range(repeats):
        exponential_noise(987654321, 10**9 + position, vocab_size)
    _CACHE.clear()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per prompt and temperature")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared machine two threads wait on each other's barriers)")
    parser.add_argument("--quick", action="store_true", help="one prompt per set, one seed, 16 tokens (smoke run)")
    parser.add_argument("--methods", default="ar,ngram,bf16-k3", help="the measured methods, comma-separated (part 2)")
    parser.add_argument("--out", default="acceptance_rules", help="results file name under bench/results (no suffix)")
    args = parser.parse_args()
    if args.quick:
        args.max_new_tokens, args.seeds = 16, 1
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    folder = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print("loading engines ...", flush=True)
    target = load_engine(folder, dtype="float32")
    bf16 = load_engine(folder, dtype="bfloat16")
    int8 = load_engine(folder, dtype="float32", quantize="int8")
    verifier = TargetVerifier(target)
    methods = {
        "ar": (lambda: None, lambda: None),
        "ngram": (lambda: PromptLookupDrafter(min_n=1, max_n=4), AdaptiveK),
        "bf16-k3": (lambda: ModelDrafter(bf16), lambda: FixedK(3)),
    }
    unknown = set(args.methods.split(",")) - set(methods)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(methods)}")
    if "ar" not in args.methods.split(","):
        parser.error("--methods needs ar: every run's tokens are checked against target-only decoding's")
    methods = {name: make for name, make in methods.items() if name in args.methods.split(",")}
    sets = {"input-grounded": GROUNDED_PROMPTS, "chat": CHAT_PROMPTS}
    if args.quick:
        sets = {name: prompts[:1] for name, prompts in sets.items()}
    warm = chat_prompt_ids(tokenizer, "Hi")
    for make_drafter, make_policy in methods.values():  # first-call allocations and kernel selection
        generate(verifier, make_drafter(), warm, SamplingParams(temperature=1.0, seed=0, max_new_tokens=8),
                 k_policy=make_policy())

    runs: list[dict] = []
    expected: list[dict] = []
    pair = 0  # every (prompt, temperature) its own seeds: 100 * pair + 0, 1, ...
    for set_name, prompts in sets.items():
        for prompt_index, prompt in enumerate(prompts):
            ids = chat_prompt_ids(tokenizer, prompt)
            for temperature in TEMPERATURES:
                pair += 1
                for seed in range(100 * pair, 100 * pair + args.seeds):
                    outputs: dict[tuple[str, str], dict] = {}
                    for position, (name, (make_drafter, make_policy)) in enumerate(methods.items()):
                        rules = RULES if (position + seed + prompt_index) % 2 == 0 else tuple(reversed(RULES))
                        for rule in rules:
                            params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=args.max_new_tokens,
                                                    acceptance_rule=rule)
                            outputs[name, rule.value] = run(verifier, make_drafter(), ids, params, make_policy())
                    tokens = {key: result.pop("tokens") for key, result in outputs.items()}
                    for (name, rule), result in outputs.items():
                        result.update(set=set_name, prompt=prompt_index, temperature=temperature, seed=seed, method=name,
                                      rule=rule, num_tokens=len(tokens[name, rule]),
                                      same_as_ar=tokens[name, rule] == tokens["ar", rule])
                        runs.append(result)
                    if seed == 100 * pair:
                        params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=args.max_new_tokens)
                        reference = generate(verifier, None, ids, params).token_ids
                        for drafter_name, draft_engine in (("bf16", bf16), ("int8", int8)):
                            expected.append(dict(set=set_name, prompt=prompt_index, temperature=temperature,
                                                 drafter=drafter_name,
                                                 **expected_acceptance(target, draft_engine, ids, reference, params)))
                    line = ", ".join(f"{m}/{r[:4]} {outputs[m, r]['tokens_per_s']:.1f}" for m, r in outputs)
                    print(f"[{set_name} #{prompt_index} t{temperature} s{seed}] tok/s: {line}", flush=True)

    summary = summarize(runs, expected, list(methods))
    summary["noise_ms_per_position"] = noise_ms(target.vocab_size)
    meta = dict(model="SmolLM2-135M-Instruct (default), fp32 target, bf16 / int8 self-draft", vocab_size=target.vocab_size,
                max_new_tokens=args.max_new_tokens, seeds=args.seeds, temperatures=list(TEMPERATURES),
                num_prompts=sum(len(prompts) for prompts in sets.values()),
                torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine(),
                python=platform.python_version(),
                command="python bench/acceptance_rules.py" + (" --quick" if args.quick else "") +
                        (f" --seeds {args.seeds}" if args.seeds != 3 and not args.quick else "") +
                        (f" --threads {args.threads}" if args.threads != 1 else "") +
                        (f" --max-new-tokens {args.max_new_tokens}" if args.max_new_tokens != 32 and not args.quick else "") +
                        (f" --methods {args.methods}" if args.methods != parser.get_default("methods") else "") +
                        (f" --out {args.out}" if args.out != parser.get_default("out") else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(dict(meta=meta, summary=summary, expected=expected, runs=runs),
                                                              indent=2))
    lines = report(meta, summary)
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def summarize(runs: list[dict], expected: list[dict], methods: list[str]) -> dict:
    table = {}
    for temperature in TEMPERATURES:
        for method in methods:
            for rule in (r.value for r in RULES):
                rows = [r for r in runs if r["temperature"] == temperature and r["method"] == method and r["rule"] == rule]
                drafted = sum(r["num_draft_tokens"] for r in rows)
                accepted = sum(r["num_accepted_tokens"] for r in rows)
                drafts = sum(r["num_drafts"] for r in rows)
                table[f"{temperature}/{method}/{rule}"] = dict(
                    temperature=temperature, method=method, rule=rule, num_runs=len(rows),
                    tokens_per_s=statistics.median(r["tokens_per_s"] for r in rows),
                    acceptance_rate=accepted / drafted if drafted else None,
                    first_token_acceptance=sum(r["first_accepted"] for r in rows) / drafts if drafts else None,
                    mean_accepted_length=1 + accepted / drafts if drafts else None,
                    mean_k=drafted / drafts if drafts else None,
                    same_as_ar=sum(r["same_as_ar"] for r in rows),
                )
    expectation = {}
    for drafter in ("bf16", "int8"):
        for temperature in TEMPERATURES:
            rows = [e for e in expected if e["temperature"] == temperature and e["drafter"] == drafter]
            weights = [e["num_positions"] for e in rows]
            expectation[f"{drafter}/{temperature}"] = dict(
                drafter=drafter, temperature=temperature,
                standard=sum(e["standard"] * w for e, w in zip(rows, weights)) / sum(weights),
                coupled=sum(e["coupled"] * w for e, w in zip(rows, weights)) / sum(weights),
                num_positions=sum(weights))
    return dict(measured=table, expected_acceptance=expectation)


def report(meta: dict, summary: dict) -> list[str]:
    lines = ["# Acceptance rules: standard vs coupled (bench/acceptance_rules.py)", "",
             f"`{meta['command']}` — {meta['model']}, {meta['max_new_tokens']} new tokens max, {meta['seeds']} seed(s) per "
             f"prompt and temperature, {meta['num_prompts']} prompts of bench/speculative.py, torch {meta['torch']}, "
             f"{meta['threads']} thread(s).",
             "", "## Expected acceptance of a self-draft token (noise-free)", "",
             "Mean over every position of each prompt's target-only output of P(accept) = sum min(p, q) (standard) "
             "and sum_i 1 / sum_j max(p_j/p_i, q_j/q_i) (coupled). n-gram drafts: p(x) under both rules.", "",
             "| drafter | temperature | positions | standard | coupled | coupled / standard |", "|---|---|---|---|---|---|"]
    for row in summary["expected_acceptance"].values():
        lines.append(f"| {row['drafter']} | {row['temperature']} | {row['num_positions']} | {row['standard']:.4f} "
                     f"| {row['coupled']:.4f} | {row['coupled'] / row['standard']:.4f} |")
    lines += ["", "## Measured (same run, interleaved)", "",
              "tok/s: median over runs; acceptance: accepted / drafted over all runs; first token: the first draft token "
              "of a round accepted (per-token acceptance on the target's own path, as in the table above); mean acc. len: "
              "1 + accepted / rounds with a draft; same tokens as ar: runs whose tokens equal target-only decoding's under "
              "the same rule and seed.", "",
              "| temperature | method | rule | runs | tok/s | vs standard | acceptance | first token | mean acc. len | mean k "
              "| same tokens as ar |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    measured = summary["measured"]
    for row in measured.values():
        standard = measured[f"{row['temperature']}/{row['method']}/standard"]

        def fmt(value, spec):
            return "–" if value is None else format(value, spec)
        lines.append(f"| {row['temperature']} | {row['method']} | {row['rule']} | {row['num_runs']} | {row['tokens_per_s']:.1f} "
                     f"| {row['tokens_per_s'] / standard['tokens_per_s']:.2f}x | {fmt(row['acceptance_rate'], '.1%')} "
                     f"| {fmt(row['first_token_acceptance'], '.1%')} "
                     f"| {fmt(row['mean_accepted_length'], '.2f')} | {fmt(row['mean_k'], '.2f')} "
                     f"| {row['same_as_ar']}/{row['num_runs']} |")
    lines += ["", "The two rules sample different texts from one seed; an n-gram draft's acceptance depends mostly on "
              "whether the sampled text copies the prompt, so its measured acceptance moves a lot between runs (in "
              "expectation it is p(x) per draft token under both rules). The expected acceptance above is the "
              "comparison to trust; timings come from a shared machine.", "",
              f"Noise of one position (vocab {meta['vocab_size']}, uncached): {summary['noise_ms_per_position']:.2f} ms.", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
