"""Engine benchmark on the default model (SmolLM2-135M-Instruct), CPU: our plain decoding against the
decoders users would run instead, side by side in one run.

    .venv/bin/python bench/engine.py [--quick]              # suite "cpu" (default): bench/results/engine-cpu.*
    .venv/bin/python bench/engine.py --suite dtypes [--dtypes float32,bfloat16]   # the fp32/bf16 suite:
                                                            # bench/results/engine.* (also when --dtypes is given)

Suite "cpu" (fp32, batch 1, greedy, EOS ignored so every run makes --new-tokens tokens, time includes the
prefill; the machine's threads, 2 here):
- per prompt of PEER_PROMPTS: tokens/s of our plain decoding (`generate` with no drafter: the verifier,
  the speculation state, the engine, exactly what a user's plain request runs), of vLLM (when present, see
  below) and of transformers `generate` on the same weights; the methods alternate prompt by prompt (the
  order flips every run), medians over --runs; ours / vLLM side by side per prompt and on the median prompt;
- 16 sessions at once in one engine, prefill included: ours (`TargetVerifier.open_many` + `verify_many`
  rounds) against vLLM's `LLM.generate` over the same 16 prompts, aggregate tokens/s, alternating runs;
- the decode step: ms, weight bytes read per second, against the machine's read bandwidth (sum of 512 MiB),
  and the cost of verifying k + 1 tokens relative to one step.
vLLM is a peer, never a dependency: it runs in its own python (`--vllm-python`, else $SPECMESH_VLLM_PYTHON,
else /work/vllm-venv/bin/python when it exists) as a subprocess (bench/vllm_peer.py), so its torch and
threads never share our process; without it the report says so and compares with transformers only.
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


PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps, flows along the border between Germany and France, and "
    "reaches the North Sea in the Netherlands. It is about 1,230 kilometres long. For centuries the Rhine has been "
    "one of the most important trade routes in Europe: barges carry coal, grain, chemicals and containers between "
    "the port of Rotterdam and cities such as Duisburg, Cologne and Basel."
)
# open questions and tasks, short and long, and passages to work from (the grounded prompts are longer)
PEER_PROMPTS = (
    "Explain how a hash table works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a virus and a bacterium?",
    "Give me five tips for sleeping better, with one sentence of explanation each.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Why is the sky blue? Answer for a curious ten-year-old.",
    f"Summarize the following passage in three sentences.\n\n{PASSAGE}",
    f"List every city named in this passage, one per line, with what the passage says about it.\n\n{PASSAGE}",
    "Compare renting and buying a home: list the advantages of each.",
    "Translate into French: 'The weather is nice today, so we will walk to the market and buy some bread.'",
    f"Write three quiz questions, with answers, about this passage.\n\n{PASSAGE}",
    "Describe the water cycle step by step.",
)
QUICK_PROMPTS = 4
CONCURRENT_SESSIONS = 16
PAUSE_S = 0.3  # between methods: the previous one's idle OpenMP threads stop spinning before the next is timed


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def default_vllm_python() -> str | None:
    for candidate in (os.environ.get("SPECMESH_VLLM_PYTHON"), "/work/vllm-venv/bin/python"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


class VllmPeer:
    """bench/vllm_peer.py in vLLM's own python: one command per line, one result line back."""

    def __init__(self, python: str, folder: Path, threads: int, log_path: Path):
        import subprocess

        from bench.vllm_peer import RESULT_PREFIX

        self.prefix = RESULT_PREFIX
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"))
        env.pop("PYTHONPATH", None)
        self.log = open(log_path, "w")  # vLLM's own log lines (its results go to stdout)
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("vllm_peer.py")), str(folder)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self.prefix):
                return json.loads(line[len(self.prefix):])
            self.log.write(line)
        raise RuntimeError(f"vLLM peer exited (code {self.proc.wait()}); see {self.log.name}")

    def wait_ready(self) -> None:
        self._read()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self.log.close()


def ours_plain(verifier, prompt_ids: list[int], num_new: int) -> tuple[float, list[int]]:
    """Our plain decoding as a user runs it (no drafter); seconds including the prefill."""
    from specmesh.decoding.sampling import SamplingParams
    from specmesh.decoding.speculative import generate

    params = SamplingParams(temperature=0.0, max_new_tokens=num_new, ignore_eos=True)
    start = time.perf_counter()
    tokens = generate(verifier, None, prompt_ids, params).token_ids
    return time.perf_counter() - start, tokens


def ours_concurrent(verifier, prompts: list[list[int]], num_new: int) -> tuple[float, list[list[int]]]:
    """All prompts as sessions of one engine: one prefill forward, then one forward per round for all."""
    from specmesh.decoding.proposal import DraftProposal
    from specmesh.decoding.sampling import SamplingParams, make_generator

    params = [SamplingParams(temperature=0.0, max_new_tokens=num_new, ignore_eos=True)] * len(prompts)
    start = time.perf_counter()
    sessions = verifier.open_many(prompts, params, [make_generator(0)[0] for _ in prompts])
    try:
        for _ in range(num_new - 1):
            verifier.verify_many(sessions, [DraftProposal(token_ids=[])] * len(sessions))
        seconds = time.perf_counter() - start
        return seconds, [s.token_ids[len(p):] for s, p in zip(sessions, prompts)]
    finally:
        for session in sessions:
            verifier.close(session)


def hf_plain(model, prompt_ids: list[int], num_new: int, pad_id: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = hf_generate(model, prompt_ids, num_new, pad_id)
    return time.perf_counter() - start, tokens


def cpu_peers(args, path, tokenizer) -> dict:
    from transformers import AutoModelForCausalLM

    from specmesh.decoding.verifier import TargetVerifier

    texts = PEER_PROMPTS[:QUICK_PROMPTS] if args.quick else PEER_PROMPTS
    prompts = [chat_prompt_ids(tokenizer, t) for t in texts]
    vllm_python = None if args.no_vllm else (args.vllm_python or default_vllm_python())
    peer = None
    if vllm_python:  # started first: its start-up (minutes when its compile cache is cold) overlaps our loading
        RESULTS.mkdir(parents=True, exist_ok=True)
        peer = VllmPeer(vllm_python, path, args.threads, Path(args.vllm_log))
    engine = load_engine(path, dtype="float32")
    verifier = TargetVerifier(engine)
    hf = None if args.no_transformers else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if peer is not None:
        start = time.perf_counter()
        peer.wait_ready()
        print(f"vLLM peer ready after {time.perf_counter() - start:.0f} s more", flush=True)

    methods = {"ours": lambda ids: ours_plain(verifier, ids, args.new_tokens)}
    if peer is not None:
        def run_vllm(ids):
            result = peer.generate([ids], args.new_tokens)
            return result["seconds"], result["token_ids"][0]
        methods["vllm"] = run_vllm
    if hf is not None:
        methods["transformers"] = lambda ids: hf_plain(hf, ids, args.new_tokens, pad_id)
    for run in methods.values():  # warm-up: first-call allocations, kernel selection, the fast path's build
        run(prompts[0][:8])
        run(prompts[-1])

    per_prompt = [{"prompt": i, "prompt_tokens": len(ids), "runs": {m: [] for m in methods}, "tokens": {}}
                  for i, ids in enumerate(prompts)]
    for run_index in range(args.runs):
        for i, ids in enumerate(prompts):
            order = list(methods) if (run_index + i) % 2 == 0 else list(reversed(methods))
            for name in order:
                time.sleep(PAUSE_S)
                seconds, tokens = methods[name](ids)
                per_prompt[i]["runs"][name].append(round(len(tokens) / seconds, 3))
                per_prompt[i]["tokens"][name] = tokens
            cells = ", ".join(f"{m} {per_prompt[i]['runs'][m][-1]:.1f}" for m in methods)
            print(f"[run {run_index} prompt {i}] tok/s: {cells}", flush=True)
    for row in per_prompt:
        tokens = row.pop("tokens")
        row["tokens_per_s"] = {m: round(statistics.median(v), 2) for m, v in row["runs"].items()}
        for peer_name in [m for m in methods if m != "ours"]:
            row[f"ours_vs_{peer_name}"] = round(row["tokens_per_s"]["ours"] / row["tokens_per_s"][peer_name], 3)
            row[f"same_tokens_as_{peer_name}"] = tokens["ours"] == tokens[peer_name]
    summary = {}
    for peer_name in [m for m in methods if m != "ours"]:
        ratios = [row[f"ours_vs_{peer_name}"] for row in per_prompt]
        summary[peer_name] = {
            "median_prompt_ratio": round(statistics.median(ratios), 3),
            "lowest_prompt_ratio": round(min(ratios), 3),
            "identical_outputs": f"{sum(row[f'same_tokens_as_{peer_name}'] for row in per_prompt)}/{len(per_prompt)}",
        }
    summary["median_tokens_per_s"] = {m: round(statistics.median(row["tokens_per_s"][m] for row in per_prompt), 2)
                                      for m in methods}

    concurrent = None
    if args.concurrent_runs:
        many = [prompts[i % len(prompts)] for i in range(CONCURRENT_SESSIONS)]
        concurrent_methods = {"ours": lambda: ours_concurrent(verifier, many, args.concurrent_tokens)}
        if peer is not None:
            def vllm_many():
                result = peer.generate(many, args.concurrent_tokens)
                return result["seconds"], result["token_ids"]
            concurrent_methods["vllm"] = vllm_many
        for run in concurrent_methods.values():
            run()
        times: dict[str, list[float]] = {m: [] for m in concurrent_methods}
        for run_index in range(args.concurrent_runs):
            order = list(concurrent_methods) if run_index % 2 == 0 else list(reversed(concurrent_methods))
            for name in order:
                time.sleep(PAUSE_S)
                seconds, outputs = concurrent_methods[name]()
                times[name].append(sum(len(o) for o in outputs) / seconds)
            print(f"[concurrent run {run_index}] aggregate tok/s: "
                  + ", ".join(f"{m} {times[m][-1]:.1f}" for m in concurrent_methods), flush=True)
        concurrent = {"sessions": CONCURRENT_SESSIONS, "new_tokens": args.concurrent_tokens,
                      "runs": {m: [round(t, 2) for t in v] for m, v in times.items()},
                      "tokens_per_s": {m: round(statistics.median(v), 2) for m, v in times.items()}}
        if "vllm" in times:
            concurrent["ours_vs_vllm"] = round(concurrent["tokens_per_s"]["ours"] / concurrent["tokens_per_s"]["vllm"], 3)
    if peer is not None:
        peer.close()
    if hf is not None:
        del hf

    step_s = median_time_s(lambda: _decode_step(engine), repeats=21)
    return {
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "methods": list(methods),
        "vllm_python": vllm_python,
        "per_prompt": per_prompt,
        "summary": summary,
        "concurrent": concurrent,
        "decode_step_ms": round(step_s * 1e3, 2),
        "weight_bytes": engine.model.weight_bytes,
        "weight_read_gb_s": round(engine.model.weight_bytes / step_s / 1e9, 2),
        "fast_path": engine.model.fast is not None,
        "verify": verify_costs(engine),
    }


def write_cpu_markdown(report: dict, path: Path) -> None:
    r = report["cpu"]
    peers = [m for m in r["methods"] if m != "ours"]
    lines = [
        "# Engine on CPU: our plain decoding against vLLM and transformers",
        "",
        f"Run {report['date']} on {report['machine']}, torch {report['torch']}, {report['threads']} threads; "
        f"read bandwidth (sum of 512 MiB) {report['read_bandwidth_gb_s']} GB/s. "
        "The machine may be shared (the note says how it was): absolute tokens/s move with other jobs' load; the "
        "ratios are measured back to back, methods alternating prompt by prompt.",
        "",
        f"Command: `{report['command']}`",
        "",
        *([f"Note: {report['note']}", ""] if report.get("note") else []),
        f"Default model (SmolLM2-135M-Instruct) in float32, batch 1, greedy, {r['new_tokens']} new tokens (EOS "
        f"ignored), time including the prefill, medians of {r['runs']} runs per prompt. Ours: `generate` with no "
        "drafter (verifier, speculation state, engine). vLLM: "
        + ("`vllm-cpu` 0.32.0 in its own venv, `LLM.generate` on token ids, dtype float32, "
           "VLLM_CPU_OMP_THREADS_BIND over the same cores, its automatic prefix cache emptied before each call (the "
           "same prompts come back run after run; bench/vllm_peer.py)." if "vllm" in peers else
           "**not installed on this machine: no vLLM column** (see bench/vllm_peer.py for the setup).")
        + (" transformers: `generate` on the same weights." if "transformers" in peers else ""),
        "",
        "| prompt | prompt tokens | " + " | ".join(f"{m} tok/s" for m in r["methods"]) + " | "
        + " | ".join(f"ours / {p}" for p in peers) + " |",
        "|" + "---|" * (2 + len(r["methods"]) + len(peers)),
    ]
    for row in r["per_prompt"]:
        cells = [row["prompt"], row["prompt_tokens"]] + [row["tokens_per_s"][m] for m in r["methods"]]
        cells += [f"{row[f'ours_vs_{p}']}x" for p in peers]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("| **median** | | " + " | ".join(str(r["summary"]["median_tokens_per_s"][m]) for m in r["methods"])
                 + " | " + " | ".join(f"**{r['summary'][p]['median_prompt_ratio']}x**" for p in peers) + " |")
    lines.append("")
    for p in peers:
        s = r["summary"][p]
        lines.append(f"- ours / {p}: median prompt {s['median_prompt_ratio']}x, lowest prompt {s['lowest_prompt_ratio']}x; "
                     f"identical greedy tokens on {s['identical_outputs']} prompts.")
    c = r["concurrent"]
    if c:
        cells = ", ".join(f"{m} {v} tok/s" for m, v in c["tokens_per_s"].items())
        ratio = f" (ours / vLLM {c['ours_vs_vllm']}x)" if "ours_vs_vllm" in c else ""
        lines.append(f"- {c['sessions']} sessions at once in one engine, {c['new_tokens']} tokens each, prefill "
                     f"included, aggregate: {cells}{ratio}; runs: {c['runs']}.")
    lines.append(f"- Our decode step on a {CONTEXT_TOKENS}-token cache: {r['decode_step_ms']} ms, "
                 f"{r['weight_bytes'] / 1e6:.0f} MB of weights read per step = {r['weight_read_gb_s']} GB/s "
                 f"(fast path: {r['fast_path']}); verifying k + 1 tokens vs 1: "
                 + ", ".join(f"{k.split('_')[0]}: {v}x" for k, v in r["verify"].items() if k.endswith("_vs_1")) + ".")
    lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("cpu", "dtypes"), default=None, help="default: dtypes when --dtypes is "
                        "given, else cpu")
    parser.add_argument("--quick", action="store_true", help=f"cpu suite: {QUICK_PROMPTS} prompts, 2 runs, no "
                        "transformers (~2 minutes)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 64 (cpu), 128 (dtypes)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default=None, help="dtypes suite (default float32,bfloat16)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (default: "
                        "$SPECMESH_VLLM_PYTHON, else /work/vllm-venv/bin/python when present)")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-transformers", action="store_true", help="cpu suite: leave transformers out")
    parser.add_argument("--concurrent-runs", type=int, default=None, help="cpu suite: runs of the 16-session "
                        "aggregate (0: skip; default 5, quick 3)")
    parser.add_argument("--concurrent-tokens", type=int, default=32)
    parser.add_argument("--vllm-log", default="/tmp/specmesh-bench-vllm.log")
    parser.add_argument("--note", default="", help="cpu suite: a line for the report (e.g. the machine's load)")
    args = parser.parse_args()
    args.suite = args.suite or ("dtypes" if args.dtypes else "cpu")
    args.dtypes = args.dtypes or "float32,bfloat16"
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from specmesh.models.resolve import resolve_model_spec

    path = resolve_model_spec(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    report = {
        "model": str(args.model),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus ({cpu_model()})",
        "torch": torch.__version__,
        "threads": args.threads,
        "read_bandwidth_gb_s": round(read_bandwidth_gb_s(), 2),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.suite == "cpu":
        if args.new_tokens is None:
            args.new_tokens = 64
        if args.quick:  # ~2 minutes on a quiet machine once vLLM's compile cache is warm
            args.runs = min(args.runs, 2)
            args.no_transformers = True
        if args.concurrent_runs is None:
            args.concurrent_runs = 3 if args.quick else 5
        report["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
        report["note"] = args.note
        report["command"] = " ".join([".venv/bin/python bench/engine.py", *sys.argv[1:]])
        report["cpu"] = cpu_peers(args, path, tokenizer)
        (RESULTS / "engine-cpu.json").write_text(json.dumps(report, indent=2) + "\n")
        write_cpu_markdown(report, RESULTS / "engine-cpu.md")
        print((RESULTS / "engine-cpu.md").read_text())
        return
    if args.new_tokens is None:
        args.new_tokens = 128
    report |= {"new_tokens": args.new_tokens, "runs": args.runs, "results": []}
    for dtype in args.dtypes.split(","):
        result = decode_throughput(path, tokenizer, dtype, args.new_tokens, args.runs)
        print(json.dumps(result), flush=True)
        report["results"].append(result)
    (RESULTS / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, RESULTS / "engine.md")
    print((RESULTS / "engine.md").read_text())


if __name__ == "__main__":
    main()
