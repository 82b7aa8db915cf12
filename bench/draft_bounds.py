"""What a draft could win at best on this machine, in turn or drafting ahead: each draft's measured costs
and its greedy agreement with the fp32 target, put through the round model with no RPC, Python or
scheduling counted. A bound for the placements of issue 29, not a run of them (bench/draft_ahead.py).

Drafts of the default model: the bf16 self-draft, and int8 and the GGUF's own Q4_1 blocks (the cheaper
levels a cascade would put below it). Measured here:
- the one-token step of each engine, and the verify forward of 1-17 tokens of the fp32 target and of
  the bf16 model (a cascade's middle level), on one thread and on two (medians);
- greedy agreement: the fp32 target's greedy continuation of each chat prompt of bench/cluster.py,
  then every draft fed the prompt and that continuation (in chunks the fast path serves, as drafting
  feeds it) and its argmax at each position compared with the target's token there. Greedy rounds along
  that path are then exact: a round with k drafts from a position accepts the run of agreements (at
  most k) and emits one token more.
Bounds, ms per emitted token at the best k in 1..16:
- in turn, both cores (one process; or a cluster lending cores, less its calls): k draft steps and the
  target's verify forward of k + 1 tokens, all on 2 threads;
- drafting ahead, a core each: per round the Draft process makes k drafts and its guess at the target's
  token on one core while the Verify process verifies k + 1 tokens on the other, so a round takes at least
  the longer of the two (perfect overlap, every guess right);
- a cascade's lower level under the bf16 one (in turn, 2 threads): what a bf16-quality token costs when
  the bf16 model verifies the lower level's drafts instead of drafting it itself (agreement with the bf16
  model's argmax along the target's path, an estimate: the bf16 model's own path differs where it
  disagrees with the target). Below the bf16 step, the lower level makes the middle's tokens cheaper.

    .venv/bin/python bench/draft_bounds.py [--quick]   # ~3 minutes; bench/results/draft_bounds.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster import PROMPTS  # noqa: E402

from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import resolve_model_spec  # noqa: E402

DRAFTS = {"bf16": {"dtype": "bfloat16"}, "int8": {"dtype": "float32", "quantize": "int8"},
          "q4_1": {"dtype": "float32", "quantize": "gguf"}}
MIDDLE = "bf16"  # a cascade's middle level; the levels below it: the other drafts
MAX_K = 16
CONTEXT = 96  # cached tokens when forwards are timed
CHUNK = 16  # continuation tokens per teacher-forced forward (the fast path's sizes, as drafting feeds them)


def forward_ms(engine, rows: int, repeats: int) -> float:
    """Median wall ms of a forward of `rows` new tokens (logits at each) after CONTEXT cached ones."""
    seq = engine.new_sequence()
    try:
        engine.forward([SeqInput(seq, [100 + i % 200 for i in range(CONTEXT)], logits_at=[CONTEXT - 1])])
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            engine.forward([SeqInput(seq, [5] * rows, logits_at=list(range(rows)))])
            times.append((time.perf_counter() - start) * 1e3)
            engine.truncate(seq, CONTEXT)
    finally:
        engine.free(seq)
    return statistics.median(times[1:])  # the first may pay one-off set-up


def argmaxes(engine, prompt: list[int], continuation: list[int]) -> list[int]:
    """The engine's argmax for each token of `continuation` given the prompt and the continuation before it."""
    seq = engine.new_sequence()
    try:
        out = [int(engine.forward([SeqInput(seq, prompt, logits_at=[len(prompt) - 1])])[0][0].argmax())]
        for lo in range(0, len(continuation) - 1, CHUNK):
            chunk = continuation[lo:min(lo + CHUNK, len(continuation) - 1)]
            out += engine.forward([SeqInput(seq, chunk, logits_at=list(range(len(chunk))))])[0].argmax(-1).tolist()
    finally:
        engine.free(seq)
    return out


def rounds_along(agree: list[bool], k: int) -> int:
    """Greedy rounds with k drafts to emit len(agree) tokens: each accepts its run of agreements, then one more."""
    pos = num_rounds = 0
    while pos < len(agree):
        run = 0
        while run < k and pos + run < len(agree) and agree[pos + run]:
            run += 1
        pos, num_rounds = pos + run + 1, num_rounds + 1
    return num_rounds


def best(ms_per_token_at) -> tuple[int, float]:
    return min(((k, ms_per_token_at(k)) for k in range(1, MAX_K + 1)), key=lambda kv: kv[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens, fewer timing repeats")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    max_new, repeats = (24, 3) if args.quick else (args.max_new_tokens, 7)
    folder = str(resolve_model_spec("default"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.set_num_threads(2)
    target = load_engine(folder, dtype="float32")
    drafts = {name: load_engine(folder, **kwargs) for name, kwargs in DRAFTS.items()}

    # greedy agreement along the target's own continuations
    agree: dict[str, list[list[bool]]] = {name: [] for name in drafts}
    agree_middle: dict[str, list[list[bool]]] = {name: [] for name in drafts if name != MIDDLE}
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    for prompt in prompts:
        ids = chat_prompt_ids(tokenizer, prompt)
        path = generate(TargetVerifier(target), None, ids, params).token_ids
        picks = {name: argmaxes(engine, ids, path) for name, engine in drafts.items()}
        for name in drafts:
            agree[name].append([a == b for a, b in zip(picks[name], path, strict=True)])
            if name != MIDDLE:
                agree_middle[name].append([a == b for a, b in zip(picks[name], picks[MIDDLE], strict=True)])

    # costs, on 2 threads then 1
    step: dict[int, dict[str, float]] = {}
    verify: dict[int, dict[str, list[float]]] = {}  # [rows - 1]
    for threads in (2, 1):
        torch.set_num_threads(threads)
        step[threads] = {name: forward_ms(engine, 1, repeats) for name, engine in drafts.items()}
        verify[threads] = {name: [forward_ms(engine, rows, repeats) for rows in range(1, MAX_K + 2)]
                           for name, engine in (("fp32", target), (MIDDLE, drafts[MIDDLE]))}
        step[threads]["fp32"] = verify[threads]["fp32"][0]
    torch.set_num_threads(2)

    def per_token(agreements: list[list[bool]], k: int, round_ms: float) -> float:
        tokens = sum(map(len, agreements))
        return sum(rounds_along(a, k) for a in agreements) * round_ms / tokens

    plain = step[2]["fp32"]
    rows = []
    for name in drafts:
        d2, d1, v2, v1 = step[2][name], step[1][name], verify[2]["fp32"], verify[1]["fp32"]
        in_turn = best(lambda k, d2=d2, v2=v2, name=name: per_token(agree[name], k, k * d2 + v2[k]))
        ahead = best(lambda k, d1=d1, v1=v1, name=name: per_token(agree[name], k, max(v1[k], (k + 1) * d1)))
        paths = agree[name]
        rows.append({"draft": name, "agreement": sum(map(sum, paths)) / sum(map(len, paths)),
                     "tokens_per_round_k4": sum(map(len, paths)) / sum(rounds_along(a, 4) for a in paths),
                     "in_turn_k": in_turn[0], "in_turn_ms_per_token": in_turn[1],
                     "ahead_k": ahead[0], "ahead_ms_per_token": ahead[1]})
    cascade = []
    for name, agreements in agree_middle.items():
        d2, vm = step[2][name], verify[2][MIDDLE]
        k, ms = best(lambda k, d2=d2, vm=vm, agreements=agreements: per_token(agreements, k, k * d2 + vm[k]))
        cascade.append({"lower": name, "agreement_with_middle": sum(map(sum, agreements)) / sum(map(len, agreements)),
                        "k": k, "ms_per_middle_token": ms, "middle_step_ms": step[2][MIDDLE]})

    command = "`.venv/bin/python bench/draft_bounds.py" + (" --quick" if args.quick else "") + "`"
    out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
           "cores": os.cpu_count(), "torch": torch.__version__, "prompts": prompts, "max_new_tokens": max_new,
           "note": args.note, "step_ms": step, "verify_ms": verify, "plain_ms_per_token": plain, "drafts": rows,
           "cascade": cascade}
    results = ROOT / "bench" / "results"
    (results / "draft_bounds.json").write_text(json.dumps(out, indent=1))
    lines = [
        "# What a draft could win at best here: in turn on both cores, or drafting ahead on a core each", "",
        f"{command}, {out['date']}, {out['machine']} with {out['cores']} cores, torch {out['torch']}; default model "
        f"(SmolLM2-135M-Instruct), fp32 target; {len(prompts)} chat prompts of bench/cluster.py, the target's greedy "
        f"continuation of {max_new} tokens each. The module docstring says how each figure is made: measured costs "
        "and exact greedy rounds along the target's path, no RPC, Python or scheduling counted.",
        *([f"\nNote: {args.note}"] if args.note else []), "",
        "## Costs (ms; medians)", "",
        "| engine | step, 2 threads | step, 1 thread | verify 5 tokens, 2 threads | verify 5 tokens, 1 thread |",
        "|---|---|---|---|---|",
    ]
    for name in ("fp32", *drafts):
        v = verify[2].get(name), verify[1].get(name)
        lines.append(f"| {name} | {step[2][name]:.1f} | {step[1][name]:.1f} | "
                     f"{f'{v[0][4]:.1f}' if v[0] else '-'} | {f'{v[1][4]:.1f}' if v[1] else '-'} |")
    lines += [
        "", f"## Bounds against plain fp32 decoding on 2 threads ({plain:.1f} ms a token)", "",
        "| draft | agreement with the target | tokens/round at k = 4 | in turn, both cores: best k, ms/token (/ plain) | "
        "drafting ahead, a core each: best k, ms/token at least (/ plain) | drafting ahead / in turn |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['draft']} | {r['agreement']:.1%} | {r['tokens_per_round_k4']:.2f} | k = {r['in_turn_k']}: "
                     f"{r['in_turn_ms_per_token']:.1f} ({r['in_turn_ms_per_token'] / plain:.2f}x) | k = {r['ahead_k']}: "
                     f"{r['ahead_ms_per_token']:.1f} ({r['ahead_ms_per_token'] / plain:.2f}x) | "
                     f"{r['ahead_ms_per_token'] / r['in_turn_ms_per_token']:.2f}x |")
    lines += [
        "", f"## A cascade's lower level under the {MIDDLE} one (in turn, 2 threads)", "",
        f"| lower level | agreement with {MIDDLE} | best k | ms per {MIDDLE}-quality token | {MIDDLE} drafting it itself (its step) |",
        "|---|---|---|---|---|",
    ]
    for c in cascade:
        lines.append(f"| {c['lower']} | {c['agreement_with_middle']:.1%} | {c['k']} | {c['ms_per_middle_token']:.1f} | "
                     f"{c['middle_step_ms']:.1f} |")
    (results / "draft_bounds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
