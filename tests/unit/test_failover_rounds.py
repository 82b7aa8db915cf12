"""FailoverVerifier.run over a Verify replica that dies mid-stream: a bounded stream of rounds
(`max_rounds`) re-opens the session and asks the new replica only for the rounds still owed; a
replica that dies after the last owed round landed (before its stream ended) has lost nothing, so
the rounds end there and no stream is asked for a negative count."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.driver import Calls, Failovers, FailoverVerifier, VerifyHandle
from specmesh.decoding.types import FinalTokenKind, VerifyOutcome


def _outcome(token: int) -> VerifyOutcome:
    return VerifyOutcome(accepted_nodes=[], accepted_token_ids=[], final_token_id=token, final_kind=FinalTokenKind.BONUS)


class DyingRemote:
    """Streams `rounds_before_death` rounds, then fails as a killed process does (UNAVAILABLE)."""

    def __init__(self, rounds_before_death: int | None):
        self.rounds_before_death = rounds_before_death
        self.asked: list[int] = []  # max_rounds of every run call

    async def run(self, session_id, *, draft, k, max_rounds, deadline_s, fused_drafter=""):
        if max_rounds < 0:
            raise ValueError(f"Value out of range: {max_rounds}")  # what the protobuf field says
        self.asked.append(max_rounds)
        for i in range(max_rounds):
            if self.rounds_before_death is not None and i == self.rounds_before_death:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "killed")
            yield 0, _outcome(100 + i), None, 0.0
        if self.rounds_before_death is not None and self.rounds_before_death >= max_rounds:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "killed")


class Reopening(FailoverVerifier):
    """Re-opens on `healthy` (a fresh remote) and records it, without a pool."""

    def __init__(self, healthy: DyingRemote):
        super().__init__(pool=None, info=None, calls=Calls(timeout_s=5), failovers=Failovers())
        self.healthy = healthy
        self.reopened = 0

    async def _reopen(self, handle: VerifyHandle) -> VerifyOutcome:
        self.reopened += 1
        handle.remote = self.healthy
        handle.emitted.append(7)
        return _outcome(7)


def _run(verifier: Reopening, handle: VerifyHandle, max_rounds: int) -> list[int]:
    async def collect() -> list[int]:
        return [outcome.final_token_id async for _, outcome, _, _ in verifier.run(handle, draft=False, max_rounds=max_rounds)]

    return asyncio.run(collect())


@pytest.mark.parametrize("max_rounds", [1, 3])
def test_a_replica_dying_after_the_last_owed_round_ends_the_rounds(max_rounds):
    healthy = DyingRemote(None)
    verifier = Reopening(healthy)
    handle = VerifyHandle(replica=None, remote=DyingRemote(max_rounds), session_id="s", emitted=[1])
    assert _run(verifier, handle, max_rounds) == [100 + i for i in range(max_rounds)]
    assert verifier.reopened == 0 and healthy.asked == []  # the next call on the handle fails over
    assert handle.emitted == [1, *(100 + i for i in range(max_rounds))]


def test_a_replica_dying_mid_stream_owes_the_rest_on_the_new_one():
    healthy = DyingRemote(None)
    verifier = Reopening(healthy)
    handle = VerifyHandle(replica=None, remote=DyingRemote(1), session_id="s", emitted=[1])
    assert _run(verifier, handle, 4) == [100, 7, 100, 101]  # the re-open's first token is one of the 4
    assert verifier.reopened == 1 and healthy.asked == [2]
    assert handle.emitted == [1, 100, 7, 100, 101]


def test_an_unbounded_stream_goes_on_after_a_failover():
    healthy = DyingRemote(None)
    verifier = Reopening(healthy)
    handle = VerifyHandle(replica=None, remote=DyingRemote(0), session_id="s", emitted=[1])
    assert _run(verifier, handle, 0) == [7]  # the fake's unbounded stream is empty: the round in flight ends it
    assert verifier.reopened == 1 and healthy.asked == [0]
