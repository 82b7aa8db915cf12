"""Sessions belong to the principal that opened them (a Verify service with --auth-token-file):
another principal's id answers as a made-up id would, and calls without a known token are
UNAUTHENTICATED."""

from __future__ import annotations

import secrets

import grpc
import pytest
from contract_helpers import AUTH_TOKENS, DEADLINE_S, GREEDY, PROMPT_A, assert_code, rpc_error

NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def _as(name: str | None, token: str | None = None) -> list[tuple[str, str]]:
    token = token or (AUTH_TOKENS[name] if name else None)
    return [("authorization", f"Bearer {token}")] if token else []


@pytest.fixture
def auth(pb, auth_address):
    with grpc.insecure_channel(auth_address) as channel:
        yield pb.verify_grpc.VerifyServiceStub(channel)


def _calls(pb, stub, session_id: str, metadata) -> dict:
    v = pb.verify
    kw = dict(timeout=DEADLINE_S, metadata=metadata)
    return {
        "Verify": lambda: stub.Verify(v.VerifyRequest(session_id=session_id, draft_token_ids=[5]), **kw),
        "Step": lambda: stub.Step(v.StepRequest(session_id=session_id, num_draft_tokens=2), **kw),
        "Fork": lambda: stub.Fork(v.ForkRequest(session_id=session_id, num_children=1), **kw),
        "VerifyBatch": lambda: stub.VerifyBatch(v.VerifyBatchRequest(requests=[
            v.VerifyRequest(session_id=session_id, draft_token_ids=[5])]), **kw),
        "CloseSession": lambda: stub.CloseSession(v.VerifyCloseSessionRequest(session_id=session_id), **kw),
    }


def _open(pb, stub, metadata):
    return stub.OpenSession(pb.verify.VerifyOpenSessionRequest(
        prompt_token_ids=PROMPT_A, sampling=pb.common.SamplingParams(**GREEDY, max_new_tokens=50)),
        timeout=DEADLINE_S, metadata=metadata)


def _answer(call):
    """What a call answers, as a comparable value: its status code, or its response."""
    try:
        return call()
    except grpc.RpcError as exc:
        return exc.code()


def test_another_principals_session_is_not_found(pb, auth):
    alice = _open(pb, auth, _as("alice"))
    made_up = _calls(pb, auth, secrets.token_hex(16), _as("bob"))
    bobs = _calls(pb, auth, alice.session_id, _as("bob"))
    try:
        for rpc in ("Verify", "Step", "Fork", "VerifyBatch"):
            assert_code(NOT_FOUND, bobs[rpc])
        assert _answer(bobs["CloseSession"]) == _answer(made_up["CloseSession"])  # indistinguishable
        alices = _calls(pb, auth, alice.session_id, _as("alice"))
        assert len(alices["Verify"]().accepted_token_ids) >= 1  # bob changed nothing
    finally:
        assert _calls(pb, auth, alice.session_id, _as("alice"))["CloseSession"]().existed


@pytest.mark.parametrize("token", [None, "not-a-known-token"])
def test_unknown_callers_are_unauthenticated(pb, auth, token):
    metadata = _as(None, token)
    assert_code(UNAUTHENTICATED, lambda: _open(pb, auth, metadata))
    alice = _open(pb, auth, _as("alice"))
    try:
        for rpc, call in _calls(pb, auth, alice.session_id, metadata).items():
            assert rpc_error(call).code() == UNAUTHENTICATED, rpc
    finally:
        _calls(pb, auth, alice.session_id, _as("alice"))["CloseSession"]()
