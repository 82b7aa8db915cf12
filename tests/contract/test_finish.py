"""A session applies the finish rules to every round, reports finish_reason on the round that ends
it, and refuses further rounds with FAILED_PRECONDITION."""

from __future__ import annotations

import grpc
import pytest
from contract_helpers import GREEDY, PROMPT_A, assert_code, repeat_last

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def _assert_refuses_rounds(wire, session_id: str) -> None:
    assert_code(FAILED_PRECONDITION, lambda: wire.verify(session_id, [PROMPT_A[0]] * 2))
    assert_code(FAILED_PRECONDITION, lambda: wire.verify(session_id, []))
    assert_code(FAILED_PRECONDITION, lambda: wire.step(session_id, 2))


def test_max_new_tokens(wire):
    loop = wire.verify_loop(wire.open(PROMPT_A, **GREEDY, max_new_tokens=6), repeat_last(4), close=False)
    try:
        assert len(loop.tokens) == 6
        assert loop.finish_reason == wire.pb.common.FINISH_REASON_LENGTH
        assert [r.finish_reason for r in loop.responses[:-1]] == [0] * (len(loop.responses) - 1)
        _assert_refuses_rounds(wire, loop.session_id)
    finally:
        assert wire.close(loop.session_id)


def test_full_context(wire):
    """The context window ends a session: prompt + generated tokens fill it exactly."""
    prompt = [(7 * i) % 300 + 3 for i in range(wire.max_context - 10)]
    expected, finish = wire.generate(prompt, **GREEDY)
    assert finish == wire.pb.common.FINISH_REASON_CONTEXT
    loop = wire.verify_loop(wire.open(prompt, **GREEDY), repeat_last(4), close=False)
    try:
        assert loop.finish_reason == wire.pb.common.FINISH_REASON_CONTEXT
        assert len(prompt) + len(loop.tokens) == wire.max_context
        assert loop.tokens == expected
        _assert_refuses_rounds(wire, loop.session_id)
    finally:
        assert wire.close(loop.session_id)


@pytest.fixture(scope="module")
def eos_prompt(wire):
    """A prompt whose greedy continuation reaches EOS after a few tokens (searched with Generate)."""
    vocab = wire.vocab_size
    for t in range(3, 60):
        prompt = [t, 7 * t % vocab, 13 * t % vocab]
        expected, finish = wire.generate(prompt, temperature=0.0, max_new_tokens=40)
        if finish == wire.pb.common.FINISH_REASON_EOS and len(expected) >= 3:
            return prompt, expected
    pytest.skip("no prompt of the search reaches EOS greedily with this tiny model")


@pytest.mark.parametrize("via", ["verify", "step"])
def test_eos(wire, eos_prompt, via):
    prompt, expected = eos_prompt
    assert expected[-1] in wire.eos_token_ids
    opened = wire.open(prompt, temperature=0.0, max_new_tokens=40)
    if via == "verify":
        loop = wire.verify_loop(opened, repeat_last(4), close=False)
    else:
        loop = wire.step_loop(opened, k=4, close=False)
    try:
        assert loop.tokens == expected
        assert loop.finish_reason == wire.pb.common.FINISH_REASON_EOS
        _assert_refuses_rounds(wire, loop.session_id)
    finally:
        assert wire.close(loop.session_id)
