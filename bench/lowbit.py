"""Low-bit targets on the CPU: plain and n-gram speculative decoding tok/s, and exactness.

Targets (default model, 2 threads, greedy): fp32; `quantize="int8"` (weight-only, batch-invariant);
the GGUF's own Q4_1 blocks (`quantize="gguf"`); and llama.cpp on the same GGUF file where
`llama-cpp-python` is installed (optional: the table says when it is absent). For every target of
ours: plain decoding, then n-gram (prompt lookup) speculative decoding with adaptive k, whose output
must equal that target's own plain output. Methods alternate per prompt; medians over prompts.

    .venv/bin/python bench/lowbit.py [--max-new-tokens 64] [--quick]
    -> bench/results/lowbit.{json,md}
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

from speculative import CHAT_PROMPTS, GROUNDED_PROMPTS  # noqa: E402

from specmesh.decoding.adaptive import AdaptiveK  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import generate  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.drafters.ngram import PromptLookupDrafter  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402
from specmesh.models.resolve import gguf_file, resolve_model_spec  # noqa: E402

THREADS = 2
TARGETS = {"fp32": {}, "int8 (weight-only)": {"quantize": "int8"}, "Q4_1 (GGUF blocks)": {"quantize": "gguf"}}
GOAL_TARGET = "Q4_1 (GGUF blocks)"  # the one compared with llama.cpp on the same file


def weight_bytes(engine) -> int:
    """Bytes of the engine's parameters and buffers (what one decode step reads, about)."""
    model = getattr(engine, "model", None)
    return int(model.weight_bytes) if model is not None and hasattr(model, "weight_bytes") else 0


def ours(verifier: TargetVerifier, ids: list[int], max_new_tokens: int, speculative: bool) -> dict:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    drafter = PromptLookupDrafter(min_n=1, max_n=4) if speculative else None
    start = time.perf_counter()
    result = generate(verifier, drafter, ids, params, k_policy=AdaptiveK() if speculative else None)
    seconds = time.perf_counter() - start
    return {"tokens": result.token_ids, "seconds": seconds, "tokens_per_s": len(result.token_ids) / seconds}


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return str(llama_cpp.__version__)


def kernel_description() -> str:
    from specmesh.models.lowbit.kernel import library

    lib = library()
    if lib is None:
        return "torch fallback (no C++ compiler)"
    if lib.lowbit_has_vnni():
        return "compiled, AVX-512 VNNI integer dots"
    return "compiled, AVX2 integer dots" if lib.lowbit_has_avx2() else "compiled, portable integer dots"


def llama_cpp_runner(path: str):
    """A greedy plain-decoding runner on the GGUF through llama-cpp-python, or None when absent."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_threads=THREADS, n_ctx=2048, verbose=False)

    def run(ids: list[int], max_new_tokens: int) -> dict:
        llm.reset()
        start = time.perf_counter()
        tokens = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token == llm.token_eos() or len(tokens) >= max_new_tokens:
                break
            tokens.append(int(token))
        seconds = time.perf_counter() - start
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": len(tokens) / seconds}

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="one prompt per set, 24 tokens, one run (smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per prompt and method (the median is kept)")
    args = parser.parse_args()
    if args.quick:
        args.max_new_tokens, args.repeats = 24, 1
    torch.set_num_threads(THREADS)
    from transformers import AutoTokenizer

    folder = resolve_model_spec("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sets = {"input-grounded": GROUNDED_PROMPTS, "chat": CHAT_PROMPTS}
    if args.quick:
        sets = {name: prompts[:1] for name, prompts in sets.items()}
    print("loading targets ...", flush=True)
    engines = {name: load_engine(folder, dtype="float32", **kwargs) for name, kwargs in TARGETS.items()}
    verifiers = {name: TargetVerifier(engine) for name, engine in engines.items()}
    llama = llama_cpp_runner(str(gguf_file("default")))
    warm = chat_prompt_ids(tokenizer, "Hi")
    grounded_warm = chat_prompt_ids(tokenizer, GROUNDED_PROMPTS[0])
    for verifier in verifiers.values():  # kernels, caches, and the verifier's fit of a verified token's cost
        ours(verifier, warm, 8, False)
        ours(verifier, grounded_warm, 16, True)
    if llama is not None:
        llama(warm, 8)

    rows: dict = {s: {} for s in sets}
    exact: dict = {name: [0, 0] for name in TARGETS}
    for set_name, prompts in sets.items():
        for index, prompt in enumerate(prompts):
            ids = chat_prompt_ids(tokenizer, prompt)
            names = list(TARGETS) if index % 2 == 0 else list(reversed(TARGETS))
            for name in names:  # per prompt: the median of `repeats` runs, plain and SD alternating
                plains, specs = [], []
                for _ in range(args.repeats):
                    plains.append(ours(verifiers[name], ids, args.max_new_tokens, False))
                    specs.append(ours(verifiers[name], ids, args.max_new_tokens, True))
                plain_tps = statistics.median(r["tokens_per_s"] for r in plains)
                spec_tps = statistics.median(r["tokens_per_s"] for r in specs)
                rows[set_name].setdefault(f"{name} plain", []).append(plain_tps)
                rows[set_name].setdefault(f"{name} n-gram SD", []).append(spec_tps)
                rows[set_name].setdefault(f"{name} SD / plain", []).append(spec_tps / plain_tps)
                exact[name][0] += all(r["tokens"] == plains[0]["tokens"] for r in plains + specs)
                exact[name][1] += 1
            if llama is not None:
                reference = statistics.median(llama(ids, args.max_new_tokens)["tokens_per_s"] for _ in range(args.repeats))
                rows[set_name].setdefault("llama.cpp plain", []).append(reference)
                for method in ("plain", "n-gram SD"):
                    ours_tps = rows[set_name][f"{GOAL_TARGET} {method}"][-1]
                    rows[set_name].setdefault(f"{GOAL_TARGET} {method} / llama.cpp plain", []).append(ours_tps / reference)
            print(f"  {set_name} prompt {index}: done", flush=True)

    medians = {s: {k: statistics.median(v) for k, v in r.items()} for s, r in rows.items()}
    out = {"model": "default (SmolLM2-135M-Instruct)", "machine": platform.processor() or platform.machine(),
           "threads": THREADS, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "load_average": os.getloadavg(),
           "llama_cpp": llama is not None, "llama_cpp_version": llama_cpp_version(),
           "kernel": kernel_description(), "weight_mb": {n: weight_bytes(e) / 1e6 for n, e in engines.items()},
           "exact": {n: f"{a}/{b}" for n, (a, b) in exact.items()}, "medians": medians, "runs": rows}
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "lowbit.json").write_text(json.dumps(out, indent=2))
    text = render(out)
    (results / "lowbit.md").write_text(text)
    print(text)
    return 0


def render(out: dict) -> str:
    lines = ["# Low-bit targets (CPU)", "",
             f"`.venv/bin/python bench/lowbit.py`: {out['model']}, {out['machine']}, {out['threads']} threads, greedy, "
             f"{out['max_new_tokens']} new tokens, chat-templated prompts; per prompt the median of {out['repeats']} runs, then "
             "medians over prompts (the lowest prompt in brackets for SD / plain); load average at the end "
             f"{out['load_average'][0]:.1f}. Low-bit kernel: {out['kernel']}. Each tok/s includes the prompt's prefill.", ""]
    if out["llama_cpp"]:
        lines += [f"llama.cpp: llama-cpp-python {out['llama_cpp_version']} on the same GGUF file, 2 threads, greedy "
                  "(its own generate loop).", ""]
    if not out["llama_cpp"]:
        lines += ["llama.cpp: `llama-cpp-python` is not installed here, so there is no llama.cpp row (pip install "
                  "llama-cpp-python to add it).", ""]
    for set_name, medians in out["medians"].items():
        lines += [f"## {set_name}", "", "| target | tok/s, or ratio (x) |", "|---|---|"]
        runs = out["runs"][set_name]
        lines += [f"| {name} | {value:.2f}{'x' if ' / ' in name else ''}"
                  f"{f' (lowest {min(runs[name]):.2f}x)' if name.endswith('SD / plain') else ''} |" for name, value in medians.items()]
        lines.append("")
    lines += ["| target | weights MB | every run's output (plain and n-gram SD) equal, prompts |", "|---|---|---|"]
    lines += [f"| {n} | {out['weight_mb'][n]:.0f} | {out['exact'][n]} |" for n in out["exact"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
