"""Paged KV bookkeeping without tensors: append, truncate, fork + copy-on-write, free, exhaustion."""


import pytest

import specmesh.kv.block_manager as block_manager_module
from specmesh.kv.block_manager import BlockManager
from specmesh.kv.errors import OutOfBlocksError


def test_append_fills_blocks_in_order():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = bm.add_sequence()
    assert bm.append(s, 3).slots == [0, 1, 2]
    assert bm.append(s, 3).slots == [3, 4, 5]
    assert bm.block_table(s) == [0, 1]
    assert bm.length(s) == 6
    assert (bm.num_used_blocks, bm.num_free_blocks) == (2, 2)
    assert bm.append(s, 0).slots == []


def test_truncate_then_reappend_equals_never_appended():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = bm.add_sequence()
    bm.append(s, 5)
    before = (bm.block_table(s), bm.slots(s), bm.num_free_blocks)
    bm.append(s, 7)  # grows to 12 tokens, 3 blocks
    bm.truncate(s, 5)
    assert (bm.block_table(s), bm.slots(s), bm.num_free_blocks) == before
    # re-append lands on the same logical positions
    assert bm.append(s, 2).slots == bm.slots(s)[5:7]


def test_truncate_to_zero_and_to_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = bm.add_sequence()
    bm.append(s, 8)
    bm.truncate(s, 4)
    assert bm.block_table(s) == [0] and bm.num_free_blocks == 3
    bm.truncate(s, 0)
    assert bm.block_table(s) == [] and bm.num_free_blocks == 4
    with pytest.raises(ValueError):
        bm.truncate(s, 1)


def test_fork_shares_full_blocks_and_copies_partial_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.add_sequence()
    bm.append(parent, 6)
    child = bm.fork(parent)
    assert bm.block_table(child) == bm.block_table(parent) == [0, 1]
    assert bm.refcount(0) == bm.refcount(1) == 2
    assert bm.num_used_blocks == 2
    plan = bm.append(child, 3)  # into shared partial block 1 -> copy to 2, then needs block 3
    assert plan.copies == [(1, 2)]
    assert plan.slots == [10, 11, 12]
    assert bm.block_table(parent) == [0, 1] and bm.length(parent) == 6
    assert bm.block_table(child) == [0, 2, 3] and bm.length(child) == 9
    assert bm.refcount(1) == 1 and bm.refcount(0) == 2
    # the parent's own append into block 1 needs no copy any more
    assert bm.append(parent, 1) == block_manager_module.AppendPlan(slots=[6], copies=[])


def test_parent_write_after_fork_copies_too():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.add_sequence()
    bm.append(parent, 2)
    child = bm.fork(parent)
    plan = bm.append(parent, 1)
    assert plan.copies == [(0, 1)] and plan.slots == [6]
    assert bm.block_table(child) == [0]


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.add_sequence()
    bm.append(parent, 4)
    child = bm.fork(parent)
    plan = bm.append(child, 1)
    assert plan.copies == [] and bm.block_table(child) == [0, 1]


def test_truncate_into_shared_prefix_then_append_copies():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.add_sequence()
    bm.append(parent, 8)
    child = bm.fork(parent)
    bm.truncate(child, 6)
    assert bm.refcount(1) == 2  # still shared, the child only moved its length
    plan = bm.append(child, 1)
    assert plan.copies == [(1, 2)] and plan.slots == [10]
    assert bm.block_table(parent) == [0, 1] and bm.length(parent) == 8


def test_free_returns_every_block_even_after_forks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.add_sequence()
    bm.append(a, 10)
    b = bm.fork(a)
    bm.append(b, 5)
    c = bm.fork(b)
    bm.append(c, 1)
    assert bm.num_free_blocks < 8
    for seq in (b, a, c):
        bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.num_sequences == 0
    assert all(bm.refcount(block) == 0 for block in range(8))
    with pytest.raises(KeyError):
        bm.free(a)


def test_out_of_blocks_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = bm.add_sequence()
    bm.append(s, 6)
    with pytest.raises(OutOfBlocksError):
        bm.append(s, 3)
    assert bm.length(s) == 6 and bm.block_table(s) == [0, 1]
    bm.append(s, 2)  # exactly fills the pool
    assert bm.num_free_blocks == 0


def test_out_of_blocks_counts_the_copy_on_write_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = bm.add_sequence()
    bm.append(s, 6)
    child = bm.fork(s)
    with pytest.raises(OutOfBlocksError):
        bm.append(child, 1)  # needs a copy of block 1, none free
    assert bm.block_table(child) == [0, 1] and bm.refcount(1) == 2


def test_memory_budget_sizing():
    bm = BlockManager.from_memory_budget(budget_bytes=64 * 1024, bytes_per_token=256, block_size=16)
    assert bm.num_blocks == 16


def test_unknown_sequence():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(KeyError):
        bm.append(7, 1)
