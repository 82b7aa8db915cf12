"""GPU engine speed (issue 30) on random-weight Llama shapes built from a config (no download).

    PYTHONPATH=. python3 bench/gpu.py [--shapes llama-3.2-1b,llama-3.1-8b] [--new-tokens 256] [--out DIR]
    .venv/bin/python bench/gpu.py --quick --device cpu       # the tiny shape end to end (smoke run, < 1 min)

Weights: seeded `randn * 0.02`, norms ones, bf16 on CUDA (float32 on the CPU); the native engine as
`load_engine` wires it (`default_kernel`). Greedy, EOS ignored, a 32-token random prompt. Per shape:
- B=1 decoding, prefill excluded: the library's plain decoding loop (`speculative_stream` with no drafter
  over a `TargetVerifier`) and a bare `engine.forward` one-token loop (argmax on the device), with the
  share of the HBM roofline (the card's bandwidth / `model.weight_bytes` tok/s) where the card is known;
- plain decoding steps of B = 1, 8, 32, 64, 128 sessions in one engine (`verify_many`, empty drafts),
  prefill excluded: ms per step, aggregate tok/s, against B=1;
- one verify forward of k + 1 = 5, 9, 17 chain tokens at B=1 against a one-token step (the sequence is
  truncated back after each, so the context stays 32 tokens);
- transformers `generate` on the same weights, prefill included, against ours with prefill;
- (llama-3.2-1b, tiny) target-only decoding through a Verify service in its own process over loopback,
  the streamed Run and `Verify.Generate` against in-process (bench/loopback.py's calls), prefill included.
The first three run with the engine's CUDA graphs ("graphs") and without ("eager") where the engine has
them. Medians of --runs runs (or of every step). Writes bench/results/gpu-<device>.{json,md} (or under
--out) after every measurement and prints each table when it is complete, so a run cut short keeps what
it measured; a failed section is recorded, the run goes on and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specmesh.decoding.proposal import DraftProposal  # noqa: E402
from specmesh.decoding.sampling import SamplingParams  # noqa: E402
from specmesh.decoding.speculative import speculative_stream  # noqa: E402
from specmesh.decoding.verifier import TargetVerifier  # noqa: E402
from specmesh.models.config import LlamaFamilyConfig  # noqa: E402
from specmesh.models.engine import SeqInput  # noqa: E402
from specmesh.models.linear import default_kernel  # noqa: E402
from specmesh.models.llama import LlamaFamilyModel  # noqa: E402
from specmesh.models.native_engine import NativeEngine  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_parameters={**LLAMA3_ROPE, "factor": 32.0}, max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_parameters={**LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=512, tie_word_embeddings=True,
                 rope_parameters={**LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 512}, max_position_embeddings=2048),
}
SERVICE_SHAPES = ("llama-3.2-1b", "tiny")  # the Verify service over loopback runs for these
PROMPT_TOKENS = 32
VERIFY_TOKENS = (5, 9, 17)  # k + 1 for k = 4, 8, 16
SEED = 0
SERVICE_START_TIMEOUT_S = 180
PER_MODE = ("decode", "verify", "batch")  # sections measured with CUDA graphs on and off
RUNS_BUDGET_S = 15.0  # a decoding measurement stops repeating past this (at least one run): the whole run fits ~4 min


@dataclass(frozen=True)
class Settings:
    new_tokens: int
    runs: int  # repetitions of each decoding run (medians), fewer where they pass RUNS_BUDGET_S
    batch_sizes: tuple[int, ...]
    batch_steps: int  # timed plain decoding steps per batch size
    warmup_steps: int
    verify_reps: int  # timed repetitions of each verify size


FULL = Settings(new_tokens=256, runs=3, batch_sizes=(1, 8, 32, 64, 128), batch_steps=32, warmup_steps=3, verify_reps=15)
QUICK = Settings(new_tokens=16, runs=2, batch_sizes=(1, 4, 8), batch_steps=4, warmup_steps=1, verify_reps=3)


# --- models -----------------------------------------------------------------------------------------------

def make_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5)


def random_weights(hf_config, device: torch.device, dtype: torch.dtype, seed: int = SEED):
    """(HF name, tensor) of every weight, in a fixed order from one seeded generator on the device: the
    same seed gives the same tensors, so ours, transformers' and the service's folder hold one model."""
    c = hf_config
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype) * 0.02

    def ones() -> torch.Tensor:
        return torch.ones(c.hidden_size, device=device, dtype=dtype)

    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    yield "model.embed_tokens.weight", randn(c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", ones()
        yield p + "self_attn.q_proj.weight", randn(q_out, c.hidden_size)
        yield p + "self_attn.k_proj.weight", randn(kv_out, c.hidden_size)
        yield p + "self_attn.v_proj.weight", randn(kv_out, c.hidden_size)
        yield p + "self_attn.o_proj.weight", randn(c.hidden_size, q_out)
        yield p + "post_attention_layernorm.weight", ones()
        yield p + "mlp.gate_proj.weight", randn(c.intermediate_size, c.hidden_size)
        yield p + "mlp.up_proj.weight", randn(c.intermediate_size, c.hidden_size)
        yield p + "mlp.down_proj.weight", randn(c.hidden_size, c.intermediate_size)
    yield "model.norm.weight", ones()
    if not c.tie_word_embeddings:
        yield "lm_head.weight", randn(c.vocab_size, c.hidden_size)


def build_hf_model(hf_config, device: torch.device, dtype: torch.dtype):
    """transformers' LlamaForCausalLM on the device in `dtype` holding `random_weights` (each tensor is
    copied into the model's state dict as it is drawn: one copy of the weights at a time beside ours)."""
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    state = model.state_dict()
    loaded = set()
    with torch.no_grad():
        for name, tensor in random_weights(hf_config, device, dtype):
            state[name].copy_(tensor)
            loaded.add(name)
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    missing = set(state) - loaded - tied
    if missing:
        raise RuntimeError(f"transformers' model has weights the random checkpoint lacks: {sorted(missing)[:5]}")
    return model.eval()


def save_folder(hf_config, device: torch.device, dtype: torch.dtype, folder: Path) -> None:
    """An HF folder (config.json + model.safetensors) of `random_weights`, for a service to load."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(folder)
    save_file({name: t.contiguous().cpu() for name, t in random_weights(hf_config, device, dtype)},
              str(folder / "model.safetensors"))


def random_prompt(vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (PROMPT_TOKENS,), generator=generator).tolist()


def hbm_bandwidth_bytes_s(device_name: str) -> float | None:
    """The card's HBM bandwidth from its name (None: not a card this knows, so no roofline)."""
    name = device_name.upper()
    if "H200" in name:
        return 4.8e12
    if "H100" in name and "PCIE" in name:
        return 2.0e12
    if "H100" in name and "NVL" not in name:  # SXM, HBM3
        return 3.35e12
    return None


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9.-]", "", torch.cuda.get_device_name(device).lower().replace(" ", "-"))


# --- measurements -----------------------------------------------------------------------------------------

class Clock:
    """perf_counter after the device's queued work is done."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def graph_counts(engine) -> tuple[int, int] | None:
    """(forwards the fixed-shape step served, of them CUDA graph replays) so far; None: the engine has none."""
    step_graphs = getattr(engine, "step_graphs", None)
    return None if step_graphs is None else (step_graphs.num_steps, step_graphs.num_replays)


def add_graph_counts(result: dict, engine, before: tuple[int, int] | None) -> dict:
    """`result` with the fixed-shape steps and graph replays since `before` (warm-ups included)."""
    after = graph_counts(engine)
    if before is not None and after is not None:
        result["fixed_shape_steps"], result["graph_replays"] = after[0] - before[0], after[1] - before[1]
    return result


def repeat(fn, runs: int, budget_s: float = RUNS_BUDGET_S) -> list:
    """fn() `runs` times, or fewer once `budget_s` has passed (always once)."""
    results, start = [], time.perf_counter()
    for _ in range(runs):
        results.append(fn())
        if time.perf_counter() - start > budget_s:
            break
    return results


def library_decode(verifier: TargetVerifier, prompt: list[int], num_new: int, clock: Clock) -> dict:
    """The library's plain decoding loop: tok/s after the prefill (its event carries the first token) and with it."""
    params = SamplingParams(temperature=0.0, max_new_tokens=num_new, ignore_eos=True, seed=SEED)
    tokens: list[int] = []
    num_first = 0
    start = clock()
    after_prefill = None
    for event in speculative_stream(verifier, None, prompt, params, eos_token_ids=()):
        if after_prefill is None:
            after_prefill = clock()
            num_first = len(event.token_ids)
        tokens += event.token_ids
    end = clock()
    assert after_prefill is not None and len(tokens) == num_new, (len(tokens), num_new)
    return dict(tokens_per_s=(num_new - num_first) / (end - after_prefill), with_prefill_tokens_per_s=num_new / (end - start),
                tokens=tokens)


def bare_decode(engine, prompt: list[int], num_new: int, clock: Clock) -> float:
    """tok/s of `num_new` one-token `engine.forward` steps after the prefill, argmax on the device."""
    seq = engine.new_sequence()
    try:
        token = int(engine.forward([SeqInput(seq, prompt, [len(prompt) - 1])])[0][0].argmax())
        start = clock()
        for _ in range(num_new):
            token = int(engine.forward([SeqInput(seq, [token], [0])])[0][0].argmax())
        return num_new / (clock() - start)
    finally:
        engine.free(seq)


def measure_decode(engine, verifier: TargetVerifier, prompt: list[int], s: Settings, clock: Clock,
                   roofline_tokens_per_s: float | None) -> dict:
    warm = min(16, s.new_tokens)
    unhurried = TargetVerifier(engine, plain_ahead=False)  # each step launched when the loop asks for it
    for loop in (verifier, unhurried):
        library_decode(loop, prompt, warm, clock)
    bare_decode(engine, prompt, warm, clock)
    counts = graph_counts(engine)
    runs = repeat(lambda: (library_decode(verifier, prompt, s.new_tokens, clock), bare_decode(engine, prompt, s.new_tokens, clock),
                           library_decode(unhurried, prompt, s.new_tokens, clock)), s.runs)  # interleaved
    library = [run["tokens_per_s"] for run, _, _ in runs]
    bare = [rate for _, rate, _ in runs]
    one_by_one = [run["tokens_per_s"] for _, _, run in runs]
    if any(run["tokens"] != loop_run["tokens"] for run, _, loop_run in runs):
        raise AssertionError("the library loop's tokens differ with and without steps ahead")
    result = dict(library_tokens_per_s=statistics.median(library),
                  library_with_prefill_tokens_per_s=statistics.median(run["with_prefill_tokens_per_s"] for run, _, _ in runs),
                  bare_tokens_per_s=statistics.median(bare), step_ms=1e3 / statistics.median(bare), runs=len(runs),
                  library_runs_tokens_per_s=library, bare_runs_tokens_per_s=bare, tokens=runs[-1][0]["tokens"],
                  steps_ahead=verifier.plain_ahead, library_no_ahead_tokens_per_s=statistics.median(one_by_one),
                  library_no_ahead_runs_tokens_per_s=one_by_one)
    if roofline_tokens_per_s:
        result["library_roofline_pct"] = 100 * result["library_tokens_per_s"] / roofline_tokens_per_s
        result["bare_roofline_pct"] = 100 * result["bare_tokens_per_s"] / roofline_tokens_per_s
    return add_graph_counts(result, engine, counts)


def measure_verify(engine, prompt: list[int], s: Settings, clock: Clock) -> dict:
    """ms of one forward of n chain tokens (logits at every one) on the prompt's context, n = 1 and VERIFY_TOKENS."""
    seq = engine.new_sequence()
    sizes = (1, *VERIFY_TOKENS)
    times_s: dict[int, list[float]] = {n: [] for n in sizes}
    counts = graph_counts(engine)
    try:
        engine.forward([SeqInput(seq, prompt, [len(prompt) - 1])])
        context = engine.seq_len(seq)
        for rep in range(s.warmup_steps + s.verify_reps):
            for n in sizes:  # interleaved
                chain = [prompt[(rep + i) % len(prompt)] for i in range(n)]
                start = clock()
                engine.forward([SeqInput(seq, chain, list(range(n)))])
                seconds = clock() - start
                engine.truncate(seq, context)
                if rep >= s.warmup_steps:
                    times_s[n].append(seconds)
    finally:
        engine.free(seq)
    step_s = statistics.median(times_s[1])
    rows = [dict(tokens=n, ms=statistics.median(times_s[n]) * 1e3, vs_step=statistics.median(times_s[n]) / step_s)
            for n in VERIFY_TOKENS]
    result = dict(context_tokens=len(prompt), step_ms=step_s * 1e3, reps=s.verify_reps, rows=rows)
    return add_graph_counts(result, engine, counts)


def measure_batch(engine, verifier: TargetVerifier, vocab_size: int, s: Settings, clock: Clock) -> dict:
    """Plain decoding steps of B sessions in one `verify_many` forward, after their prefill (not timed)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, seed=SEED)
    rows = []
    counts = graph_counts(engine)
    for batch_size in s.batch_sizes:
        prompts = [random_prompt(vocab_size, SEED + 1 + i) for i in range(batch_size)]
        sessions = verifier.open_many(prompts, [params] * batch_size,
                                      [torch.Generator(device=engine.device) for _ in range(batch_size)])
        empty = [DraftProposal(token_ids=[])] * batch_size
        times_s = []
        try:
            for step in range(s.warmup_steps + s.batch_steps):
                start = clock()
                verifier.verify_many(sessions, empty)
                if step >= s.warmup_steps:
                    times_s.append(clock() - start)
        finally:
            for session in sessions:
                verifier.close(session)
        step_s = statistics.median(times_s)
        rows.append(dict(batch_size=batch_size, step_ms=step_s * 1e3, tokens_per_s=batch_size / step_s))
        print(f"  B={batch_size}: {step_s * 1e3:.2f} ms/step, {batch_size / step_s:.1f} tok/s", flush=True)
    for row in rows:
        row["vs_b1"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    result = dict(steps=s.batch_steps, rows=rows)
    return add_graph_counts(result, engine, counts)


def time_generate(model, prompt: list[int], s: Settings, clock: Clock) -> tuple[list[float], list[int]]:
    """(tok/s of each of --runs `generate` calls after a short warm-up, the last call's tokens)."""
    input_ids = torch.tensor([prompt], device=model.device)
    attention_mask = torch.ones_like(input_ids)

    def run(num_new: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=num_new, min_new_tokens=num_new,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def timed() -> tuple[float, list[int]]:
        start = clock()
        tokens = run(s.new_tokens)
        return s.new_tokens / (clock() - start), tokens

    run(min(16, s.new_tokens))
    runs = repeat(timed, s.runs)
    return [rate for rate, _ in runs], runs[-1][1]


def measure_transformers(hf_config, device: torch.device, dtype: torch.dtype, prompt: list[int], s: Settings,
                         clock: Clock, ours: dict) -> dict:
    """transformers `generate` (greedy, exactly --new-tokens tokens) on the same weights, prefill included."""
    model = build_hf_model(hf_config, device, dtype)
    try:
        rates, tokens = time_generate(model, prompt, s, clock)
    finally:
        del model
        free_device_memory(device)
    hf_rate = statistics.median(rates)
    result: dict = dict(tokens_per_s=hf_rate, runs_tokens_per_s=rates, runs=len(rates), ours={})
    for mode, decode in ours.items():
        ours_tokens = decode.get("tokens", [])
        same = next((i for i, (a, b) in enumerate(zip(ours_tokens, tokens)) if a != b), min(len(ours_tokens), len(tokens)))
        result["ours"][mode] = dict(with_prefill_tokens_per_s=decode["library_with_prefill_tokens_per_s"],
                                    vs_transformers=decode["library_with_prefill_tokens_per_s"] / hf_rate,
                                    same_leading_tokens=same)
    return result


def start_service(folder: Path, device: torch.device, dtype: torch.dtype, max_kv_tokens: int,
                  log_path: Path) -> tuple[subprocess.Popen, str]:
    """A Verify service on `folder` in its own process; (process, address) once it listens."""
    threads = str(torch.get_num_threads())
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    dtype_name = str(dtype).removeprefix("torch.")
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(folder), "--device", str(device),
                                 "--dtype", dtype_name, "--max-kv-tokens", str(max_kv_tokens), "--port", "0"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        line = proc.stdout.readline() if ready else ""
        if "listening on" in line:
            return proc, line.split("listening on", 1)[1].split(",")[0].strip()
    proc.kill()
    proc.wait()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"the Verify service did not start (exit {proc.returncode}); its log ends:\n{tail}")


def measure_services(hf_config, engine, verifier: TargetVerifier, prompt: list[int], s: Settings) -> dict:
    """Target-only decoding in-process, through the service's streamed Run and its Generate
    (bench/loopback.py's `measure`: warm-up, then the three alternating, --runs times)."""
    from bench import loopback

    with tempfile.TemporaryDirectory(prefix="specmesh-gpu-bench-") as tmp:
        folder = Path(tmp) / "model"
        save_folder(hf_config, engine.device, engine.dtype, folder)
        max_kv_tokens = 8 * (PROMPT_TOKENS + s.new_tokens + 64)
        proc, address = start_service(folder, engine.device, engine.dtype, max_kv_tokens, Path(tmp) / "verify.log")
        try:
            rows = asyncio.run(loopback.measure(argparse.Namespace(runs=s.runs, new_tokens=s.new_tokens), verifier,
                                                [prompt], address))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    medians = {m: statistics.median(r["tokens_per_s"] for r in rows if r["method"] == m) for m in loopback.METHODS}
    reference = next(r["tokens"] for r in rows if r["method"] == "in-process")
    return dict(runs=s.runs, rows=[dict(method=m, tokens_per_s=medians[m], vs_in_process=medians[m] / medians["in-process"],
                                        same_tokens=all(r["tokens"] == reference for r in rows if r["method"] == m))
                                   for m in loopback.METHODS])


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- report -----------------------------------------------------------------------------------------------

def _pct(row: dict, key: str) -> str:
    return f"{row[key]:.1f}%" if key in row else "-"


def render_failure(title: str, error: str) -> list[str]:
    return [f"### {title}: FAILED", "", "```", error.strip()[-1500:], "```"]


def render_section(key: str, data: dict, s: Settings) -> list[str]:
    """The markdown of one measured section of a shape (`data` maps mode -> result for the per-mode ones)."""
    if "error" in data:
        return render_failure(key, data["error"])
    if key in PER_MODE:
        failed = [(mode, r) for mode, r in data.items() if "error" in r]
        data = {mode: r for mode, r in data.items() if "error" not in r}
        lines = render_measured(key, data, s) if data else []
        for mode, r in failed:
            lines += [""] * bool(lines) + render_failure(f"{key} ({mode})", r["error"])
        return lines
    return render_measured(key, data, s)


def render_measured(key: str, data: dict, s: Settings) -> list[str]:
    if key == "decode":
        lines = [f"### B=1 decoding, {s.new_tokens} new tokens (prefill excluded; median of the runs)", "",
                 "| mode | library loop tok/s | % roofline | steps ahead | same loop, steps ahead off, tok/s "
                 "| library incl. prefill tok/s | bare forward loop tok/s | % roofline | step ms | runs |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for mode, r in data.items():
            off = f"{r['library_no_ahead_tokens_per_s']:.1f}" if "library_no_ahead_tokens_per_s" in r else "-"
            lines.append(f"| {mode} | {r['library_tokens_per_s']:.1f} | {_pct(r, 'library_roofline_pct')} | "
                         f"{'on' if r.get('steps_ahead') else 'off'} | {off} | "
                         f"{r['library_with_prefill_tokens_per_s']:.1f} | {r['bare_tokens_per_s']:.1f} | "
                         f"{_pct(r, 'bare_roofline_pct')} | {r['step_ms']:.2f} | {r['runs']} |")
        lines += [f"\n{mode}: {r['fixed_shape_steps']} forwards took the fixed-shape step, {r['graph_replays']} of them "
                  "graph replays (warm-ups included)." for mode, r in data.items() if "fixed_shape_steps" in r]
        return lines
    if key == "batch":
        lines = [f"### Plain decoding steps of B sessions (verify_many, empty drafts; median of {s.batch_steps} steps)", "",
                 "| mode | B | ms / step | aggregate tok/s | vs B=1 |", "|---|---|---|---|---|"]
        for mode, r in data.items():
            lines += [f"| {mode} | {row['batch_size']} | {row['step_ms']:.2f} | {row['tokens_per_s']:.1f} | {row['vs_b1']:.2f}x |"
                      for row in r["rows"]]
        return lines
    if key == "verify":
        lines = [f"### Verify forward of k+1 chain tokens at B=1 ({PROMPT_TOKENS}-token context; median of {s.verify_reps})", "",
                 "| mode | tokens | ms | vs one-token step |", "|---|---|---|---|"]
        for mode, r in data.items():
            lines.append(f"| {mode} | 1 | {r['step_ms']:.2f} | 1.00x |")
            lines += [f"| {mode} | {row['tokens']} | {row['ms']:.2f} | {row['vs_step']:.2f}x |" for row in r["rows"]]
        return lines
    if key == "transformers":
        lines = [f"### transformers generate on the same weights ({s.new_tokens} tokens, prefill included)", "",
                 f"transformers: {data['tokens_per_s']:.1f} tok/s (median of {data['runs']} runs)", "",
                 "| ours | tok/s | ours / transformers | leading tokens equal |", "|---|---|---|---|"]
        lines += [f"| {mode} | {r['with_prefill_tokens_per_s']:.1f} | {r['vs_transformers']:.2f}x | {r['same_leading_tokens']} |"
                  for mode, r in data["ours"].items()]
        return lines
    if key == "services":
        lines = [f"### Verify service over loopback, target-only ({s.new_tokens} tokens, prefill included; median of "
                 f"{s.runs} runs)", "", "| path | tok/s | vs in-process | same tokens |", "|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['vs_in_process']:.3f}x | {'yes' if r['same_tokens'] else 'NO'} |"
                  for r in data["rows"]]
        return lines
    raise KeyError(key)


def render_model(name: str, m: dict) -> list[str]:
    roofline = f", HBM roofline {m['roofline_tokens_per_s']:.0f} tok/s" if m.get("roofline_tokens_per_s") else ""
    return [f"## {name}", "", f"hidden {m['hidden_size']}, intermediate {m['intermediate_size']}, {m['num_layers']} layers, "
            f"{m['num_heads']} heads / {m['num_kv_heads']} kv heads x {m['head_dim']}, vocab {m['vocab_size']}, "
            f"tied embeddings {m['tie_word_embeddings']}; {m['weight_bytes'] / 1e6:.1f} MB of weights read per token{roofline}; "
            f"modes: {', '.join(m['modes'])}."]


class Report:
    def __init__(self, out_dir: Path, slug: str, meta: dict, s: Settings):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path = out_dir / f"gpu-{slug}.json"
        self.md_path = out_dir / f"gpu-{slug}.md"
        self.meta = meta
        self.settings = s
        self.shapes: dict[str, dict] = {}
        self.num_failed = 0
        print("\n".join(self.header()) + "\n", flush=True)

    def header(self) -> list[str]:
        m = self.meta
        bandwidth = (f"{m['hbm_bytes_per_s'] / 1e12:.2f} TB/s (roofline tok/s = bandwidth / weight bytes per token)"
                     if m["hbm_bytes_per_s"] else "unknown for this device (no % of roofline)")
        return ["# GPU engine speed (issue 30)", "", f"Command: `{m['command']}`", "",
                f"Run {m['date']} on {m['device_name']} ({m['device']}), torch {m['torch']}{f' (CUDA {cuda})' if (cuda := m['cuda']) else ''}, "
                f"transformers {m['transformers']}, {m['dtype']}. HBM bandwidth: {bandwidth}.", "",
                f"Random weights (seed {SEED}), greedy, EOS ignored, a {PROMPT_TOKENS}-token random prompt. "
                "Modes: graphs = the engine's CUDA graphs on, eager = off."]

    def record(self, shape: str, key: str, value, mode: str | None = None) -> None:
        entry = self.shapes.setdefault(shape, {})
        if mode is None:
            entry[key] = value
        else:
            entry.setdefault(key, {})[mode] = value
        self.write()

    def show(self, shape: str, key: str) -> None:
        data = self.shapes[shape][key]
        lines = render_model(shape, data) if key == "model" else render_section(key, data, self.settings)
        print("\n".join(lines) + "\n", flush=True)

    def write(self) -> None:
        self.json_path.write_text(json.dumps(dict(meta=self.meta, shapes=self.shapes), indent=2))
        lines = self.header()
        for shape, entry in self.shapes.items():
            for key, data in entry.items():
                lines += [""] + (render_model(shape, data) if key == "model" else render_section(key, data, self.settings))
        self.md_path.write_text("\n".join(lines) + "\n")

    def fail(self, shape: str, key: str, mode: str | None = None) -> None:
        """Record the exception being handled as the section's (or the section's mode's) result."""
        self.num_failed += 1
        error = traceback.format_exc()
        print(error, file=sys.stderr, flush=True)
        self.record(shape, key, dict(error=error), mode)


def bench_shape(name: str, args, s: Settings, report: Report) -> None:
    """Every section for one shape; its engine and model are dropped when this returns."""
    device, dtype = torch.device(args.device), args.torch_dtype
    hf_config = make_config(name)
    config = LlamaFamilyConfig.from_hf(hf_config)
    model = LlamaFamilyModel(config, dict(random_weights(hf_config, device, dtype)), dtype, device, default_kernel(dtype, device))
    max_kv_tokens = max(s.batch_sizes) * (PROMPT_TOKENS + s.warmup_steps + s.batch_steps + 32) + 4 * (PROMPT_TOKENS + s.new_tokens)
    engine = NativeEngine(model, max_kv_tokens=max_kv_tokens)
    default_graphs = getattr(engine, "cuda_graphs", False)
    modes = tuple(m for m in args.modes.split(",") if m == "eager" or default_graphs) or ("eager",)
    bandwidth = report.meta["hbm_bytes_per_s"]
    roofline = bandwidth / model.weight_bytes if bandwidth else None
    report.record(name, "model", dict(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
        tie_word_embeddings=config.tie_word_embeddings, weight_bytes=model.weight_bytes, roofline_tokens_per_s=roofline,
        kernel=model.kernel, max_kv_tokens=max_kv_tokens, modes=list(modes), has_cuda_graphs_switch=hasattr(engine, "cuda_graphs")))
    report.show(name, "model")
    try:
        measure_engine(name, hf_config, engine, modes, roofline, args, s, report)
    finally:
        if hasattr(engine, "cuda_graphs"):
            engine.cuda_graphs = default_graphs
        for r in report.shapes[name].get("decode", {}).values():
            r.pop("tokens", None)  # compared with transformers' already; not kept in the JSON
        report.write()


def measure_engine(name: str, hf_config, engine, modes: tuple[str, ...], roofline: float | None, args, s: Settings,
                   report: Report) -> None:
    device, vocab_size = engine.device, engine.vocab_size
    clock = Clock(device)
    verifier = TargetVerifier(engine)
    prompt = random_prompt(vocab_size, SEED)
    sections = {
        "decode": lambda: measure_decode(engine, verifier, prompt, s, clock, roofline),
        "verify": lambda: measure_verify(engine, prompt, s, clock),
        "batch": lambda: measure_batch(engine, verifier, vocab_size, s, clock),
    }
    for key, measure in sections.items():
        for mode in modes:
            if hasattr(engine, "cuda_graphs"):
                engine.cuda_graphs = mode == "graphs"
            print(f"[{name}] {key} ({mode}) ...", flush=True)
            try:
                report.record(name, key, measure(), mode)
            except Exception:
                report.fail(name, key, mode)
                free_device_memory(device)
        report.show(name, key)
    if hasattr(engine, "cuda_graphs"):
        engine.cuda_graphs = modes[0] == "graphs"  # the engine's default from here on
    if not args.no_hf:
        print(f"[{name}] transformers ...", flush=True)
        try:
            ours = {mode: r for mode, r in report.shapes[name].get("decode", {}).items() if "error" not in r}
            report.record(name, "transformers", measure_transformers(hf_config, device, engine.dtype, prompt, s, clock, ours))
        except Exception:
            report.fail(name, "transformers")
            free_device_memory(device)
        report.show(name, "transformers")
    if not args.no_services and name in SERVICE_SHAPES:
        print(f"[{name}] Verify service over loopback ...", flush=True)
        try:
            report.record(name, "services", measure_services(hf_config, engine, verifier, prompt, s))
        except Exception:
            report.fail(name, "services")
        report.show(name, "services")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="", help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--new-tokens", type=int, default=None, help=f"default {FULL.new_tokens} ({QUICK.new_tokens} with --quick)")
    parser.add_argument("--runs", type=int, default=None, help="repetitions of each decoding run (medians)")
    parser.add_argument("--quick", action="store_true", help="the tiny shape, few tokens, B up to 8 (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu-<device>.{json,md}")
    parser.add_argument("--no-services", action="store_true", help="skip the Verify service over loopback")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 with --quick)")
    parser.add_argument("--modes", default="graphs,eager", help="graphs (CUDA graphs on), eager (off); graphs only where the "
                        "engine captures them")
    parser.add_argument("--blas", choices=("cublaslt", "cublas"), default=None,
                        help="torch's preferred cuBLAS backend for the matrix products (default: torch's, cuBLASLt)")
    parser.add_argument("--one-row-kernel", action="store_true",
                        help="one-row bf16 products through the Triton kernel (opt-in: specmesh/models/linear.py ONE_ROW_KERNEL)")
    args = parser.parse_args()
    if args.one_row_kernel:
        from specmesh.models import linear

        linear.ONE_ROW_KERNEL = True
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    s = QUICK if args.quick else FULL
    s = Settings(**{**s.__dict__, "new_tokens": args.new_tokens or s.new_tokens, "runs": args.runs or s.runs})
    shapes = ["tiny"] if args.quick else [shape.strip() for shape in args.shapes.split(",") if shape.strip()]
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if not args.modes or set(args.modes.split(",")) - {"graphs", "eager"}:
        parser.error(f"--modes {args.modes!r}: a comma-separated list of graphs, eager")
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(args.device)
    if device.type == "cpu" and not args.quick and not any(shape == "tiny" for shape in shapes):
        print("bench/gpu.py: the real shapes need a GPU (none here); `--quick` runs the tiny shape on the CPU", flush=True)
        return 0  # `make bench` goes on to the next script
    from specmesh.models.load import parse_dtype

    args.torch_dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    import transformers

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = dict(command="python3 bench/gpu.py " + " ".join(sys.argv[1:]), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                device=str(device), device_name=device_name, hbm_bytes_per_s=hbm_bandwidth_bytes_s(device_name) if device.type == "cuda" else None,
                torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                dtype=str(args.torch_dtype).removeprefix("torch."), threads=torch.get_num_threads(), settings=s.__dict__,
                blas=str(torch.backends.cuda.preferred_blas_library()) if device.type == "cuda" else None,
                one_row_kernel=args.one_row_kernel)
    report = Report(args.out, device_slug(device), meta, s)
    start = time.perf_counter()
    for shape in shapes:
        try:
            bench_shape(shape, args, s, report)
        except Exception:
            report.fail(shape, "setup")
        free_device_memory(device)
    report.meta["wall_s"] = time.perf_counter() - start
    report.write()
    print(f"wrote {report.md_path} and {report.json_path} ({report.meta['wall_s']:.0f} s, {report.num_failed} failed sections)",
          flush=True)
    return 1 if report.num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
