"""The Triton row-wise linear (specmesh/models/gemv_triton.py) against F.linear on Llama weight shapes.

    PYTHONPATH=. python3 bench/tools/gemv_probe.py [--shapes llama-3.2-1b,llama-3.1-8b] [--no-engine]

Per shape (bf16, random weights): for 1, 4 and 8 rows, F.linear's and each candidate config's GPU time
per call (us) and weight bandwidth (GB/s = weight bytes / time), and what `choose_row_kernels` picks.
The calls rotate over copies of the weight (>= 256 MB together), so it is read from HBM, not L2, as in a
decode step. Then (unless --no-engine) B=1 decode and 5-token verify steps of the llama-3.2-1b engine with
the row kernels off and as chosen (CUDA graphs), and one row's logits decoded alone against the same row
verified among 5. CUDA only; a failing config is printed and the rest goes on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specmesh.models.gemv import choose_row_kernels, format_report, time_us  # noqa: E402
from specmesh.models.linear import Linear  # noqa: E402

SHAPES = {  # name: (out_features, in_features)
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "lm_head": (128256, 2048)},
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)},
}
ROWS = (1, 4, 8)
ROTATION_BYTES = 256 << 20


def probe_shape(name: str, out_features: int, in_features: int) -> None:
    from specmesh.models import gemv_triton

    weight_bytes = out_features * in_features * 2
    copies = max(1, min(16, -(-ROTATION_BYTES // weight_bytes)))
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(out_features, in_features, device="cuda", generator=generator, dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(max(ROWS), in_features, device="cuda", generator=generator, dtype=torch.bfloat16)
    calls = max(3, min(20, int(1e-3 / (weight_bytes / 3e12))))
    print(f"\n{name}: {in_features} -> {out_features} ({weight_bytes / 1e6:.1f} MB, {copies} copies)")
    print(f"  {'kernel':<28}" + "".join(f"{f'{rows} row(s)':>22}" for rows in ROWS))

    def line(label: str, run) -> None:
        cells = []
        for rows in ROWS:
            try:
                us = time_us(run, rows, calls)
                cells.append(f"{us:8.1f} us {weight_bytes / us / 1e3:6.0f} GB/s")
            except Exception as error:  # a config that fails: say so, go on
                cells.append(f"{type(error).__name__:>22}"[:22])
                print(f"  ! {label} at {rows} rows: {type(error).__name__}: {str(error)[:300]}")
        print(f"  {label:<28}" + "".join(f"{c:>22}" for c in cells))

    line("F.linear", lambda i, rows: F.linear(x[:rows], weights[i % copies]))
    for config in gemv_triton.CANDIDATES:
        line(str(tuple(config)), lambda i, rows, config=config: gemv_triton.linear_rows(x[:rows], weights[i % copies], None,
                                                                                        config))
    started = time.perf_counter()
    report = choose_row_kernels([Linear(w, None) for w in weights], mode="auto")
    print(f"  chooser ({time.perf_counter() - started:.2f} s): {format_report(report)}")
    for candidate in report[0].get("candidates", []):
        if "error" in candidate:
            print(f"  ! chooser rejected {candidate['config']}: {candidate['error']}")


def show_ptx() -> None:
    """Whether the compiled kernel reads the weight in 16-byte vectors (ld.global.v4)."""
    from specmesh.models import gemv_triton

    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8, 2048, device="cuda", dtype=torch.bfloat16)
    config = gemv_triton.CANDIDATES[1]
    compiled = gemv_triton._linear_rows_kernel[(2048 // config.block_n,)](
        x, w, w, out, 8, 2048, 2048, x.stride(0), w.stride(0), out.stride(0), HAS_BIAS=False, ROWS=8,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_N=True, EVEN_K=True, num_warps=config.num_warps,
        num_stages=config.num_stages)
    ptx = compiled.asm["ptx"]
    vector_loads = sum(ptx.count(op) for op in ("ld.global.v4", "ld.global.nc.v4", "ld.global.L1::evict_last.v4"))
    print(f"\nPTX of {tuple(config)} at 8 rows: {ptx.count('ld.global')} ld.global, {vector_loads} of them v4; "
          f"{ptx.count('fma.rn.f32')} fma.rn.f32, {compiled.n_regs} registers, {compiled.n_spills} spills")


def probe_engine() -> None:
    """B=1 decode and 5-token verify steps of llama-3.2-1b (random weights), row kernels off and chosen."""
    from bench.gpu import make_config, random_prompt, random_weights
    from specmesh.models.config import LlamaFamilyConfig
    from specmesh.models.engine import SeqInput
    from specmesh.models.gemv import model_linears
    from specmesh.models.llama import LlamaFamilyModel
    from specmesh.models.native_engine import NativeEngine

    config = make_config("llama-3.2-1b")
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = LlamaFamilyModel(LlamaFamilyConfig.from_hf(config), dict(random_weights(config, device, dtype)), dtype, device,
                             "plain")
    prompt = random_prompt(model.config.vocab_size, seed=0)
    print("\nllama-3.2-1b engine (CUDA graphs), ms per step, median of 50:")
    logits = {}
    for mode in ("off", "auto"):
        for layer in model_linears(model):
            layer.row_kernel = None
        started = time.perf_counter()
        report = choose_row_kernels(model, mode=mode)
        print(f"  [{mode}] chooser {time.perf_counter() - started:.2f} s\n    " + format_report(report).replace("\n", "\n    "))
        engine = NativeEngine(model, max_kv_tokens=4096)
        seq = engine.new_sequence()
        engine.forward([SeqInput(seq, prompt, [len(prompt) - 1])])
        length = engine.seq_len(seq)

        def step(tokens: list[int]) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.forward([SeqInput(seq, tokens, list(range(len(tokens))))])[0].argmax().item()
            engine.truncate(seq, length)
            return (time.perf_counter() - start) * 1e3

        for tokens in ([5], [5, 6, 7, 8, 9]):
            for _ in range(5):
                step(tokens)
            print(f"  [{mode}] {len(tokens)} token(s): {statistics.median(step(tokens) for _ in range(50)):.3f} ms")
        decoded = engine.forward([SeqInput(seq, [5], [0])])[0]
        engine.truncate(seq, length)
        verified = engine.forward([SeqInput(seq, [5, 6, 7, 8, 9], [0])])[0]
        engine.truncate(seq, length)
        logits[mode] = decoded
        print(f"  [{mode}] token 5 decoded alone vs verified among 5: bit-identical {torch.equal(decoded, verified)}, "
              f"max |diff| {(decoded - verified).abs().max().item():.3g}")
        torch.cuda.empty_cache()
    print(f"  auto vs off logits: max |diff| {(logits['auto'] - logits['off']).abs().max().item():.3g}, "
          f"argmax same {logits['auto'].argmax().item() == logits['off'].argmax().item()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemv_probe: needs a CUDA device (the row kernel is CUDA-only); nothing measured")
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gemv_probe: needs Triton; nothing measured")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    failed = False
    steps = [lambda: show_ptx()]
    for shape in args.shapes.split(","):
        for name, (out_features, in_features) in SHAPES[shape].items():
            steps.append(lambda shape=shape, name=name, n=out_features, k=in_features: probe_shape(f"{shape} {name}", n, k))
    if not args.no_engine:
        steps.append(probe_engine)
    for run in steps:
        try:
            run()
        except Exception:
            failed = True
            traceback.print_exc()
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
