"""The one-row Triton kernel (specmesh/models/gemv_triton.py, what `Linear` runs for a B=1 step's
bf16 / fp16 products on CUDA) against cuBLAS, at its tile sizes and a few others.

    PYTHONPATH=. python3 bench/tools/gpu_gemv_triton.py [llama-3.2-1b,llama-3.1-8b]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/tools/gpu_gemv_triton.py --check   # the kernel on the CPU

For each product of bench/tools/gpu_gemv.py: cuBLAS (`F.linear`) and the kernel at each of a few tile
configurations, timed the same way (50 calls in a CUDA graph, cycling through weight copies past the
L2 cache), with the largest difference from `F.linear`'s output.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.tools.gpu_gemv import graph_us, products, weight_copies  # noqa: E402
from specmesh.models.gemv_triton import gemv  # noqa: E402

CONFIGS = [dict(block_n=n, block_k=k, num_warps=w) for n, k, w in itertools.product((1, 2, 4, 8), (1024, 2048), (4, 8))]


def check() -> int:
    """The kernel against F.linear on small float32 shapes (runs under TRITON_INTERPRET=1 on the CPU)."""
    generator = torch.Generator().manual_seed(0)
    for n, k in ((5, 7), (40, 300), (64, 1024)):
        weight = torch.randn(n, k, generator=generator)
        x = torch.randn(1, k, generator=generator)
        for config in (dict(block_n=4, block_k=256, num_warps=4), dict(block_n=16, block_k=512, num_warps=8)):
            got = gemv(x, weight, None, **config)
            torch.testing.assert_close(got, F.linear(x, weight), atol=1e-4, rtol=1e-4)
    print("gemv matches F.linear")
    return 0


def main() -> int:
    if "--check" in sys.argv[1:]:
        return check()
    shapes = (sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b,llama-3.1-8b").split(",")
    device = torch.device("cuda")
    for shape in shapes:
        print(f"{shape}: us per call (TB/s of weights); the kernel's best configurations")
        for name, (n, k) in products(shape).items():
            copies = weight_copies(n, k, device)
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
            want = F.linear(x, copies[0])
            calls = itertools.count()
            cublas = graph_us(lambda: F.linear(x, copies[next(calls) % len(copies)]))
            timed = []
            for config in CONFIGS:
                try:
                    diff = (gemv(x, copies[0], None, out=out, **config).float() - want.float()).abs().max().item()
                    us = graph_us(lambda c=config: gemv(x, copies[next(calls) % len(copies)], None, out=out, **c))
                except Exception as exc:  # noqa: BLE001 - a tile size this Triton refuses: the others go on
                    print(f"  {name}: {config} failed: {str(exc).splitlines()[0][:120]}", flush=True)
                    continue
                timed.append((us, config, diff))
            timed.sort(key=lambda t: t[0])
            best = "; ".join(f"{us:.1f} ({n * k * 2 / us / 1e6:.2f}) n{c['block_n']} k{c['block_k']} w{c['num_warps']} "
                             f"diff {diff:.1e}" for us, c, diff in timed[:2])
            print(f"  {name:8s} [{n} x {k}]  cublas {cublas:.1f} ({n * k * 2 / cublas / 1e6:.2f})   triton {best}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
