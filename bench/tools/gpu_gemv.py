"""The B=1 matrix-vector products of a decode step, one by one, against the HBM: which cuBLAS backend
does them faster, and how far each is from the card's bandwidth.

    PYTHONPATH=. python3 bench/tools/gpu_gemv.py [llama-3.2-1b,llama-3.1-8b]

For every weight of a layer (fused qkv, o, fused gate_up, down) and the lm head of each shape: a bf16
[1, K] x [N, K]^T product through `F.linear` with cuBLASLt (torch's default) and with cuBLAS
(`torch.backends.cuda.preferred_blas_library`), each captured 50 times in a CUDA graph so launches
cost what they cost in the engine's replayed step; and the float32 argmax over the vocabulary that a
greedy step reads. Prints us per call and TB/s of weight bytes. The calls cycle through copies of the
weight that together exceed the L2 cache several times over, so each call reads its weight from HBM,
as a decode step does (the first version reused one weight: its small products were served from L2).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu import SHAPES  # noqa: E402

REPEATS = 50
CYCLE_BYTES = 512 * 2**20  # the copies of a weight the calls cycle through: well past the H100's 50 MB of L2


def graph_us(fn) -> float:
    """us per call of `fn`, REPEATS calls captured in one CUDA graph (median of 5 replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEATS)
    return sorted(times)[2]


def products(shape: str) -> dict[str, tuple[int, int]]:
    """(out features N, in features K) of each matrix a B=1 step of the shape reads."""
    c = SHAPES[shape]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "lm_head": (c["vocab_size"], hidden)}


def weight_copies(n: int, k: int, device: torch.device) -> list[torch.Tensor]:
    """Random bf16 [n, k] weights, enough of them (CYCLE_BYTES, at most REPEATS) that calls cycling through
    them read each from HBM."""
    count = max(1, min(REPEATS, -(-CYCLE_BYTES // (n * k * 2))))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(count)]


def main() -> int:
    shapes = (sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b,llama-3.1-8b").split(",")
    device = torch.device("cuda")
    for shape in shapes:
        c = SHAPES[shape]
        print(f"{shape}: us per call (TB/s of weights)")
        for name, (n, k) in products(shape).items():
            copies = weight_copies(n, k, device)
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            calls = itertools.count()
            row = []
            for backend in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(backend)
                us = graph_us(lambda x=x, ws=copies: F.linear(x, ws[next(calls) % len(ws)]))
                row.append(f"{backend} {us:7.1f} ({n * k * 2 / us / 1e6:.2f})")
            print(f"  {name:8s} [{n} x {k}]  " + "   ".join(row), flush=True)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        logits = torch.randn(1, c["vocab_size"], device=device)
        print(f"  argmax over {c['vocab_size']} float32: {graph_us(lambda: logits.argmax(dim=-1)):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
