"""Engine benchmark: native engine vs transformers on the default model (SmolLM2-135M), CPU.

    .venv/bin/python bench/engine.py [--quick]

Measures, side by side in one process (medians of repeated runs):
- greedy decode tokens/s, target only: our engine vs transformers `generate`, fp32 and bf16,
  same chat prompts, 128 new tokens (EOS ignored on both sides so every run decodes 128 tokens);
- cost of one forward verifying k+1 = 2, 4, 5, 8 tokens relative to decoding 1 token;
- a batch of 1 / 4 / 16 sequences x 5 tokens relative to 1 x 5;
- achieved weight-read bandwidth of a decode step vs the machine's read bandwidth (summing a
  large tensor) measured in the same run.
Writes bench/results/engine.json and bench/results/engine.md.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.load import load_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = (
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
)
VERIFY_SIZES = (2, 4, 5, 8)
BATCH_SIZES = (1, 4, 16)
CONTEXT_TOKENS = 128  # cached tokens before the verify / batch measurements


def median_time_s(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth_gb_s() -> float:
    big = torch.ones(512 * 1024 * 1024 // 4)  # 512 MiB
    seconds = median_time_s(lambda: big.sum(), repeats=7)
    return big.numel() * 4 / seconds / 1e9


def our_generate(engine, prompt_ids: list[int], num_new: int) -> list[int]:
    seq = engine.new_sequence()
    logits = engine.forward([SeqInput(seq, prompt_ids, [len(prompt_ids) - 1])])[0]
    tokens = [int(logits[0].argmax())]
    while len(tokens) < num_new:
        logits = engine.forward([SeqInput(seq, [tokens[-1]], [0])])[0]
        tokens.append(int(logits[0].argmax()))
    engine.free(seq)
    return tokens


def hf_generate(model, prompt_ids: list[int], num_new: int, pad_id: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, pad_token_id=pad_id
        )
    return out[0, len(prompt_ids) :].tolist()


def decode_throughput(path, tokenizer, dtype: str, num_new: int, runs: int) -> dict:
    from transformers import AutoModelForCausalLM

    prompts = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    engine = load_engine(path, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ours_tps, hf_tps, same = [], [], []
    our_generate(engine, prompts[0], 8)
    hf_generate(model, prompts[0], 8, pad_id)
    for _ in range(runs):  # interleaved, so load from other processes hits both alike
        for prompt in prompts:
            start = time.perf_counter()
            ours = our_generate(engine, prompt, num_new)
            ours_tps.append(num_new / (time.perf_counter() - start))
            start = time.perf_counter()
            theirs = hf_generate(model, prompt, num_new, pad_id)
            hf_tps.append(num_new / (time.perf_counter() - start))
            same.append(ours == theirs)
    ours_med, hf_med = statistics.median(ours_tps), statistics.median(hf_tps)
    step_s = median_time_s(lambda: _decode_step(engine), repeats=11)
    result = {
        "dtype": dtype,
        "new_tokens": num_new,
        "ours_tokens_per_s": round(ours_med, 2),
        "transformers_tokens_per_s": round(hf_med, 2),
        "speedup": round(ours_med / hf_med, 3),
        "identical_outputs": f"{sum(same)}/{len(same)}",
        "decode_step_ms": round(step_s * 1e3, 2),
        "weight_bytes": engine.model.weight_bytes,
        "weight_read_gb_s": round(engine.model.weight_bytes / step_s / 1e9, 2),
        "verify": verify_costs(engine),
        "batch": batch_costs(engine),
    }
    del model
    return result


_STEP_SEQ: dict[int, int] = {}


def _decode_step(engine) -> None:
    seq = _STEP_SEQ.get(id(engine))
    if seq is None:
        seq = _STEP_SEQ[id(engine)] = engine.new_sequence()
        engine.forward([SeqInput(seq, list(range(10, 10 + CONTEXT_TOKENS)), [0])])
    engine.forward([SeqInput(seq, [42], [0])])
    engine.truncate(seq, CONTEXT_TOKENS)


def verify_costs(engine, repeats: int = 11) -> dict:
    """Time of one forward of k+1 chain tokens (logits at all) on a 128-token cache / time of 1 token."""
    seq = engine.new_sequence()
    engine.forward([SeqInput(seq, list(range(10, 10 + CONTEXT_TOKENS)), [0])])

    def step(num_tokens: int):
        engine.forward([SeqInput(seq, list(range(50, 50 + num_tokens)), list(range(num_tokens)))])
        engine.truncate(seq, CONTEXT_TOKENS)

    sizes = (1,) + VERIFY_SIZES
    times = {n: [] for n in sizes}
    for _ in range(repeats):  # interleaved rounds
        for n in sizes:
            start = time.perf_counter()
            step(n)
            times[n].append(time.perf_counter() - start)
    base = statistics.median(times[1])
    engine.free(seq)
    return {f"{n}_tokens_vs_1": round(statistics.median(times[n]) / base, 3) for n in VERIFY_SIZES} | {
        "1_token_ms": round(base * 1e3, 2)
    }


def batch_costs(engine, repeats: int = 7, tokens_each: int = 5) -> dict:
    """Time of one forward of B sequences x 5 tokens / time of 1 x 5."""
    seqs = []
    for i in range(max(BATCH_SIZES)):
        seq = engine.new_sequence()
        engine.forward([SeqInput(seq, list(range(10 + i, 10 + i + CONTEXT_TOKENS)), [0])])
        seqs.append(seq)

    def step(batch_size: int):
        batch = [SeqInput(s, list(range(60, 60 + tokens_each)), list(range(tokens_each))) for s in seqs[:batch_size]]
        engine.forward(batch)
        for s in seqs[:batch_size]:
            engine.truncate(s, CONTEXT_TOKENS)

    times = {b: [] for b in BATCH_SIZES}
    step(1)
    for _ in range(repeats):
        for b in BATCH_SIZES:
            start = time.perf_counter()
            step(b)
            times[b].append(time.perf_counter() - start)
    base = statistics.median(times[1])
    for s in seqs:
        engine.free(s)
    return {f"{b}x{tokens_each}_vs_1x{tokens_each}": round(statistics.median(times[b]) / base, 3) for b in BATCH_SIZES[1:]} | {
        f"1x{tokens_each}_ms": round(base * 1e3, 2)
    }


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        "# Engine benchmark",
        "",
        f"Model {report['model']}, {report['machine']}, torch {report['torch']}, {report['threads']} threads. "
        f"Read bandwidth (sum of 512 MiB): {report['read_bandwidth_gb_s']} GB/s.",
        "",
        "| dtype | ours tok/s | transformers tok/s | speedup | identical | step ms | weight GB/s | "
        + " | ".join(f"verify {n} / 1" for n in VERIFY_SIZES)
        + " | "
        + " | ".join(f"{b}x5 / 1x5" for b in BATCH_SIZES[1:])
        + " |",
        "|" + "---|" * (7 + len(VERIFY_SIZES) + len(BATCH_SIZES) - 1),
    ]
    for r in report["results"]:
        cells = [
            r["dtype"], r["ours_tokens_per_s"], r["transformers_tokens_per_s"], f"{r['speedup']}x",
            r["identical_outputs"], r["decode_step_ms"], r["weight_read_gb_s"],
        ]
        cells += [f"{r['verify'][f'{n}_tokens_vs_1']}x" for n in VERIFY_SIZES]
        cells += [f"{r['batch'][f'{b}x5_vs_1x5']}x" for b in BATCH_SIZES[1:]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        f"Greedy decode of {report['new_tokens']} new tokens (EOS ignored), medians over {report['runs']} runs x "
        f"{len(PROMPTS)} prompts, ours and transformers `generate` interleaved. Verify and batch costs: one "
        f"forward on a {CONTEXT_TOKENS}-token cache, medians of interleaved rounds. Weight GB/s = bytes of weights "
        "read per decode step / step time. The machine is shared: absolute numbers move with load; ratios are "
        "measured side by side.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from specmesh.models.resolve import resolve_model_spec

    path = resolve_model_spec(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    report = {
        "model": str(args.model),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "torch": torch.__version__,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "read_bandwidth_gb_s": round(read_bandwidth_gb_s(), 2),
        "results": [],
    }
    for dtype in args.dtypes.split(","):
        result = decode_throughput(path, tokenizer, dtype, args.new_tokens, args.runs)
        print(json.dumps(result), flush=True)
        report["results"].append(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, RESULTS / "engine.md")
    print((RESULTS / "engine.md").read_text())


if __name__ == "__main__":
    main()
