"""Triton kernel behind specmesh/models/gemv.py: y = x @ weight.T + bias for a few rows x.

Decode multiplies 1 row (verify k + 1 <= 8) by each weight matrix; the step is bound by reading the
weights. `linear_rows` reads each weight element once for all rows of the call and keeps every row's
arithmetic apart, so it is batch-invariant: the bits of out[r] depend only on x[r], the weight, the
bias and the config, never on the call's number of rows nor on the other rows.

Grid: one program per BLOCK_N output features. Each program walks K in BLOCK_K chunks, in order; per
chunk it loads the weight tile [BLOCK_N, BLOCK_K] once and, for each row r, forms the float32 products
with x[r]'s chunk and sums them along K (one `tl.sum` of a [BLOCK_N, BLOCK_K] tile: its order is fixed
by the tile's layout, which depends on BLOCK_N, BLOCK_K and num_warps only), then adds that chunk sum
to row r's float32 accumulator. Every row runs the very same code on its own accumulator; the row
count only decides how many rows run (ROWS, a constexpr bucket 1 / 2 / 4 / 8, rows past M masked), so
a row's sums are the same in every bucket. Rounding: once, at the end, (accumulator + float32 bias)
rounded to x.dtype. No split-K, no atomics.

MAX_ROWS = 8: the kernel does ROWS multiply-adds on the CUDA cores (plus a reduction per K chunk) per
weight element it reads, so its time grows with the rows where cuBLAS's tensor cores stay flat. Measured
on an H100 (bench/tools/gemv_probe.py, Llama-3.2-1B / 3.1-8B shapes, bf16): at 1 row 4-17% faster than
F.linear (o 2048 -> 2048: 6.0 against 7.2 us; lm_head: 3.1 against 2.8 TB/s), at 4 rows 1.2-2x and at 8
rows 2-3x slower. Past 8 rows it only loses more.

Imported only where Triton is installed (a CUDA machine; CPU tests under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 8
ROW_BUCKETS = (1, 2, 4, 8)


class RowConfig(NamedTuple):
    block_n: int  # output features per program
    block_k: int  # input features per step of the K loop
    num_warps: int
    num_stages: int


# suited to H100 GEMV: small BLOCK_N so that a 2048-feature output still makes >= 128 programs,
# BLOCK_K wide enough for long coalesced reads of each weight row
CANDIDATES = (
    RowConfig(4, 1024, 4, 2),
    RowConfig(8, 512, 4, 2),
    RowConfig(8, 1024, 8, 2),
    RowConfig(16, 512, 8, 2),
    RowConfig(16, 256, 4, 3),
    RowConfig(32, 256, 8, 2),
)


@triton.jit
def _chunk_sum(x_ptr, x_stride, row, num_rows, w, k, k_ok):
    """One row's float32 sum of w [BLOCK_N, BLOCK_K] times its x chunk along K -> [BLOCK_N]."""
    x = tl.load(x_ptr + row * x_stride + k, mask=k_ok & (row < num_rows), other=0.0)
    return tl.sum(w * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _store_row(out_ptr, row, num_rows, n, n_ok, acc, bias, out_stride):
    tl.store(out_ptr + row * out_stride + n, (acc + bias).to(out_ptr.dtype.element_ty), mask=n_ok & (row < num_rows))


@triton.jit
def _linear_rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, num_rows, N, K, x_stride, w_stride, out_stride,
                        HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride  # [BLOCK_N, 1] (int64: vocab x hidden may pass 2^31)
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N], dtype=tl.float32)
    k0 = 0
    while k0 < K:  # not `range(0, K, BLOCK_K)`: Triton's interpreter (CPU tests) cannot take it
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        # the same code for every row, each on its own accumulator (rows past ROWS are not compiled)
        acc0 += _chunk_sum(x_ptr, x_stride, 0, num_rows, w, k, k_ok)
        if ROWS > 1:
            acc1 += _chunk_sum(x_ptr, x_stride, 1, num_rows, w, k, k_ok)
        if ROWS > 2:
            acc2 += _chunk_sum(x_ptr, x_stride, 2, num_rows, w, k, k_ok)
            acc3 += _chunk_sum(x_ptr, x_stride, 3, num_rows, w, k, k_ok)
        if ROWS > 4:
            acc4 += _chunk_sum(x_ptr, x_stride, 4, num_rows, w, k, k_ok)
            acc5 += _chunk_sum(x_ptr, x_stride, 5, num_rows, w, k, k_ok)
            acc6 += _chunk_sum(x_ptr, x_stride, 6, num_rows, w, k, k_ok)
            acc7 += _chunk_sum(x_ptr, x_stride, 7, num_rows, w, k, k_ok)
        k0 += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    _store_row(out_ptr, 0, num_rows, n, n_ok, acc0, bias, out_stride)
    if ROWS > 1:
        _store_row(out_ptr, 1, num_rows, n, n_ok, acc1, bias, out_stride)
    if ROWS > 2:
        _store_row(out_ptr, 2, num_rows, n, n_ok, acc2, bias, out_stride)
        _store_row(out_ptr, 3, num_rows, n, n_ok, acc3, bias, out_stride)
    if ROWS > 4:
        _store_row(out_ptr, 4, num_rows, n, n_ok, acc4, bias, out_stride)
        _store_row(out_ptr, 5, num_rows, n, n_ok, acc5, bias, out_stride)
        _store_row(out_ptr, 6, num_rows, n, n_ok, acc6, bias, out_stride)
        _store_row(out_ptr, 7, num_rows, n, n_ok, acc7, bias, out_stride)


def row_bucket(num_rows: int) -> int:
    """The compiled row count a call of num_rows rows runs with: the next of ROW_BUCKETS."""
    for rows in ROW_BUCKETS:
        if num_rows <= rows:
            return rows
    raise ValueError(f"linear_rows takes 1 to {MAX_ROWS} rows, got {num_rows}")


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: RowConfig) -> torch.Tensor:
    """x: [M, K] (1 <= M <= MAX_ROWS), weight: [N, K], bias: [N] or None -> [M, N] in x.dtype."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if num_rows < 1 or weight.shape[1] != in_features:
        raise ValueError(f"linear_rows: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = x.new_empty(num_rows, out_features)
    block_n, block_k, num_warps, num_stages = config
    _linear_rows_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, weight if bias is None else bias, out, num_rows, out_features, in_features, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, ROWS=row_bucket(num_rows), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_N=out_features % block_n == 0, EVEN_K=in_features % block_k == 0, num_warps=num_warps,
        num_stages=num_stages)
    return out
