"""A specmesh client built only from stubs generated from the .proto files (see conftest.py).

    wire.generate(prompt, temperature=0, max_new_tokens=20)  -> (token ids, finish reason)
    opened = wire.open(prompt, temperature=0, max_new_tokens=20)
    loop = wire.verify_loop(opened, repeat_last(4))          # Verify rounds until finish_reason
    assert_code(grpc.StatusCode.NOT_FOUND, lambda: wire.verify("0" * 32, [1]))

A loop's output is what the protocol says a client sees: the first token of OpenSession, then each
round's accepted_token_ids (accepted draft tokens + the target's own token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

DEADLINE_S = 10.0  # every RPC of the suite carries this deadline
MAX_ROUNDS = 600  # a loop that never finishes fails instead of hanging
PROMPT_A = [5, 17, 33, 5, 17, 33, 5, 17]  # repetitive: the n-gram drafter finds matches
PROMPT_B = [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3]
GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)
SAMPLED: dict[str, Any] = dict(temperature=1.0, ignore_eos=True)
AUTH_TOKENS = {"alice": "token-of-alice", "bob": "token-of-bob"}  # the auth service's principals

DraftFn = Callable[[list[int]], list[int]]  # tokens so far -> draft tokens for the next round


def repeat_last(k: int) -> DraftFn:
    """A deterministic drafter: the last token, k times."""
    return lambda tokens: [tokens[-1]] * k


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    """The RpcError `call` raises (a streaming call must be consumed inside it, e.g. list(...))."""
    try:
        result = call()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"expected an RPC error, the call answered {result!r:.300}")


def assert_code(code: grpc.StatusCode, call: Callable[[], Any]) -> grpc.RpcError:
    exc = rpc_error(call)
    assert exc.code() == code, f"expected {code.name}, got {exc.code().name}: {exc.details()}"
    return exc


@dataclass
class Loop:
    """What a client saw of one session: its tokens, how it ended, every round's response."""

    session_id: str
    tokens: list[int]  # first_token_id, then each round's accepted_token_ids
    finish_reason: int = 0
    responses: list = field(default_factory=list)  # VerifyResponse per round


class Wire:
    """Stubs on the suite's services. `addresses` maps "verify" / "draft" / "stage" to a callable
    giving the address once that service is ready: a test waits only for the services it uses."""

    def __init__(self, pb, addresses: dict[str, Callable[[], str]]):
        self.pb = pb
        self.addresses = addresses
        self.channels: dict[str, grpc.Channel] = {}
        self.verify_address = addresses["verify"]()
        self.verify_stub = pb.verify_grpc.VerifyServiceStub(self.channel("verify"))
        model = self.info().model
        self.vocab_size = model.vocab_size
        self.max_context = model.max_context_tokens
        self.eos_token_ids = list(model.eos_token_ids)

    def channel(self, service: str) -> grpc.Channel:
        if service not in self.channels:
            self.channels[service] = grpc.insecure_channel(self.addresses[service]())
        return self.channels[service]

    @property
    def draft_stub(self):
        return self.pb.draft_grpc.DraftServiceStub(self.channel("draft"))

    @property
    def stage_stub(self):
        return self.pb.stage_grpc.StageServiceStub(self.channel("stage"))

    def close_channels(self) -> None:
        for channel in self.channels.values():
            channel.close()

    # Verify service
    def sampling(self, **fields):
        return self.pb.common.SamplingParams(**fields)

    def info(self):
        return self.verify_stub.GetInfo(self.pb.verify.VerifyGetInfoRequest(), timeout=DEADLINE_S)

    def open(self, prompt: Sequence[int], **sampling):
        return self.verify_stub.OpenSession(self.pb.verify.VerifyOpenSessionRequest(
            prompt_token_ids=list(prompt), sampling=self.sampling(**sampling)), timeout=DEADLINE_S)

    def close(self, session_id: str) -> bool:
        request = self.pb.verify.VerifyCloseSessionRequest(session_id=session_id)
        return self.verify_stub.CloseSession(request, timeout=DEADLINE_S).existed

    def generate(self, prompt: Sequence[int], **sampling) -> tuple[list[int], int]:
        """Verify.Generate: (every streamed token, the last message's finish_reason)."""
        request = self.pb.verify.VerifyGenerateRequest(prompt_token_ids=list(prompt), sampling=self.sampling(**sampling))
        tokens: list[int] = []
        finish = 0
        for message in self.verify_stub.Generate(request, timeout=DEADLINE_S):
            tokens += message.token_ids
            finish = message.finish_reason or finish
        return tokens, finish

    def verify_request(self, session_id: str, draft: Sequence[int] = (), **fields):
        return self.pb.verify.VerifyRequest(session_id=session_id, draft_token_ids=list(draft), **fields)

    def verify(self, session_id: str, draft: Sequence[int] = (), **fields):
        return self.verify_stub.Verify(self.verify_request(session_id, draft, **fields), timeout=DEADLINE_S)

    def step(self, session_id: str, k: int, **fields):
        request = self.pb.verify.StepRequest(session_id=session_id, num_draft_tokens=k, **fields)
        return self.verify_stub.Step(request, timeout=DEADLINE_S)

    def fork(self, session_id: str, num_children: int, **fields):
        request = self.pb.verify.ForkRequest(session_id=session_id, num_children=num_children, **fields)
        return self.verify_stub.Fork(request, timeout=DEADLINE_S)

    def free_blocks(self) -> int:
        return self.info().kv.free_blocks

    # loops
    def verify_loop(self, opened, draft_fn: DraftFn = repeat_last(4), *, round_index: bool = False,
                    resend: bool = False, close: bool = True, first_round: int = 0, **fields) -> Loop:
        """Verify rounds on an opened session until one reports finish_reason. `round_index` numbers
        the rounds (from `first_round`: the rounds the session has done); `resend` sends every round
        twice and checks the resend's answer is the first's."""
        loop = Loop(opened.session_id, [opened.first_token_id])
        try:
            for index in range(first_round, first_round + MAX_ROUNDS):
                extra = dict(round_index=index) if round_index or resend else {}
                request = self.verify_request(opened.session_id, draft_fn(loop.tokens), **extra, **fields)
                response = self.verify_stub.Verify(request, timeout=DEADLINE_S)
                if resend:
                    again = self.verify_stub.Verify(request, timeout=DEADLINE_S)
                    assert again == response, f"round {index} resent: {again} != {response}"
                assert response.round_index == index
                loop.tokens += response.accepted_token_ids
                loop.responses.append(response)
                if response.finish_reason:
                    loop.finish_reason = response.finish_reason
                    return loop
            raise AssertionError(f"no finish_reason after {MAX_ROUNDS} rounds")
        finally:
            if close:
                self.close(opened.session_id)

    def step_loop(self, opened, k: int = 4, *, resend: bool = False, close: bool = True) -> Loop:
        """Step rounds (the service's fused drafter) until one reports finish_reason."""
        loop = Loop(opened.session_id, [opened.first_token_id])
        try:
            for index in range(MAX_ROUNDS):
                extra = dict(round_index=index) if resend else {}
                request = self.pb.verify.StepRequest(session_id=opened.session_id, num_draft_tokens=k, **extra)
                response = self.verify_stub.Step(request, timeout=DEADLINE_S)
                if resend:
                    again = self.verify_stub.Step(request, timeout=DEADLINE_S)
                    assert again == response, f"step {index} resent: {again} != {response}"
                assert response.result.round_index == index
                loop.tokens += response.result.accepted_token_ids
                loop.responses.append(response.result)
                if response.result.finish_reason:
                    loop.finish_reason = response.result.finish_reason
                    return loop
            raise AssertionError(f"no finish_reason after {MAX_ROUNDS} steps")
        finally:
            if close:
                self.close(opened.session_id)

    def draft_loop(self, prompt: Sequence[int], k: int = 4, *, resend: bool = False, **sampling) -> Loop:
        """Greedy speculation across the Draft and Verify services: Propose k, Verify, tell the
        drafter what was accepted. `resend` sends every Propose twice (with round_index)."""
        propose_request = self.pb.draft.ProposeRequest
        draft = self.draft_stub.OpenSession(self.pb.draft.DraftOpenSessionRequest(
            prompt_token_ids=list(prompt), sampling=self.sampling(**sampling)), timeout=DEADLINE_S)
        opened = self.open(prompt, **sampling)
        accepted = [opened.first_token_id]
        rounds = 0

        def propose(tokens: list[int]) -> list[int]:
            nonlocal accepted, rounds
            extra = dict(round_index=rounds) if resend else {}
            request = propose_request(session_id=draft.session_id, accepted_token_ids=accepted, num_draft_tokens=k, **extra)
            response = self.draft_stub.Propose(request, timeout=DEADLINE_S)
            if resend:
                again = self.draft_stub.Propose(request, timeout=DEADLINE_S)
                assert again == response, f"Propose {rounds} resent: {again} != {response}"
            assert response.round_index == rounds
            rounds += 1
            return list(response.draft_token_ids)

        try:
            loop = Loop(opened.session_id, [opened.first_token_id])
            for _ in range(MAX_ROUNDS):
                response = self.verify(opened.session_id, propose(loop.tokens))
                accepted = list(response.accepted_token_ids)
                loop.tokens += accepted
                loop.responses.append(response)
                if response.finish_reason:
                    loop.finish_reason = response.finish_reason
                    return loop
            raise AssertionError(f"no finish_reason after {MAX_ROUNDS} rounds")
        finally:
            self.close(opened.session_id)
            self.draft_stub.CloseSession(self.pb.draft.DraftCloseSessionRequest(session_id=draft.session_id),
                                         timeout=DEADLINE_S)

