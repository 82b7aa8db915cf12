"""Ragged batches, token trees and KV operations of the native engine, checked against plain runs."""

import pytest
import torch
from engine_helpers import random_ids, run_alone, with_sliding_window

from specmesh.kv.errors import OutOfBlocksError
from specmesh.models.engine import NO_PARENT, ContextLengthError, SeqInput
from specmesh.models.load import load_engine

ATOL = 1e-9  # float64 on the plain kernel: only summation order differs


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return load_engine(tiny_model_dir("qwen3"), dtype="float64", max_kv_tokens=1024, block_size=4)


@pytest.fixture(scope="module")
def windowed(tiny_model_dir, tmp_path_factory):
    """Mistral with a sliding window shorter than the sequences below."""
    path = with_sliding_window(tiny_model_dir("mistral"), tmp_path_factory.mktemp("mistral-window"), 6)
    return load_engine(path, dtype="float64", max_kv_tokens=1024, block_size=4)


def prefilled(engine, ids):
    seq = engine.new_sequence()
    engine.forward([SeqInput(seq, ids, [len(ids) - 1])])
    return seq


@pytest.mark.parametrize("shapes,split", [
    # (cached length, new tokens): decode, verify k+1, a prefill from nothing, a long prefill on a cache
    ([(9, 1), (3, 5), (0, 17), (21, 9), (6, 1)], True),  # decode rows attended apart from the others
    ([(9, 2), (3, 5), (4, 3)], False),  # no decode row: one padded attention
    ([(9, 1), (12, 1), (3, 1), (30, 1), (7, 1), (20, 1), (11, 1), (5, 9)], True),  # one session's draft among decode steps
])
@pytest.mark.parametrize("model", ["qwen3", "mistral-window-6"])
def test_ragged_batch_equals_each_sequence_alone(engine, windowed, model, shapes, split):
    engine = engine if model == "qwen3" else windowed
    histories = [random_ids(engine.vocab_size, c + n, seed=10 + i) for i, (c, n) in enumerate(shapes)]
    seqs = [prefilled(engine, h[:c]) if c else engine.new_sequence() for h, (c, _) in zip(histories, shapes)]
    batch = [SeqInput(s, h[c:], list(range(n))[::-1]) for s, h, (c, n) in zip(seqs, histories, shapes)]
    assert engine._splits(batch) == split
    got = engine.forward(batch)
    for logits, h, (c, n) in zip(got, histories, shapes):
        alone = run_alone(engine, h, [c, n] if c else [n])[c:]
        assert logits.shape == (n, engine.vocab_size)
        torch.testing.assert_close(logits, alone.flip(0), atol=ATOL, rtol=0)
    for s in seqs:
        engine.free(s)


def test_token_tree_equals_each_path_and_keep_path_continues_it(engine):
    prompt = random_ids(engine.vocab_size, 7, seed=20)
    a, b = random_ids(engine.vocab_size, 3, seed=21), random_ids(engine.vocab_size, 3, seed=22)
    # two branches of depth 3: a0 -> a1 -> a2 and b0 -> b1 -> b2, interleaved to exercise the indices
    tokens = [a[0], b[0], a[1], b[1], a[2], b[2]]
    parents = [NO_PARENT, NO_PARENT, 0, 1, 2, 3]
    seq = prefilled(engine, prompt)
    tree = engine.forward([SeqInput(seq, tokens, list(range(6)), parents=parents)])[0]
    path_a = run_alone(engine, prompt + a, [7, 3])[7:]
    path_b = run_alone(engine, prompt + b, [7, 3])[7:]
    torch.testing.assert_close(tree[[0, 2, 4]], path_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(tree[[1, 3, 5]], path_b, atol=ATOL, rtol=0)

    engine.keep_tree_path(seq, [1, 3])  # keep b0, b1; drop b2 and the whole a branch
    assert engine.seq_len(seq) == 9
    more = random_ids(engine.vocab_size, 3, seed=23)
    continued = torch.cat([engine.forward([SeqInput(seq, [t], [0])])[0] for t in more])
    plain = run_alone(engine, prompt + b[:2] + more, [9, 1, 1, 1])[9:]
    torch.testing.assert_close(continued, plain, atol=ATOL, rtol=0)
    engine.free(seq)


def test_keep_tree_path_rejects_a_non_path(engine):
    seq = prefilled(engine, random_ids(engine.vocab_size, 3, seed=24))
    engine.forward([SeqInput(seq, [5, 6, 7], [0], parents=[NO_PARENT, NO_PARENT, 0])])
    with pytest.raises(ValueError):
        engine.keep_tree_path(seq, [1, 2])  # 2's parent is 0, not 1
    engine.keep_tree_path(seq, [0, 2])
    assert engine.seq_len(seq) == 5
    engine.free(seq)


def test_truncate_then_reappend_equals_never_appended(engine):
    ids = random_ids(engine.vocab_size, 14, seed=30)
    seq = prefilled(engine, ids[:10])
    engine.forward([SeqInput(seq, random_ids(engine.vocab_size, 5, seed=31), [0])])  # rejected draft
    engine.truncate(seq, 10)
    got = engine.forward([SeqInput(seq, ids[10:], list(range(4)))])[0]
    torch.testing.assert_close(got, run_alone(engine, ids, [10, 4])[10:], atol=ATOL, rtol=0)
    engine.free(seq)


def test_fork_and_divergent_appends_leave_the_parent_untouched(engine):
    ids = random_ids(engine.vocab_size, 10, seed=40)  # 10 tokens: block 2 of 4-token blocks is partial
    parent = prefilled(engine, ids)
    child = engine.fork(parent)
    child_tail = random_ids(engine.vocab_size, 6, seed=41)
    parent_tail = random_ids(engine.vocab_size, 3, seed=42)
    child_logits = engine.forward([SeqInput(child, child_tail, list(range(6)))])[0]
    parent_logits = engine.forward([SeqInput(parent, parent_tail, list(range(3)))])[0]
    torch.testing.assert_close(child_logits, run_alone(engine, ids + child_tail, [10, 6])[10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(parent_logits, run_alone(engine, ids + parent_tail, [10, 3])[10:], atol=ATOL, rtol=0)
    assert (engine.seq_len(parent), engine.seq_len(child)) == (13, 16)
    engine.free(parent)
    engine.free(child)


def test_free_returns_all_blocks_and_out_of_blocks(tiny_model_dir):
    engine = load_engine(tiny_model_dir("llama"), dtype="float32", max_kv_tokens=32, block_size=8)
    total = engine.num_free_blocks
    assert total == 4
    a = prefilled(engine, random_ids(engine.vocab_size, 18, seed=50))
    b = engine.fork(a)
    engine.forward([SeqInput(b, [5, 6, 7, 8, 9], [4])])  # 23 tokens: copy-on-write of a's partial block
    assert engine.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        engine.forward([SeqInput(a, [5], [0]), SeqInput(b, [1, 2, 3, 4], [0])])
    # a's part fits its own block, b's needs a new one: the failed batch appends nothing to either
    assert (engine.seq_len(a), engine.seq_len(b)) == (18, 23)
    engine.free(a)
    engine.free(b)
    assert engine.num_free_blocks == total


def test_request_errors(engine):
    seq = engine.new_sequence()
    with pytest.raises(ValueError):
        engine.forward([SeqInput(seq, [engine.vocab_size], [0])])
    with pytest.raises(ValueError):
        engine.forward([SeqInput(seq, [1, 2], [2])])
    with pytest.raises(ValueError):
        engine.forward([SeqInput(seq, [1, 2], [0], parents=[NO_PARENT, 1])])
    with pytest.raises(ContextLengthError):
        engine.forward([SeqInput(seq, [1] * (engine.max_context + 1), [0])])
    with pytest.raises(KeyError):
        engine.forward([SeqInput(12345, [1], [0])])
    assert engine.seq_len(seq) == 0
    engine.free(seq)
