"""Sessions: server-made ids, unknown and malformed ids, KV accounting, VerifyBatch atomicity, and
a round racing CloseSession."""

from __future__ import annotations

import asyncio
import re
import secrets

import grpc
import pytest
from contract_helpers import DEADLINE_S, GREEDY, PROMPT_A, PROMPT_B, assert_code, repeat_last

SESSION_ID = re.compile(r"[0-9a-f]{32}")


def _open_everywhere(wire) -> dict[str, list[str]]:
    pb = wire.pb
    return {
        "verify": [wire.open(PROMPT_A, **GREEDY).session_id for _ in range(4)],
        "draft": [wire.draft_stub.OpenSession(pb.draft.DraftOpenSessionRequest(prompt_token_ids=PROMPT_A),
                                              timeout=DEADLINE_S).session_id for _ in range(2)],
        "stage": [wire.stage_stub.OpenSession(pb.stage.StageOpenSessionRequest(prompt_token_ids=PROMPT_A),
                                              timeout=DEADLINE_S).session_id for _ in range(2)],
    }


def _close_calls(wire, session_id: str) -> dict:
    pb = wire.pb
    return {
        "verify": lambda: wire.verify_stub.CloseSession(pb.verify.VerifyCloseSessionRequest(session_id=session_id),
                                                        timeout=DEADLINE_S),
        "draft": lambda: wire.draft_stub.CloseSession(pb.draft.DraftCloseSessionRequest(session_id=session_id),
                                                      timeout=DEADLINE_S),
        "stage": lambda: wire.stage_stub.CloseSession(pb.stage.StageCloseSessionRequest(session_id=session_id),
                                                      timeout=DEADLINE_S),
    }


def _round_calls(wire, session_id: str) -> dict:
    pb = wire.pb
    return {
        "Verify": lambda: wire.verify(session_id, [5, 6]),
        "Step": lambda: wire.step(session_id, 2),
        "Fork": lambda: wire.fork(session_id, 1),
        "VerifyBatch": lambda: wire.verify_stub.VerifyBatch(pb.verify.VerifyBatchRequest(
            requests=[wire.verify_request(session_id, [5])]), timeout=DEADLINE_S),
        "Propose": lambda: wire.draft_stub.Propose(pb.draft.ProposeRequest(
            session_id=session_id, accepted_token_ids=[5], num_draft_tokens=2), timeout=DEADLINE_S),
        "VerifyAndExtend": lambda: wire.stage_stub.VerifyAndExtend(pb.stage.VerifyAndExtendRequest(
            session_id=session_id, accepted_token_ids=[5], num_extend_tokens=1), timeout=DEADLINE_S),
    }


def test_session_ids_are_server_made(wire):
    opened = _open_everywhere(wire)
    try:
        ids = [i for ids in opened.values() for i in ids]
        assert all(SESSION_ID.fullmatch(i) for i in ids), ids  # 128 bits as 32 hex characters
        assert len(set(ids)) == len(ids)
    finally:
        for service, ids in opened.items():
            for session_id in ids:
                assert _close_calls(wire, session_id)[service]().existed


@pytest.mark.parametrize("rpc", ["Verify", "Step", "Fork", "VerifyBatch", "Propose", "VerifyAndExtend"])
def test_made_up_id_is_not_found(wire, rpc):
    assert_code(grpc.StatusCode.NOT_FOUND, _round_calls(wire, secrets.token_hex(16))[rpc])


def test_closing_a_made_up_id(wire):
    for service, close in _close_calls(wire, secrets.token_hex(16)).items():
        assert not close().existed, service


@pytest.mark.parametrize("rpc", ["Verify", "Step", "Fork", "VerifyBatch", "Propose", "VerifyAndExtend",
                                 "CloseSession"])
def test_absurdly_long_id_is_invalid(wire, rpc):
    long_id = "a" * 10_000
    if rpc == "CloseSession":
        for close in _close_calls(wire, long_id).values():
            assert_code(grpc.StatusCode.INVALID_ARGUMENT, close)
    else:
        assert_code(grpc.StatusCode.INVALID_ARGUMENT, _round_calls(wire, long_id)[rpc])


def _kv_user(wire, service: str):
    """(GetInfo, open a session that holds KV for a prompt) on `service`. The Draft and Stage
    services prefill lazily, with the session's first call: the session makes that call."""
    pb = wire.pb
    if service == "verify":
        return wire.info, lambda prompt: wire.open(prompt, **GREEDY).session_id
    if service == "draft":
        def open_draft(prompt):
            session_id = wire.draft_stub.OpenSession(pb.draft.DraftOpenSessionRequest(
                prompt_token_ids=prompt), timeout=DEADLINE_S).session_id
            wire.draft_stub.Propose(pb.draft.ProposeRequest(session_id=session_id, accepted_token_ids=[5],
                                                            num_draft_tokens=2), timeout=DEADLINE_S)
            return session_id
        return lambda: wire.draft_stub.GetInfo(pb.draft.DraftGetInfoRequest(), timeout=DEADLINE_S), open_draft

    def open_stage(prompt):
        session_id = wire.stage_stub.OpenSession(pb.stage.StageOpenSessionRequest(
            prompt_token_ids=prompt), timeout=DEADLINE_S).session_id
        wire.stage_stub.VerifyAndExtend(pb.stage.VerifyAndExtendRequest(session_id=session_id, accepted_token_ids=[5],
                                                                        num_extend_tokens=1), timeout=DEADLINE_S)
        return session_id
    return lambda: wire.stage_stub.GetInfo(pb.stage.StageGetInfoRequest(), timeout=DEADLINE_S), open_stage


@pytest.mark.parametrize("service", ["verify", "draft", "stage"])
def test_get_info_reports_kv_usage(wire, service):
    """free_blocks drops while a session holds KV and comes back after CloseSession."""
    info, open_session = _kv_user(wire, service)
    kv = info().kv
    assert kv.block_size > 0 and kv.total_blocks > 0
    assert 0 < kv.free_blocks <= kv.total_blocks
    prompt = list(range(3, 3 + 3 * kv.block_size))  # three blocks' worth
    session_id = open_session(prompt)
    try:
        assert info().kv.free_blocks <= kv.free_blocks - 3
    finally:
        assert _close_calls(wire, session_id)[service]().existed
    assert info().kv.free_blocks == kv.free_blocks


def test_verify_batch_validates_every_item_before_applying_any(wire):
    n = 16
    expected, _ = wire.generate(PROMPT_B, **GREEDY, max_new_tokens=n)
    a = wire.open(PROMPT_B, **GREEDY, max_new_tokens=n)
    b = wire.open(PROMPT_A, **GREEDY, max_new_tokens=n)
    try:
        too_long = [b.first_token_id] * (wire.info().max_draft_tokens + 1)
        batch = wire.pb.verify.VerifyBatchRequest(requests=[
            wire.verify_request(a.session_id, [a.first_token_id] * 3), wire.verify_request(b.session_id, too_long)])
        assert_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: wire.verify_stub.VerifyBatch(batch, timeout=DEADLINE_S))
        loop = wire.verify_loop(a, repeat_last(3), round_index=True)  # A's next round is still its first
        assert loop.tokens == expected
    finally:
        wire.close(b.session_id)


def test_verify_batch(wire):
    sessions = [wire.open(prompt, **GREEDY, max_new_tokens=16) for prompt in (PROMPT_A, PROMPT_B)]
    try:
        batch = wire.pb.verify.VerifyBatchRequest(requests=[
            wire.verify_request(s.session_id, [s.first_token_id] * 2, round_index=0) for s in sessions])
        responses = wire.verify_stub.VerifyBatch(batch, timeout=DEADLINE_S).responses
        assert [r.session_id for r in responses] == [s.session_id for s in sessions]
        assert [r.status_code for r in responses] == [0, 0]
        assert all(len(r.accepted_token_ids) == r.num_accepted_tokens + 1 for r in responses)
    finally:
        for s in sessions:
            wire.close(s.session_id)


def test_verify_racing_close(wire):
    """Verify and CloseSession on one session at once: the round is answered or NOT_FOUND, never a
    server error, and the session is gone afterwards."""

    async def race(stub, attempt: int) -> list[grpc.StatusCode]:
        opened = await stub.OpenSession(wire.pb.verify.VerifyOpenSessionRequest(
            prompt_token_ids=PROMPT_A, sampling=wire.sampling(**GREEDY)), timeout=DEADLINE_S)
        verify = stub.Verify(wire.verify_request(opened.session_id, [opened.first_token_id] * 4), timeout=DEADLINE_S)
        close = stub.CloseSession(wire.pb.verify.VerifyCloseSessionRequest(session_id=opened.session_id),
                                  timeout=DEADLINE_S)
        calls = [verify, close] if attempt % 2 else [close, verify]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        codes = [o.code() if isinstance(o, grpc.aio.AioRpcError) else grpc.StatusCode.OK for o in outcomes]
        for outcome in outcomes:
            if isinstance(outcome, Exception) and not isinstance(outcome, grpc.aio.AioRpcError):
                raise outcome
        try:
            await stub.Verify(wire.verify_request(opened.session_id, [1]), timeout=DEADLINE_S)
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
        return codes if attempt % 2 else [codes[1], codes[0], codes[2]]  # [verify, close, after]

    async def main() -> list[list[grpc.StatusCode]]:
        async with grpc.aio.insecure_channel(wire.verify_address) as channel:
            stub = wire.pb.verify_grpc.VerifyServiceStub(channel)
            return [await race(stub, attempt) for attempt in range(20)]

    for verify, close, after in asyncio.run(asyncio.wait_for(main(), 60)):
        assert verify in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND), verify
        assert close == grpc.StatusCode.OK
        assert after == grpc.StatusCode.NOT_FOUND
