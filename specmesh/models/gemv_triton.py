"""One-row matrix products (a B=1 decode step's linears) as a Triton kernel, behind `Linear` on CUDA
when `linear.ONE_ROW_KERNEL` is set (opt-in: linear.py says what it costs in exactness).

A decode step of one sequence multiplies one activation row by every weight matrix: it is bound by
reading the weights. cuBLAS's kernels for that shape leave bandwidth unused on the small matrices
(a 1B model's o projection, 2048 x 2048, ran at 1.31 TB/s on an H100 whose HBM gives ~3): too few
tiles to fill the card. Here one program takes BLOCK_N rows of the weight and walks the row in
BLOCK_K-wide tiles, multiplying in float32, accumulating per element, and summing the tile lanes at
the end, then adds the bias (in float32, as cuBLAS's epilogue does) and rounds once to the output
dtype. Every output is summed in one fixed order, whatever the launch. Measured on an H100
(bench/results/gpu-nvidia-h100-80gb-hbm3-gemv-triton.txt): 1.1-1.3x cuBLAS's speed on every product
of the 1B and 8B shapes; in the engine, 1B plain decoding at 787 tok/s against 716 (58.1% of the
HBM roofline against 52.8%) and the 8B at 77.6%.

Imported only where Triton is installed (a CUDA machine; CPU tests under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 4  # weight rows per program: the best of 4, 8 and 16 on every product measured
BLOCK_K = 1024
NUM_WARPS = 8


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, n_rows, n_cols: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < n_cols
        w = tl.load(w_ptr + rows[:, None] * n_cols + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
         num_warps: int = NUM_WARPS, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias [N]) -> [1, N] in x's dtype; weight and bias contiguous. The
    tile sizes are the kernel's (bench/tools/gpu_gemv_triton.py tries others); `out`: written in place."""
    n, k = weight.shape
    x = x.contiguous()
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, weight if bias is None else bias, out, n, k,
                                             HAS_BIAS=bias is not None, BLOCK_N=block_n,
                                             BLOCK_K=min(block_k, triton.next_power_of_2(k)), num_warps=num_warps)
    return out
