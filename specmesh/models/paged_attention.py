"""Paged attention over the block table, for the fixed-shape step that CUDA graphs replay.

The layout (`PagedBatch`): every sequence of the batch brings exactly T query rows, its new tokens
padded with ignored rows up to T. Its keys are the first `seq_lens[b]` tokens of its block table
(cached and new; the new ones are written before attention). Query t < query_lens[b] sits at
position seq_lens[b] - query_lens[b] + t and sees the keys up to that position: the new tokens
form a chain. A padding row (t >= query_lens[b]) sees all of its sequence's keys; its output is
never read.

Worked example (block size 4, seq_lens [6], query_lens [2], T 2, block table [[7, 3]]):
    keys 0-3 live in slots 28-31 (block 7), keys 4-5 in slots 12-13 (block 3)
    query 0 (position 4) sees keys 0-4; query 1 (position 5) sees keys 0-5

Two implementations of that one contract:
- `paged_attention_reference` (torch, any device): gathers each sequence's blocks into a padded
  key tensor and masks it. CPU tests run it, and it checks the kernel.
- `paged_attention` on CUDA with Triton: one program per (sequence, kv head) walks the sequence's
  block table tile by tile with an online softmax. Nothing is gathered, no mask is built, and the
  loop bound is read from `seq_lens` on the device, so one captured graph serves every context
  length. All query heads of a kv head (GQA) and all T rows are one tile of queries.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PagedBatch:
    """Per-step attention metadata of the fixed-shape step, on the model's device (shared by every layer)."""

    block_tables: torch.Tensor  # [B, W] integer blocks of each sequence (unused entries: any block)
    seq_lens: torch.Tensor  # [B] integer keys of each sequence, its new tokens included
    query_lens: torch.Tensor  # [B] integer real new tokens of each sequence (<= T)
    block_size: int
    rows_per_sequence: int  # T


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take this tensor: Triton installed, x on CUDA (or TRITON_INTERPRET=1:
    the CPU tests), and not float64 (which stays on the torch references)."""
    return x.dtype != torch.float64 and triton_available() and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                              scale: float) -> torch.Tensor:
    """q: [B * T, heads, head_dim]; k_cache, v_cache: [slots, kv_heads, head_dim] -> [B * T, heads * head_dim]."""
    num_batch, width = batch.block_tables.shape
    rows = batch.rows_per_sequence
    num_heads, head_dim = q.shape[1], q.shape[2]
    offsets = torch.arange(batch.block_size, device=q.device)
    slots = (batch.block_tables.long()[:, :, None] * batch.block_size + offsets).view(num_batch, -1)  # [B, K]
    t = torch.arange(rows, device=q.device)
    seq_lens, query_lens = batch.seq_lens.long()[:, None], batch.query_lens.long()[:, None]
    key_index = torch.arange(slots.shape[1], device=q.device)
    # slots past a sequence's keys were never written (the cache is uninitialised memory, NaN bit patterns
    # included): zeroed, so that masked keys and values cannot turn the softmax or its sum into NaN
    written = (key_index < seq_lens)[:, :, None, None]  # [B, K, 1, 1]
    keys = torch.where(written, k_cache[slots], 0)  # [B, K, kv_heads, head_dim]
    values = torch.where(written, v_cache[slots], 0)
    limit = torch.where(t < query_lens, seq_lens - query_lens + t + 1, seq_lens)  # [B, T] keys each row sees
    mask = key_index < limit[:, :, None]  # [B, T, K]
    out = F.scaled_dot_product_attention(q.view(num_batch, rows, num_heads, head_dim).transpose(1, 2),
                                         keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None],
                                         scale=scale, enable_gqa=True)  # [B, heads, T, head_dim]
    return out.transpose(1, 2).reshape(num_batch * rows, num_heads * head_dim)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float) -> torch.Tensor:
    """The Triton kernel on CUDA (or under TRITON_INTERPRET=1; not float64), else the reference."""
    if triton_runs(q):
        from specmesh.models.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, batch, scale)
    return paged_attention_reference(q, k_cache, v_cache, batch, scale)
