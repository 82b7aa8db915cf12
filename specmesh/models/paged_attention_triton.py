"""The Triton kernel behind `paged_attention` (contract and worked example: paged_attention.py).

Imported only where Triton is installed (a CUDA machine; CPU tests under TRITON_INTERPRET=1).

One program per (sequence b, kv head h). Its query tile holds rows r = t * GROUP + g: query t of
the sequence, query head h * GROUP + g (the heads that share kv head h). It walks the keys in tiles
of TILE tokens (TILE / block_size pages), looking each page up in the block table, and keeps the
running max, sum and weighted values per row (online softmax), so each key and value row is read
once per kv head and never copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_lens_ptr, scale,
                            q_row_stride, q_head_stride, kv_slot_stride, kv_head_stride, table_stride,
                            out_row_stride, out_head_stride,
                            T: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    query_len = tl.load(query_lens_ptr + b)

    r = tl.arange(0, ROWS)
    t = r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = r < T * GROUP
    d = tl.arange(0, DIM)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (b * T + t)[:, None] * q_row_stride + head[:, None] * q_head_stride + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    limit = tl.where(t < query_len, seq_len - query_len + t + 1, seq_len)  # keys each row sees

    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    start = 0
    while start < seq_len:  # not `range(0, seq_len, TILE)`: Triton's interpreter (CPU tests) cannot take it
        j = start + tl.arange(0, TILE)
        j_ok = j < seq_len
        page = tl.load(tables_ptr + b * table_stride + j // BLOCK_SIZE, mask=j_ok, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
        kv_offsets = slot[:, None] * kv_slot_stride + kv_head * kv_head_stride + d[None, :]
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [TILE, DIM]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(j[None, :] < limit[:, None], s * scale, float("-inf"))  # [ROWS, TILE]
        new_max = tl.maximum(running_max, tl.max(s, 1))  # finite: every row sees key 0 in the first tile
        alpha = tl.exp(running_max - new_max)
        p = tl.exp(s - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
        start += TILE
    out = acc / running_sum[:, None]
    tl.store(out_ptr + (b * T + t)[:, None] * out_row_stride + head[:, None] * out_head_stride + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch,
                           scale: float) -> torch.Tensor:
    """q: [B * T, heads, head_dim] -> [B * T, heads * head_dim]; k_cache, v_cache: [slots, kv_heads, head_dim];
    batch: a `paged_attention.PagedBatch` (not imported: that module imports this one)."""
    num_batch = batch.block_tables.shape[0]
    rows = batch.rows_per_sequence
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = q.new_empty(num_batch * rows, num_heads, head_dim)
    dim = max(16, triton.next_power_of_2(head_dim))
    tile = max(64, batch.block_size)
    if tile % batch.block_size:
        raise ValueError(f"block size {batch.block_size} must divide the key tile {tile}")
    _paged_attention_kernel[(num_batch, num_kv_heads)](
        q, k_cache, v_cache, out, batch.block_tables, batch.seq_lens, batch.query_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), batch.block_tables.stride(0),
        out.stride(0), out.stride(1),
        T=rows, GROUP=group, HEAD_DIM=head_dim, DIM=dim, ROWS=max(16, triton.next_power_of_2(rows * group)),
        BLOCK_SIZE=batch.block_size, TILE=tile, IEEE=q.dtype == torch.float32, num_warps=4)
    return out.view(num_batch * rows, num_heads * head_dim)
