"""The low-bit kernel's instruction-set paths on this CPU, end to end: plain decoding of the default model's
Q4_1 (GGUF blocks) and int8 targets with each build of the kernel, same prompts, same run.

Builds (SPECMESH_LOWBIT_KERNEL): `native` (-march=native: the AVX-512 VNNI path where the CPU has it, AVX2
otherwise), `avx2` (x86-64-v3: the path a CPU with AVX2 but no AVX-512 takes) and `portable` (x86-64-v2:
the plain loops, all a CPU without AVX2 has). Every build must give the same tokens (the kernel's numbers
are equal bit for bit); the table says whether they did. Each build runs in a process of its own (the
kernel is chosen once per process); the builds take turns, REPEATS rounds, and per build the median of
its runs is kept (tok/s includes the prompt's prefill).

    .venv/bin/python bench/lowbit_builds.py [--tokens 32] [--repeats 3]   # ~4 minutes
    -> bench/results/lowbit_builds.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from engine import cpu_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BUILD_NAMES = ("native", "avx2", "portable")
TARGETS = {"Q4_1 (GGUF blocks)": "gguf", "int8 (weight-only)": "int8"}
THREADS = 2


def worker(build: str, tokens: int) -> dict:
    """In a process whose SPECMESH_LOWBIT_KERNEL is `build`: every target's plain decoding of every chat prompt."""
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from speculative import CHAT_PROMPTS
    from transformers import AutoTokenizer

    from specmesh.decoding.sampling import SamplingParams
    from specmesh.decoding.speculative import generate
    from specmesh.decoding.verifier import TargetVerifier
    from specmesh.models.chat import chat_prompt_ids
    from specmesh.models.load import load_engine
    from specmesh.models.lowbit.kernel import library
    from specmesh.models.resolve import resolve_model_spec

    torch.set_num_threads(THREADS)
    lib = library()
    assert lib is not None, f"the {build} build of the kernel could not be made"
    path = "AVX-512 VNNI" if lib.lowbit_has_vnni() else "AVX2" if lib.lowbit_has_avx2() else "plain loops"
    folder = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    out: dict = {"path": path, "targets": {}}
    for name, quantize in TARGETS.items():
        verifier = TargetVerifier(load_engine(folder, dtype="float32", quantize=quantize))
        generate(verifier, None, chat_prompt_ids(tokenizer, "Hi"), SamplingParams(temperature=0.0, max_new_tokens=4))
        runs = []
        for prompt in CHAT_PROMPTS:
            ids = chat_prompt_ids(tokenizer, prompt)
            start = time.perf_counter()
            result = generate(verifier, None, ids, params)
            seconds = time.perf_counter() - start
            runs.append({"tokens": result.token_ids, "tokens_per_s": len(result.token_ids) / seconds})
        out["targets"][name] = runs
    return out


def run_build(build: str, tokens: int) -> dict:
    env = dict(os.environ, SPECMESH_LOWBIT_KERNEL=build, OMP_NUM_THREADS=str(THREADS))
    proc = subprocess.run([sys.executable, __file__, "--worker", build, "--tokens", str(tokens)], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{build} build: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every build (the median is kept)")
    parser.add_argument("--worker", choices=BUILD_NAMES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens)))
        return 0

    runs: dict[str, list[dict]] = {build: [] for build in BUILD_NAMES}
    for repeat in range(args.repeats):
        order = BUILD_NAMES if repeat % 2 == 0 else tuple(reversed(BUILD_NAMES))
        for build in order:
            runs[build].append(run_build(build, args.tokens))
            print(f"  round {repeat + 1}: {build} done", flush=True)

    reference = runs["native"][0]["targets"]
    table: dict = {}
    for name in TARGETS:
        for build in BUILD_NAMES:
            # per prompt the median over rounds, then the median over prompts
            per_prompt = [statistics.median(r["targets"][name][i]["tokens_per_s"] for r in runs[build])
                          for i in range(len(reference[name]))]
            same = all(r["targets"][name][i]["tokens"] == reference[name][i]["tokens"]
                       for r in runs[build] for i in range(len(reference[name])))
            table.setdefault(name, {})[build] = {"path": runs[build][0]["path"], "tokens_per_s": statistics.median(per_prompt),
                                                 "per_prompt": per_prompt, "tokens_equal_native": same}
    out = {"command": f"python bench/lowbit_builds.py --tokens {args.tokens} --repeats {args.repeats}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{cpu_model()}, {os.cpu_count()} cpus",
           "threads": THREADS, "tokens": args.tokens, "repeats": args.repeats, "load_average": os.getloadavg()[0],
           "table": table}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lowbit_builds.json").write_text(json.dumps(out, indent=2) + "\n")
    text = render(out)
    (RESULTS / "lowbit_builds.md").write_text(text)
    print(text)
    return 0 if all(row["tokens_equal_native"] for rows in table.values() for row in rows.values()) else 1


def render(out: dict) -> str:
    lines = ["# The low-bit kernel's instruction-set paths, end to end", "",
             f"Run {out['date']} on {out['machine']}, {out['threads']} threads; load average at the end "
             f"{out['load_average']:.1f}.", "", f"Command: `{out['command']}`", "",
             f"Default model, plain greedy decoding, {out['tokens']} new tokens, the chat prompts of bench/speculative.py, "
             "tok/s including the prefill; per prompt the median of the rounds, then the median over prompts. Each "
             "build runs in a process of its own; the builds take turns. Tokens equal: every run of that build gave "
             "the native build's tokens on every prompt.", "",
             "| target | build | path taken | tok/s | vs the portable build | tokens equal |", "|---|---|---|---|---|---|"]
    for name, rows in out["table"].items():
        portable = rows["portable"]["tokens_per_s"]
        for build, row in rows.items():
            lines.append(f"| {name} | {build} | {row['path']} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / portable:.1f}x | {'yes' if row['tokens_equal_native'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
