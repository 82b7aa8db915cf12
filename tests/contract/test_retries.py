"""round_index makes retries safe: a resent round gets its first answer again and the session never
advances twice; any other index is FAILED_PRECONDITION (Verify, Step and Draft.Propose)."""

from __future__ import annotations

import grpc
import pytest
from contract_helpers import DEADLINE_S, GREEDY, PROMPT_A, PROMPT_B, SAMPLED, assert_code, repeat_last

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def test_verify_resend(wire):
    expected, _ = wire.generate(PROMPT_B, **GREEDY, max_new_tokens=20)
    loop = wire.verify_loop(wire.open(PROMPT_B, **GREEDY, max_new_tokens=20), repeat_last(3), resend=True)
    assert loop.tokens == expected


def test_verify_resend_sampled_does_not_draw_twice(wire):
    """A resend does not move the session's generator: the run equals one without resends."""
    params = dict(SAMPLED, seed=11, max_new_tokens=16)
    plain = wire.verify_loop(wire.open(PROMPT_B, **params), repeat_last(3), deterministic_draft=True)
    resent = wire.verify_loop(wire.open(PROMPT_B, **params), repeat_last(3), deterministic_draft=True, resend=True)
    assert resent.tokens == plain.tokens


def test_verify_wrong_round_index(wire):
    opened = wire.open(PROMPT_A, **GREEDY, max_new_tokens=30)
    sid, draft = opened.session_id, [opened.first_token_id] * 2
    try:
        assert_code(FAILED_PRECONDITION, lambda: wire.verify(sid, draft, round_index=1))  # ahead
        first = wire.verify(sid, draft, round_index=0)
        assert first.round_index == 0
        assert_code(FAILED_PRECONDITION, lambda: wire.verify(sid, [draft[0]], round_index=0))  # not the same round
        assert_code(FAILED_PRECONDITION, lambda: wire.verify(sid, draft, round_index=5))
        assert wire.verify(sid, draft, round_index=0) == first  # the resend is still answered
        assert wire.verify(sid, draft, round_index=1).round_index == 1
        assert_code(FAILED_PRECONDITION, lambda: wire.verify(sid, draft, round_index=0))  # stale
    finally:
        wire.close(sid)


def test_step_resend(wire):
    expected, _ = wire.generate(PROMPT_A, **GREEDY, max_new_tokens=24)
    loop = wire.step_loop(wire.open(PROMPT_A, **GREEDY, max_new_tokens=24), k=3, resend=True)
    assert loop.tokens == expected


def test_step_wrong_round_index(wire):
    opened = wire.open(PROMPT_A, **GREEDY, max_new_tokens=30)
    sid = opened.session_id
    try:
        assert_code(FAILED_PRECONDITION, lambda: wire.step(sid, 2, round_index=1))
        first = wire.step(sid, 2, round_index=0)
        assert_code(FAILED_PRECONDITION, lambda: wire.step(sid, 3, round_index=0))  # not the same round
        assert wire.step(sid, 2, round_index=0) == first
        assert wire.step(sid, 2, round_index=1).result.round_index == 1
    finally:
        wire.close(sid)


def test_propose_resend(wire):
    expected, _ = wire.generate(PROMPT_B, **GREEDY, max_new_tokens=20)
    loop = wire.draft_loop(PROMPT_B, k=3, resend=True, **GREEDY, max_new_tokens=20)
    assert loop.tokens == expected


@pytest.fixture
def draft_session(wire):
    pb = wire.pb.draft
    opened = wire.draft_stub.OpenSession(pb.DraftOpenSessionRequest(
        prompt_token_ids=PROMPT_A, sampling=wire.sampling(**GREEDY)), timeout=DEADLINE_S)
    yield opened.session_id
    wire.draft_stub.CloseSession(pb.DraftCloseSessionRequest(session_id=opened.session_id), timeout=DEADLINE_S)


def test_propose_wrong_round_index(wire, draft_session):
    def propose(accepted, round_index):
        return wire.draft_stub.Propose(wire.pb.draft.ProposeRequest(
            session_id=draft_session, accepted_token_ids=accepted, num_draft_tokens=2, round_index=round_index),
            timeout=DEADLINE_S)

    assert_code(FAILED_PRECONDITION, lambda: propose([9], 1))
    first = propose([9], 0)
    assert first.round_index == 0
    assert_code(FAILED_PRECONDITION, lambda: propose([10], 0))  # not the same call
    assert propose([9], 0) == first
    assert propose([first.draft_token_ids[0]], 1).round_index == 1
    assert_code(FAILED_PRECONDITION, lambda: propose([9], 0))  # stale
