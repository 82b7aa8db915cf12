"""`AdaptiveK.min_gain` for the bf16 self-draft on this CPU, on the tuning prompts (never the held-out set).

The k policy drafts at all only where perfect drafts would save `min_gain` of a plain step per token. A bf16
self-draft of the default model saves at best about a quarter of a step here, right at the default 0.25, so
whether it drafts flips with the step times measured at load. This bench runs, in one process, plain decoding
and the bf16 self-draft (taking the target's KV) under adaptive k at several `min_gain` values, on the prompts
of bench/speculative.py and bench/cluster.py; each prompt's methods back to back, the order rotating per
repeat; per prompt the median over repeats of (method time per token / plain's), then the lowest and the
median over prompts. Greedy, 64 new tokens, 2 threads.

    .venv/bin/python bench/min_gain.py     # ~4 minutes; writes bench/results/min_gain.{json,md}
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster import PROMPTS as CLUSTER_PROMPTS  # noqa: E402
from cluster import default_pair  # noqa: E402
from speculative import CHAT_PROMPTS, GROUNDED_PROMPTS  # noqa: E402

from specmesh.decoding.adaptive import AdaptiveK  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.drafters.model import self_draft  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402

REPEATS = int(os.environ.get("SPECMESH_BENCH_REPEATS", "3"))
GAINS = (0.25, 0.15, 0.05)
PROMPTS = list(dict.fromkeys([*GROUNDED_PROMPTS, *CHAT_PROMPTS, *CLUSTER_PROMPTS]))


def main() -> None:
    folder, tokenizer, verifier, bf16 = default_pair(2)
    params = SamplingParams(temperature=0, max_new_tokens=64)
    methods = ["plain", *(f"min_gain {g}" for g in GAINS)]
    runs: dict[str, dict[str, list[dict]]] = {m: {p: [] for p in PROMPTS} for m in methods}
    ids_of = {p: chat_prompt_ids(tokenizer, p) for p in PROMPTS}
    generate(verifier, self_draft(bf16, verifier.engine), ids_of[PROMPTS[0]], params, k_policy=AdaptiveK())  # warm-up
    for repeat in range(REPEATS):
        for i, prompt in enumerate(PROMPTS):
            turn = (repeat + i) % len(methods)
            for method in methods[turn:] + methods[:turn]:
                drafter = None if method == "plain" else self_draft(bf16, verifier.engine)
                k_policy = None if method == "plain" else AdaptiveK(min_gain=float(method.split()[1]))
                start = time.perf_counter()
                result = generate(verifier, drafter, ids_of[prompt], params, k_policy=k_policy)
                runs[method][prompt].append({"s": time.perf_counter() - start, "tokens": result.token_ids,
                                             "drafted": result.stats.num_draft_tokens})
        print(f"repeat {repeat + 1}/{REPEATS} done", flush=True)
    rows = []
    for method in methods[1:]:
        per_prompt = {}
        for prompt in PROMPTS:
            ratios = [len(b["tokens"]) / b["s"] / (len(a["tokens"]) / a["s"])
                      for a, b in zip(runs["plain"][prompt], runs[method][prompt])]  # speed over plain's, paired
            per_prompt[prompt] = statistics.median(ratios)
        exact = all(a["tokens"] == b["tokens"] for p in PROMPTS for a, b in zip(runs["plain"][p], runs[method][p]))
        rows.append({"method": method, "exact": exact, "median": statistics.median(per_prompt.values()),
                     "lowest": min(per_prompt.values()), "per_prompt": list(per_prompt.values()),
                     "drafted_per_request": statistics.median(r["drafted"] for p in PROMPTS for r in runs[method][p])})
        print(f"  {method}: median {rows[-1]['median']:.3f}x plain, lowest {rows[-1]['lowest']:.3f}x", flush=True)
    out = {"command": ".venv/bin/python bench/min_gain.py", "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": REPEATS, "prompts": PROMPTS, "rows": rows}
    results = ROOT / "bench" / "results"
    (results / "min_gain.json").write_text(json.dumps(out, indent=1))
    lines = ["# `AdaptiveK.min_gain` for the bf16 self-draft, on the tuning prompts", "",
             f"`{out['command']}` ({out['date']}): default model, fp32 target, bf16 self-draft taking the target's KV, greedy, "
             f"64 new tokens, the {len(PROMPTS)} prompts of bench/speculative.py and bench/cluster.py (never "
             f"bench/prompts/held_out.json) x {REPEATS}, each prompt's methods back to back. Tokens/s over plain decoding, "
             "paired per prompt and repeat; per prompt the median over repeats.", "",
             "| min_gain | exact | median prompt | lowest prompt | drafted per request (median) | per prompt |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method'].split()[1]} | {r['exact']} | {r['median']:.3f}x | {r['lowest']:.3f}x | "
                     f"{r['drafted_per_request']:.0f} | {', '.join(f'{x:.2f}' for x in r['per_prompt'])} |")
    (results / "min_gain.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
