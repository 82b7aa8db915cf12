"""Paged KV bookkeeping: fixed-size blocks, per-sequence block tables, refcounts. No torch here.

A sequence's KV lives in blocks of `block_size` token slots taken from one shared pool. Token `t`
of a sequence sits in block `block_table[t // block_size]` at offset `t % block_size`; its *slot*
(the row in the flat per-layer KV storage) is `block * block_size + offset`.

Forking gives the child the parent's block table with every block's refcount raised, so the prefix
is shared and nothing is copied. A block with refcount > 1 is never written: the first write into it
(from either sequence, e.g. appending to a shared partly filled last block, or appending after a
truncate into the shared prefix) first copies it to a fresh block ("copy on write"). The copy is
reported to the caller as a (src_block, dst_block) pair, which the tensor side performs.

Worked example (block_size 4):
    >>> bm = BlockManager(num_blocks=8, block_size=4)
    >>> a = bm.add_sequence()
    >>> bm.append(a, 6).slots            # blocks [0, 1]: slots 0..3 then 4, 5
    [0, 1, 2, 3, 4, 5]
    >>> b = bm.fork(a)                   # shares blocks 0 (full) and 1 (2 of 4 used)
    >>> bm.block_table(b), bm.num_used_blocks
    ([0, 1], 2)
    >>> plan = bm.append(b, 1)           # b writes into the shared block 1: copy it to block 2 first
    >>> plan.slots, plan.copies, bm.block_table(b), bm.block_table(a)
    ([10], [(1, 2)], [0, 2], [0, 1])
    >>> bm.append(a, 1).slots            # a now owns block 1 alone: no copy
    [6]
    >>> bm.truncate(a, 3); bm.block_table(a), bm.num_used_blocks   # block 1 dropped by a
    ([0], 2)
    >>> bm.free(b); bm.free(a); bm.num_free_blocks
    8
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh.kv.errors import OutOfBlocksError


@dataclass
class AppendPlan:
    """Where `append` put the new tokens, and the copy-on-write block copies to do before writing."""

    slots: list[int]  # [num_tokens] flat slot of each new token
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src_block, dst_block)


@dataclass
class _Sequence:
    block_table: list[int]
    length: int  # tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        self._free = deque(range(num_blocks))
        self._seqs: dict[int, _Sequence] = {}
        self._next_seq_id = 0
        self.on_release: Callable[[int], None] | None = None  # told each block that goes back to the pool (its rows
        # may be another sequence's next: a reader of a shared cache learns so, specmesh.kv.shared)

    @classmethod
    def from_memory_budget(cls, budget_bytes: int, bytes_per_token: int, block_size: int = 16) -> BlockManager:
        """As many blocks as fit in `budget_bytes`, each token costing `bytes_per_token` (all layers, K+V).

        >>> BlockManager.from_memory_budget(1000, bytes_per_token=10, block_size=16).num_blocks
        6
        """
        return cls(max(1, budget_bytes // (bytes_per_token * block_size)), block_size)

    # accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    # sequences
    def add_sequence(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._seqs[seq_id] = _Sequence(block_table=[], length=0)
        return seq_id

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def slots(self, seq_id: int, start: int = 0, end: int | None = None) -> list[int]:
        """Flat slots of tokens [start, end) of the sequence.

        >>> bm = BlockManager(num_blocks=4, block_size=2)
        >>> s = bm.add_sequence(); _ = bm.append(s, 2); t = bm.add_sequence(); _ = bm.append(t, 1)
        >>> _ = bm.append(s, 2); bm.block_table(s), bm.slots(s), bm.slots(s, 1, 3)
        ([0, 2], [0, 1, 4, 5], [1, 4])
        """
        seq = self._seq(seq_id)
        end = seq.length if end is None else end
        size = self.block_size
        table = seq.block_table
        return [table[t // size] * size + t % size for t in range(start, end)]

    def fork(self, seq_id: int) -> int:
        parent = self._seq(seq_id)
        for block in parent.block_table:
            self._refcounts[block] += 1
        child_id = self._next_seq_id
        self._next_seq_id += 1
        self._seqs[child_id] = _Sequence(block_table=list(parent.block_table), length=parent.length)
        return child_id

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Free blocks an `append(seq_id, num_tokens)` would take (new blocks + a copy-on-write)."""
        seq = self._seq(seq_id)
        new_length = seq.length + num_tokens
        needed = -(-new_length // self.block_size) - len(seq.block_table)
        if num_tokens > 0 and seq.length % self.block_size:
            last = seq.block_table[seq.length // self.block_size]
            if self._refcounts[last] > 1:
                needed += 1
        return max(needed, 0)

    def append(self, seq_id: int, num_tokens: int) -> AppendPlan:
        """Reserve slots for `num_tokens` new tokens; all or nothing (OutOfBlocksError changes nothing)."""
        seq = self._seq(seq_id)
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise OutOfBlocksError(
                f"KV cache full: need {needed} more blocks of {self.block_size} tokens, {len(self._free)} free "
                f"of {self.num_blocks}"
            )
        plan = AppendPlan(slots=[])
        size = self.block_size
        table = seq.block_table
        if num_tokens > 0 and seq.length % size:
            index = seq.length // size
            last = table[index]
            if self._refcounts[last] > 1:
                fresh = self._take()
                self._refcounts[last] -= 1
                table[index] = fresh
                plan.copies.append((last, fresh))
        while len(table) * size < seq.length + num_tokens:
            table.append(self._take())
        start = seq.length
        seq.length += num_tokens
        plan.slots = [table[t // size] * size + t % size for t in range(start, seq.length)]
        return plan

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` tokens; blocks past them are released. Touches only dropped blocks."""
        seq = self._seq(seq_id)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {seq.length} to {length}")
        keep_blocks = -(-length // self.block_size)
        while len(seq.block_table) > keep_blocks:
            self._release(seq.block_table.pop())
        seq.length = length

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        for block in seq.block_table:
            self._release(block)

    # internals
    def _seq(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id}") from None

    def _take(self) -> int:
        block = self._free.popleft()
        assert self._refcounts[block] == 0
        self._refcounts[block] = 1
        return block

    def _release(self, block: int) -> None:
        assert self._refcounts[block] > 0
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._free.appendleft(block)  # reused first: a rollback + re-append keeps the same blocks
            if self.on_release is not None:
                self.on_release(block)
