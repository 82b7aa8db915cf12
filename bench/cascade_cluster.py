"""The shipped cascade through the Coordinator: configs/local-cascade.yaml as it ships (n-gram Draft ->
bf16 Stage filling the target's k -> fp32 Verify, each its own process, placed as the launcher places
them on this host),
against autoregressive decoding through the same cluster.

    .venv/bin/python bench/cascade_cluster.py [--repeats 3] [--max-new-tokens 64] [--quick]

Greedy, the default model, the chat prompts of bench/speculative.py and bench/cluster.py; each
(prompt, repeat) runs every row back to back (the order reverses each repeat), and a row's figure is
its time per token over autoregressive's of the same prompt and repeat, the median over them (the
highest prompt beside it). Rows, all through the one Coordinator:
- autoregressive (the Verify service's `Run`; the reference)
- speculative, the shipped cascade (`cascade` unset: every configured Stage, cheapest first; lossless)
- speculative, `cascade: "none"` (the n-gram Draft service straight to Verify; lossless)
- speculative, adaptive cascade at lambda 16 (`cascade_lambda`: LOSSY, opt-in; the shipped predictor)
The lossless rows must give autoregressive's tokens; the adaptive row reports its agreement with them.
Goal (issue 29): the shipped cascade <= 0.90x autoregressive time per token on chat prompts, exact.
Writes bench/results/cascade_cluster.{json,md} (`--out` another stem; `--config` another cluster file).

`--ahead`: a second Stage service beside the first, the same but extending ahead (`draft_ahead: true`,
`stage_service/servicer.py`), configured as the Coordinator's second stage; the cascade rows name their
stage per request, a row "speculative, cascade, the Stage extending ahead" is added, and the adaptive row
is left out (its predictor was trained for one stage). Only one of the two Stage services works at a time.
`--pin`: the Stage services on core 0 and the Verify service on core 1, a thread each, so a Stage's forwards
ahead run beside the Verify service's instead of on its cores. `--k K`: the speculative rows at a fixed k
(default 0: the Coordinator's adaptive k).
"""

from __future__ import annotations

import argparse
import asyncio
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
from cluster import through_cluster  # noqa: E402

from client.cluster import Cluster, load_cluster_config  # noqa: E402
from specmesh.proto.v1 import coordinator_pb2  # noqa: E402

CONFIG = ROOT / "configs" / "local-cascade.yaml"
SPEC, AR = coordinator_pb2.GENERATION_MODE_SPECULATIVE, coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between cats and dogs as pets?",
    *[p for p in CLUSTER_PROMPTS if not p.startswith("Repeat")],  # bench/cluster.py's, less its echo prompt
]
LAMBDA = 16.0
ROWS = {  # name: (mode, cascade, cascade_lambda or None)
    "autoregressive": (AR, "", None),
    "speculative, shipped cascade (n-gram -> bf16 fill -> fp32)": (SPEC, "", None),
    "speculative, no cascade (n-gram -> fp32)": (SPEC, "none", None),
    f"speculative, adaptive cascade, lambda {LAMBDA:g} (lossy)": (SPEC, "", LAMBDA),
}
REFERENCE = "autoregressive"
SHIPPED, AHEAD = "speculative, shipped cascade (n-gram -> bf16 fill -> fp32)", "speculative, cascade, the Stage extending ahead"


def with_ahead_stage(config: str, pin: bool = False) -> tuple[str, dict]:
    """`config` with a Stage service `stage_ahead` beside its `stage` (the same, extending ahead), both
    configured on the Coordinator (no predictor), written to a temporary file; and the rows naming each.
    `pin`: the Stage services on core 0, the Verify service on core 1, a thread each."""
    import tempfile

    import yaml

    data = yaml.safe_load(Path(config).read_text())
    services = data["services"]
    if pin:
        services["stage"].update(cpus="0", torch_threads=1)
        services["verify"].update(cpus="1", torch_threads=1)
    ahead = {**services["stage"], "draft_ahead": True, "port": services["stage"]["port"] + 10}
    ahead.pop("metrics_port", None)
    services["stage_ahead"] = ahead
    services["coordinator"]["cascade_stages"] = "stage extend=fill, stage_ahead extend=fill"
    services["coordinator"].pop("cascade_predictor", None)
    path = Path(tempfile.mkdtemp()) / "cascade-ahead.yaml"
    path.write_text(yaml.safe_dump(data))
    rows = {name: ROWS[name] for name in ROWS if ROWS[name][2] is None}
    rows[AHEAD] = (SPEC, "stage_ahead", None)  # the service's name: its address once the cluster runs
    rows[SHIPPED] = (SPEC, "stage", None)
    return str(path), rows


async def one(address: str, prompt: str, mode: int, cascade: str, lam: float | None, max_new_tokens: int, k: int = 0) -> dict:
    return await through_cluster(address, prompt, mode, "service" if mode == SPEC else "", max_new_tokens,
                                 k if mode == SPEC else 0, cascade=cascade, cascade_lambda=lam)


def agreement(tokens: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(tokens, reference)) / max(len(tokens), len(reference), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 1 repeat, 16 tokens (smoke run)")
    parser.add_argument("--config", default=str(CONFIG), help="another cluster file (default: the shipped cascade)")
    parser.add_argument("--out", default="cascade_cluster", help="results file stem under bench/results")
    parser.add_argument("--ahead", action="store_true", help="add a Stage service extending ahead, and its row")
    parser.add_argument("--pin", action="store_true", help="with --ahead: Stage services on core 0, Verify on core 1")
    parser.add_argument("--k", type=int, default=0, help="the speculative rows' fixed k (0: adaptive)")
    args = parser.parse_args()
    prompts = CHAT_PROMPTS[:2] if args.quick else CHAT_PROMPTS
    repeats, max_new = (1, 16) if args.quick else (args.repeats, args.max_new_tokens)
    if args.pin and not args.ahead:
        parser.error("--pin goes with --ahead")
    config, rows_run = with_ahead_stage(args.config, args.pin) if args.ahead else (args.config, ROWS)
    specs = load_cluster_config(config)  # as that file places them on this host
    placement = {s.name: (list(s.cpus), s.torch_threads) for s in specs}
    for spec in specs:
        spec.options["port"] = 0  # free ports: never collides with a running cluster
        spec.options.pop("metrics_port", None)
    runs: dict[str, list[dict]] = {name: [] for name in rows_run}
    with Cluster(specs) as cluster:
        address = cluster.addresses_of("coordinator")[0]
        if args.ahead:  # the rows name their stage by address
            rows_run = {name: (mode, f"{cluster.addresses[cascade]} extend=fill" if cascade in ("stage", "stage_ahead")
                               else cascade, lam) for name, (mode, cascade, lam) in rows_run.items()}
        for mode, cascade, lam in rows_run.values():  # warm-up: kernels, each service's first forward
            asyncio.run(one(address, prompts[0], mode, cascade, lam, 8))
        for repeat in range(repeats):
            for index, prompt in enumerate(prompts):
                order = list(rows_run) if (repeat + index) % 2 == 0 else list(rows_run)[::-1]
                for name in order:
                    run = asyncio.run(one(address, prompt, *rows_run[name], max_new, args.k))
                    run.update(prompt=index, repeat=repeat)
                    runs[name].append(run)
                print(f"[repeat {repeat + 1}/{repeats}, prompt {index}] "
                      + ", ".join(f"{n.split(',')[0] if n == REFERENCE else n}: {runs[n][-1]['wall_s']:.2f} s" for n in rows_run),
                      flush=True)

    def ms_per_token(run: dict) -> float:
        return run["wall_s"] * 1e3 / max(1, len(run["tokens"]))

    reference = {(r["prompt"], r["repeat"]): r for r in runs[REFERENCE]}
    rows = []
    for name, (_mode, _cascade, lam) in rows_run.items():
        mine = runs[name]
        ratios = [ms_per_token(r) / ms_per_token(reference[r["prompt"], r["repeat"]]) for r in mine]
        per_prompt = [statistics.median(x for x, r in zip(ratios, mine) if r["prompt"] == i) for i in range(len(prompts))]
        drafted = sum(r["drafted"] for r in mine)
        agree = [agreement(r["tokens"], reference[r["prompt"], r["repeat"]]["tokens"]) for r in mine]
        rows.append({"row": name, "lossy": lam is not None, "exact": all(a == 1.0 for a in agree),
                     "token_agreement": statistics.mean(agree), "ms_per_token": statistics.median(map(ms_per_token, mine)),
                     "vs_autoregressive": statistics.median(ratios), "highest_prompt": max(per_prompt),
                     "per_prompt": per_prompt, "acceptance": sum(r["accepted"] for r in mine) / drafted if drafted else None,
                     "draft_tokens_per_request": drafted / len(mine)})
        print(f"  {name}: {rows[-1]['ms_per_token']:.1f} ms/token, {rows[-1]['vs_autoregressive']:.3f}x autoregressive",
              flush=True)
    command = ".venv/bin/python bench/cascade_cluster.py" + (" --quick" if args.quick else "") + (
        f" --repeats {args.repeats}" if args.repeats != 3 and not args.quick else "") + (
        f" --max-new-tokens {args.max_new_tokens}" if args.max_new_tokens != 64 and not args.quick else "") + (
        f" --config {args.config}" if args.config != str(CONFIG) else "") + (f" --out {args.out}" if args.out != "cascade_cluster" else "") + (
        " --ahead" if args.ahead else "") + (" --pin" if args.pin else "") + (f" --k {args.k}" if args.k else "")
    out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
           "cores": os.cpu_count(), "placement": placement, "repeats": repeats, "max_new_tokens": max_new,
           "prompts": prompts, "rows": rows, "runs": runs}
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.out}.json").write_text(json.dumps(out, indent=1))
    where = "; ".join(f"{n}: cpus {','.join(map(str, c)) or 'any'}, {t} thread(s)" for n, (c, t) in placement.items())
    lines = ["# The shipped cascade through the Coordinator vs autoregressive", "",
             f"`{command}`, {out['date']}, {out['machine']}, {out['cores']} cores. `{Path(args.config).name}` "
             f"({where}); greedy, {max_new} new tokens, {len(prompts)} chat prompts x {repeats} repeats, rows back to back "
             "per prompt (order reversed each repeat). Ratio: time per token over autoregressive's for the same prompt and "
             "repeat (whole request, prefill and stream included), the median; highest prompt: the largest per-prompt median. "
             "Goal (issue 29): the shipped cascade <= 0.90x, exact.", "",
             "| row | ms/token | vs autoregressive | highest prompt | draft tokens / request | acceptance | exact (token agreement) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        exact = "yes" if r["exact"] else f"NO ({r['token_agreement']:.0%})" if not r["lossy"] else f"lossy ({r['token_agreement']:.0%})"
        lines.append(f"| {r['row']} | {r['ms_per_token']:.1f} | {r['vs_autoregressive']:.3f}x | {r['highest_prompt']:.3f}x | "
                     f"{r['draft_tokens_per_request']:.1f} | {acc} | {exact} |")
    (results / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["exact"] for r in rows if not r["lossy"]) else 1


if __name__ == "__main__":
    sys.exit(main())
