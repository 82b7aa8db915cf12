"""Triton kernels behind specmesh/models/fused.py (what each computes and where it rounds: there).

Imported only where Triton is installed (a CUDA machine; CPU tests under TRITON_INTERPRET=1). Each
kernel takes one token row per program; products are computed in float32 and rounded to the
tensor dtype where the eager op would have produced a tensor of that dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, hidden, eps, x_stride, delta_stride,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * delta_stride + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * hidden + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * hidden + cols, (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, hidden = x.shape
    total = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(num_rows,)](x, x if delta is None else delta, weight, total, out, hidden, eps, x.stride(0),
                                      x.stride(0) if delta is None else delta.stride(0), HAS_DELTA=delta is not None,
                                      BLOCK=triton.next_power_of_2(hidden), num_warps=4)
    return total, out


@triton.jit
def _rope_and_write_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                           qk_row_stride, qk_head_stride, v_row_stride, v_head_stride, cache_slot_stride,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEADS: tl.constexpr, HALF: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr):
    n = tl.program_id(0)
    position = tl.load(positions_ptr + n)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    half = HEAD_DIM // 2
    h = tl.arange(0, HEADS)
    c = tl.arange(0, HALF)
    ok = (h < NUM_HEADS + NUM_KV_HEADS)[:, None] & (c < half)[None, :]
    row = qk_ptr + n * qk_row_stride + h[:, None] * qk_head_stride + c[None, :]
    x1 = tl.load(row, mask=ok, other=0.0)
    x2 = tl.load(row + half, mask=ok, other=0.0)
    dtype = x1.dtype
    table = position * HEAD_DIM + c
    cos1 = tl.load(cos_ptr + table, mask=c < half, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + half, mask=c < half, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table, mask=c < half, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + half, mask=c < half, other=0.0).to(tl.float32)[None, :]
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # eager: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
    out1 = ((f1 * cos1).to(dtype).to(tl.float32) + (-f2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((f2 * cos2).to(dtype).to(tl.float32) + (f1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    is_q = (h < NUM_HEADS)[:, None] & ok
    q_row = q_ptr + (n * NUM_HEADS + h[:, None]) * HEAD_DIM + c[None, :]
    tl.store(q_row, out1, mask=is_q)
    tl.store(q_row + half, out2, mask=is_q)
    is_k = (h >= NUM_HEADS)[:, None] & ok
    k_row = k_cache_ptr + slot * cache_slot_stride + (h[:, None] - NUM_HEADS) * HEAD_DIM + c[None, :]
    tl.store(k_row, out1, mask=is_k)
    tl.store(k_row + half, out2, mask=is_k)
    kv = tl.arange(0, KV_HEADS)
    d = tl.arange(0, DIM)
    v_ok = (kv < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + n * v_row_stride + kv[:, None] * v_head_stride + d[None, :], mask=v_ok, other=0.0)
    tl.store(v_cache_ptr + slot * cache_slot_stride + kv[:, None] * HEAD_DIM + d[None, :], v, mask=v_ok)


def rope_and_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    num_tokens, num_qk_heads, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    if qk.stride(2) != 1 or v.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_and_write needs unit-stride head dims and contiguous caches")
    q = qk.new_empty(num_tokens, num_heads, head_dim)
    _rope_and_write_kernel[(num_tokens,)](
        qk, v, cos, sin, positions, slots, q, k_cache, v_cache, qk.stride(0), qk.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS=triton.next_power_of_2(num_qk_heads), HALF=max(2, triton.next_power_of_2(head_dim // 2)),
        KV_HEADS=triton.next_power_of_2(num_kv_heads), DIM=triton.next_power_of_2(head_dim), num_warps=4)
    return q


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, row_stride, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + n * row_stride + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + n * row_stride + width + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + n * width + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    num_tokens, double = gate_up.shape
    width = double // 2
    out = gate_up.new_empty(num_tokens, width)
    block = 1024
    _silu_mul_kernel[(num_tokens, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), BLOCK=block,
                                                               num_warps=4)
    return out
