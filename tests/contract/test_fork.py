"""Fork: children start as copies of the parent's sequence (pending token included), count their
rounds from the fork, and are independent afterwards; a Fork that fails creates no child."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from contract_helpers import GREEDY, PROMPT_A, PROMPT_B, SAMPLED, assert_code, repeat_last


def _rounds(wire, opened, num_rounds: int, **fields) -> list[int]:
    """Every token the session emitted (first_token_id included) after `num_rounds` rounds."""
    tokens = [opened.first_token_id]
    for index in range(num_rounds):
        tokens += wire.verify(opened.session_id, [tokens[-1]] * 3, round_index=index, **fields).accepted_token_ids
    return tokens


def _child(session_id: str, next_token_id: int):
    return SimpleNamespace(session_id=session_id, first_token_id=next_token_id)


def test_child_continues_like_the_parent(wire):
    n = 20
    parent = wire.open(PROMPT_B, **GREEDY, max_new_tokens=n)
    emitted = _rounds(wire, parent, 2)
    fork = wire.fork(parent.session_id, 2)
    assert len(fork.child_session_ids) == 2
    assert list(fork.next_token_ids) == [emitted[-1]] * 2  # the parent's pending token
    parent_loop = wire.verify_loop(SimpleNamespace(session_id=parent.session_id, first_token_id=emitted[-1]),
                                   repeat_last(3), first_round=2)  # closes the parent: the children live on
    assert emitted[:-1] + parent_loop.tokens == wire.generate(PROMPT_B, **GREEDY, max_new_tokens=n)[0]
    # a child's max_new_tokens counts from its pending token; its round_index starts at 0
    reference, _ = wire.generate(PROMPT_B, **GREEDY, max_new_tokens=len(emitted) - 1 + n)
    for child_id in fork.child_session_ids:
        child = wire.verify_loop(_child(child_id, emitted[-1]), repeat_last(3), round_index=True)
        assert child.tokens == reference[len(emitted) - 1:]
        assert child.finish_reason == wire.pb.common.FINISH_REASON_LENGTH


def test_children_with_append_token_ids(wire):
    n = 12
    append = [11, 22, 33]
    parent = wire.open(PROMPT_A, **GREEDY, max_new_tokens=n)
    try:
        emitted = _rounds(wire, parent, 1)
        fork = wire.fork(parent.session_id, 2, append_token_ids=append)
    finally:
        wire.close(parent.session_id)
    expected, _ = wire.generate(PROMPT_A + emitted + append, **GREEDY, max_new_tokens=n)
    assert list(fork.next_token_ids) == [expected[0]] * 2
    for child_id in fork.child_session_ids:
        child = wire.verify_loop(_child(child_id, expected[0]), repeat_last(3), round_index=True)
        assert child.tokens == expected


@pytest.mark.parametrize("seed", [1234, 2**63 + 5])  # seeds are uint64: the upper half too
def test_children_seeds_follow_the_parent_seed(wire, seed):
    """Without child_sampling, child i is seeded with parent seed + 1 + i: its first sampled token
    is what a fresh session on the same sequence with that seed samples first."""
    params = dict(SAMPLED, max_new_tokens=12)
    parent = wire.open(PROMPT_B, **params, seed=seed)
    try:
        emitted = _rounds(wire, parent, 1, deterministic_draft=True)
        fork = wire.fork(parent.session_id, 3, append_token_ids=[42])
    finally:
        wire.close(parent.session_id)
    for i, (child_id, next_token) in enumerate(zip(fork.child_session_ids, fork.next_token_ids)):
        fresh = wire.open(PROMPT_B + emitted + [42], **params, seed=seed + 1 + i)
        wire.close(fresh.session_id)
        wire.close(child_id)
        assert next_token == fresh.first_token_id, f"child {i}"


def test_too_many_children(wire):
    info = wire.info()
    parent = wire.open(PROMPT_A, **GREEDY, max_new_tokens=20)
    try:
        free = wire.free_blocks()
        assert_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: wire.fork(parent.session_id, info.max_fork_children + 1))
        assert wire.free_blocks() == free  # no child was created
        fork = wire.fork(parent.session_id, info.max_fork_children)  # the bound itself is fine
        for child_id in fork.child_session_ids:
            assert wire.close(child_id)
        assert wire.free_blocks() == free
    finally:
        wire.close(parent.session_id)
