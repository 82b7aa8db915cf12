"""Paged KV tensors: one K and one V tensor for all layers, addressed by the block manager's slots.

Storage per K (and V): [num_layers, num_blocks * block_size, num_kv_heads, head_dim]; row `slot` of
layer `l` holds one token's key. A forward writes its new tokens' K/V at the slots `append` returned
(`write`) and reads each sequence's whole history back with one `gather` per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.kv.block_manager import AppendPlan, BlockManager


def block_slots(blocks: Sequence[int], offsets: torch.Tensor, length: int) -> torch.Tensor:
    """Slots of a sequence's first `length` positions, its `blocks` of `len(offsets)` slots each
    (`offsets`: arange of the block size, on the cache's device), as a long tensor there."""
    table = torch.tensor(blocks, dtype=torch.long, device=offsets.device)
    return (table[:, None] * len(offsets) + offsets).view(-1)[:length]


def rows_fit(shape: Sequence[int], other: Sequence[int]) -> bool:
    """Whether two caches' K (or V) tensors, [layers, slots, kv heads, head dim], hold rows of one shape."""
    return shape[0] == other[0] and tuple(shape[2:]) == tuple(other[2:])


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scratch_blocks: int = 0,
    ):
        """scratch_blocks: blocks after the manager's `num_blocks`, never given to a sequence (blocks
        `scratch_block` ... on): fixed-shape steps write their padding rows there (specmesh/models/graphs.py)."""
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = (num_layers, (num_blocks + scratch_blocks) * block_size, num_kv_heads, head_dim)
        # empty, not zeros: pages are only touched once tokens are written
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._block_offsets = torch.arange(block_size, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def append(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve `num_tokens` slots (copy-on-write done here) and return them."""
        plan: AppendPlan = self.blocks.append(seq_id, num_tokens)
        self.copy_blocks(plan.copies)
        return plan.slots

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        size = self.block_size
        for src, dst in copies:
            self.k[:, dst * size : (dst + 1) * size] = self.k[:, src * size : (src + 1) * size]
            self.v[:, dst * size : (dst + 1) * size] = self.v[:, src * size : (src + 1) * size]

    def slot_tensor(self, seq_id: int, length: int | None = None) -> torch.Tensor:
        """Slots of the first `length` tokens (default: all) as a long tensor on the cache's device."""
        length = self.blocks.length(seq_id) if length is None else length
        return block_slots(self.blocks.block_table(seq_id), self._block_offsets, length)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] stored at `slots` [num_tokens]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V rows at `slots` (any shape S) -> [*S, num_kv_heads, head_dim] each."""
        flat = slots.reshape(-1)
        k = self.k[layer].index_select(0, flat)
        v = self.v[layer].index_select(0, flat)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])

    def keep_path(self, seq_id: int, start: int, node_indices: Sequence[int]) -> None:
        """The sequence's tokens from `start` on are the nodes of a tree; keep only `node_indices`
        (in that order) so they sit at positions start, start+1, ... and drop every other node.

        Example: cached 5, tree nodes [a, b, c, d] at positions 5..8; keep_path(s, 5, [2, 3]) moves
        c to 5 and d to 6 and truncates to 7 tokens.
        """
        length = self.blocks.length(seq_id)
        if any(not 0 <= i < length - start for i in node_indices):
            raise ValueError(f"tree node index out of range 0..{length - start - 1}: {list(node_indices)}")
        all_slots = self.slot_tensor(seq_id)
        src = all_slots[[start + i for i in node_indices]]
        k_rows = self.k[:, src].clone()
        v_rows = self.v[:, src].clone()
        self.blocks.truncate(seq_id, start)
        dst = torch.tensor(self.append(seq_id, len(node_indices)), dtype=torch.long, device=self.k.device)
        self.k[:, dst] = k_rows
        self.v[:, dst] = v_rows
