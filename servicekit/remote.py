"""gRPC adapters that let the async speculation driver use remote services.

    verifier = RemoteVerifier(verify_pb2_grpc.VerifyServiceStub(channel))
    drafter = RemoteDrafter(draft_pb2_grpc.DraftServiceStub(channel), q_dtype=torch.float16)
    async for event in speculative_stream_async(verifier, drafter, prompt_ids, params): ...

They implement `specmesh.decoding.async_driver.AsyncVerifier` / `AsyncDrafter`: conversion and
calls only, no speculation logic. q travels in the dtype the drafter stored it in (the values it
sampled from), dense or as its exact support. `WireCounters` counts messages' bytes per round.
Rounds carry their `round_index`, so a round whose answer was lost (deadline, connection drop) is
resent safely (`RETRIES` times): the service answers a resend without advancing the session twice.
For an encoder-decoder model (T5, BART, ...) an adapter is made per request with its
`encoder_input_ids`, sent with every OpenSession; prompts and rounds are then decoder tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from servicekit.convert import FINISH_FROM_PB, PB_BY_TORCH, distributions_from_pb, distributions_to_pb, sampling_to_pb, token_ids_from_pb
from specmesh.decoding.adaptive import ForwardCost
from specmesh.decoding.async_driver import TargetInfo
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.tree import tree_children
from specmesh.decoding.types import FinalTokenKind, VerifyOutcome
from specmesh.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc


@dataclass
class WireCounters:
    """Serialized bytes of every request and response, summed per round (a Propose + a Verify)."""

    bytes_per_round: list[int] = field(default_factory=list)
    _pending_bytes: int = 0

    def add(self, *messages) -> None:
        self._pending_bytes += sum(m.ByteSize() for m in messages)

    def end_round(self) -> None:
        self.bytes_per_round.append(self._pending_bytes)
        self._pending_bytes = 0


Metadata = Sequence[tuple[str, str]]  # per-call metadata, e.g. the end user a trusted caller acts for
RETRIES = 2  # resends of a round whose answer did not arrive
RETRY_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


async def call_round(method, request, timeout_s: float, metadata: Metadata = (), retries: int = RETRIES):
    """A unary round RPC, resent on a lost answer (the request carries its round_index)."""
    for attempt in range(retries + 1):
        try:
            return await method(request, timeout=timeout_s, metadata=metadata or None)
        except grpc.aio.AioRpcError as exc:
            if attempt == retries or exc.code() not in RETRY_CODES:
                raise


class RemoteVerifier:
    def __init__(self, stub: verify_pb2_grpc.VerifyServiceStub, *, timeout_s: float = 60.0, sparse_q: bool = False,
                 counters: WireCounters | None = None, metadata: Metadata = (), info: TargetInfo | None = None,
                 encoder_input_ids: Sequence[int] = (), stream_interval_ms: int = 0):
        self.stub = stub
        self.stream_interval_ms = stream_interval_ms  # a Run's messages: at most one per this many ms (0: per round)
        self.encoder_input_ids = list(encoder_input_ids)  # [num_encoder_tokens]; empty for decoder-only targets
        self.metadata = tuple(metadata) or None
        self.timeout_s = timeout_s
        self.sparse_q = sparse_q
        self.counters = counters or WireCounters()
        self._info = info  # known already (saves a GetInfo), or asked on first use
        self.step_ms: float | None = None  # this replica's one-token forward, as its last OpenSession reported
        self.forward_cost: ForwardCost | None = None  # its verify forwards' fit, as that OpenSession reported
        self._rounds: dict[str, int] = {}  # session -> rounds done
        self._forced: dict[str, list[int]] = {}  # session -> committed tokens its next Verify carries (lossy mode)
        self.target_kv: dict[str, common_pb2.TargetKv] = {}  # session -> its KV in the replica's shared cache, as last said

    async def info(self) -> TargetInfo:
        if self._info is None:
            model = (await self.stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=self.timeout_s, metadata=self.metadata)).model
            self._info = TargetInfo(model.vocab_size, model.max_context_tokens, tuple(model.eos_token_ids))
        return self._info

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[str, int]:
        response = await self.stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=list(prompt_ids), sampling=_token_level(params), encoder_input_ids=self.encoder_input_ids),
            timeout=self.timeout_s, metadata=self.metadata)
        self.step_ms = response.step_ms if response.HasField("step_ms") else None
        self.forward_cost = forward_cost_from_pb(response)
        self._heard_kv(response.session_id, response)
        return response.session_id, response.first_token_id

    def _heard_kv(self, session_id: str, response) -> None:
        """Keep what a VerifyResponse / VerifyOpenSessionResponse says of the session's shared KV (if anything)."""
        if response.HasField("target_kv"):
            self.target_kv[session_id] = response.target_kv

    def opened_ms_per_token(self, session_id: str) -> float | None:
        """`CostReporter`: the replica's one-token forward when the session opened."""
        return self.step_ms

    def opened_forward_cost(self, session_id: str) -> ForwardCost | None:
        """`ForwardCostReporter`: the replica's fit of its verify forwards when the session opened, at its recent batch size."""
        return self.forward_cost

    async def commit(self, session_id: str, token_ids: Sequence[int]) -> None:
        """Lossy, opt-in: tokens the caller emitted without verification (an adaptive cascade's early
        stop); the session's next Verify carries them as forced_token_ids (no RPC of their own)."""
        self._forced.setdefault(session_id, []).extend(int(t) for t in token_ids)

    async def verify(self, session_id: str, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        request = await self._verify_request(session_id, proposal)
        response = await call_round(self.stub.Verify, request, self.timeout_s, self.metadata or ())
        return self._verify_result(request, response, proposal)

    async def verify_batch(self, items: Sequence[tuple[str, DraftProposal]]
                           ) -> list[tuple[VerifyOutcome, FinishReason | None] | grpc.aio.AioRpcError]:
        """Several sessions' rounds in one VerifyBatch RPC (one forward on the service). Per item: its
        result, or the error the service answered for it alone, as the AioRpcError a Verify would have
        raised. A failure of the whole call raises (no item was applied, or a resend replays them)."""
        requests = [await self._verify_request(session_id, proposal) for session_id, proposal in items]
        batch = await call_round(self.stub.VerifyBatch, verify_pb2.VerifyBatchRequest(requests=requests), self.timeout_s,
                                 self.metadata or ())
        if len(batch.responses) != len(requests):
            raise ValueError(f"malformed VerifyBatchResponse: {len(batch.responses)} answers for {len(requests)} requests")
        results: list[tuple[VerifyOutcome, FinishReason | None] | grpc.aio.AioRpcError] = []
        for request, response, (_, proposal) in zip(requests, batch.responses, items):
            if response.status_code:
                code = next((c for c in grpc.StatusCode if c.value[0] == response.status_code), grpc.StatusCode.UNKNOWN)
                results.append(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), response.status_message))
            else:
                results.append(self._verify_result(request, response, proposal))
        return results

    async def _verify_request(self, session_id: str, proposal: DraftProposal) -> verify_pb2.VerifyRequest:
        if proposal.unverified:
            raise ValueError("an unverified chunk is committed (commit), never verified")
        request = verify_pb2.VerifyRequest(session_id=session_id, draft_token_ids=proposal.token_ids,
                                           deterministic_draft=proposal.q is None, round_index=self._rounds.get(session_id, 0),
                                           forced_token_ids=self._forced.pop(session_id, []))
        if proposal.parents is not None:
            request.tree_parents.extend(proposal.parents)
        if proposal.q is not None and proposal.num_tokens:
            vocab_size = (await self.info()).vocab_size
            request.distributions.CopyFrom(distributions_to_pb(proposal.q, proposal.q.dtype, self.sparse_q, vocab_size))
        return request

    def _verify_result(self, request: verify_pb2.VerifyRequest, response: verify_pb2.VerifyResponse,
                       proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        self._rounds[request.session_id] = response.round_index + 1
        self._heard_kv(request.session_id, response)
        self.counters.add(request, response)
        self.counters.end_round()
        return outcome_from_pb(response, proposal), FINISH_FROM_PB[response.finish_reason]

    async def step(self, session_id: str, k: int, fused_drafter: str = "") -> tuple[int, VerifyOutcome, FinishReason | None, float]:
        """One fused round (the Verify service drafts k tokens itself, with its hosted `fused_drafter`, "" = its
        default): (k drafted, outcome, finish, draft ms)."""
        request = verify_pb2.StepRequest(session_id=session_id, num_draft_tokens=k, round_index=self._rounds.get(session_id, 0),
                                         fused_drafter=fused_drafter)
        response = await call_round(self.stub.Step, request, self.timeout_s, self.metadata or ())
        self._rounds[session_id] = response.result.round_index + 1
        self._heard_kv(session_id, response.result)
        self.counters.add(request, response)
        self.counters.end_round()
        drafted = DraftProposal(token_ids=[0] * response.num_draft_tokens)  # a chain of that length, for the outcome
        return (response.num_draft_tokens, outcome_from_pb(response.result, drafted),
                FINISH_FROM_PB[response.result.finish_reason], response.draft_ms)

    async def run(self, session_id: str, *, draft: bool, k: int = 0, max_rounds: int = 0, deadline_s: float | None = None,
                  fused_drafter: str = "") -> AsyncIterator[tuple[int, VerifyOutcome, FinishReason | None, float]]:
        """Server-driven rounds (the Run RPC): per round as it lands, (k drafted, outcome, finish,
        draft ms); `max_rounds` > 0 ends the stream after that many, the session left open.
        `deadline_s` bounds the whole stream (None: the request's own has none); each round must
        land within this verifier's per-call timeout, else DEADLINE_EXCEEDED, as a unary round's
        would. Leaving the loop early cancels the call, which closes the session."""
        request = verify_pb2.RunRequest(session_id=session_id, draft=draft, num_draft_tokens=k, max_rounds=max_rounds,
                                        round_index=self._rounds.get(session_id, 0),
                                        stream_interval_ms=self.stream_interval_ms, fused_drafter=fused_drafter)
        call = self.stub.Run(request, timeout=deadline_s, metadata=self.metadata)
        self.counters.add(request)
        try:
            while True:
                try:  # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that lands
                    async with asyncio.timeout(self.timeout_s):  # as the read completes (the client left; rounds went on)
                        response = await call.read()
                except TimeoutError:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               f"no round of session {session_id} within {self.timeout_s} s") from None
                if response is grpc.aio.EOF:
                    return
                self.counters.add(response)
                for round_ in (response, *response.later_rounds):  # later_rounds: with stream_interval_ms
                    self._rounds[session_id] = round_.result.round_index + 1
                    self._heard_kv(session_id, round_.result)
                    self.counters.end_round()
                    drafted = DraftProposal(token_ids=[0] * round_.num_draft_tokens)  # a chain of that length, for the outcome
                    yield (round_.num_draft_tokens, outcome_from_pb(round_.result, drafted),
                           FINISH_FROM_PB[round_.result.finish_reason], round_.draft_ms)
        finally:
            call.cancel()  # no-op once the stream has ended

    async def close(self, session_id: str) -> None:
        self._rounds.pop(session_id, None)
        self.target_kv.pop(session_id, None)
        self._forced.pop(session_id, None)
        await _close_quietly(self.stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=session_id),
                                                    timeout=self.timeout_s, metadata=self.metadata))


@dataclass
class RemoteDraftSession:
    session_id: str
    needs_q: bool  # standard sampling: the verifier needs the draft distributions (`SamplingParams.needs_q`)
    rounds: list[int] = field(default_factory=lambda: [0])  # Propose calls answered (mutable cell)
    ms_per_token: float | None = None  # a draft token's cost on the service: at open, then as its last Propose answer said
    drafts_ahead: bool = False  # the service drafts each next round while the last one is verified


class RemoteDrafter:
    def __init__(self, stub: draft_pb2_grpc.DraftServiceStub, *, q_dtype: torch.dtype = torch.float32,
                 sparse_q: bool = False, timeout_s: float = 60.0, counters: WireCounters | None = None,
                 metadata: Metadata = (), encoder_input_ids: Sequence[int] = ()):
        if q_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"q travels as float32, float16 or bfloat16, not {q_dtype}")
        self.stub = stub
        self.q_dtype = q_dtype
        self.metadata = tuple(metadata) or None
        self.sparse_q = sparse_q
        self.timeout_s = timeout_s
        self.counters = counters or WireCounters()
        self.encoder_input_ids = list(encoder_input_ids)  # [num_encoder_tokens]; empty for decoder-only models
        self._vocab_size: int | None = None

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> RemoteDraftSession:
        if self._vocab_size is None:
            info = await self.stub.GetInfo(draft_pb2.DraftGetInfoRequest(), timeout=self.timeout_s, metadata=self.metadata)
            self._vocab_size = info.model.vocab_size
        response = await self.stub.OpenSession(draft_pb2.DraftOpenSessionRequest(
            prompt_token_ids=list(prompt_ids), sampling=_token_level(params), encoder_input_ids=self.encoder_input_ids),
            timeout=self.timeout_s, metadata=self.metadata)
        return RemoteDraftSession(response.session_id, needs_q=params.needs_q,
                                  ms_per_token=response.ms_per_token if response.HasField("ms_per_token") else None,
                                  drafts_ahead=response.drafts_ahead)

    def opened_ms_per_token(self, session: RemoteDraftSession) -> float | None:
        """`CostReporter`: what a draft token cost on the service when the session opened."""
        return session.ms_per_token

    def opened_drafting_ahead(self, session: RemoteDraftSession) -> bool:
        """`CostReporter`: whether the service drafts this session's next round while its last one is verified."""
        return session.drafts_ahead

    async def propose(self, session: RemoteDraftSession, accepted_since_last: Sequence[int], max_tokens: int,
                      target_kv: common_pb2.TargetKv | None = None) -> DraftProposal:
        """`target_kv`: the target session's KV as the Verify service last said (`RemoteVerifier.target_kv`): a Draft
        service on its host may copy the context it was not fed from there (specmesh/kv/shared.py)."""
        request = draft_pb2.ProposeRequest(
            session_id=session.session_id, accepted_token_ids=list(accepted_since_last), num_draft_tokens=max_tokens,
            return_distributions=session.needs_q, sparse_distributions=self.sparse_q,
            distributions_dtype=PB_BY_TORCH[self.q_dtype], round_index=session.rounds[0], target_kv=target_kv)
        response = await call_round(self.stub.Propose, request, self.timeout_s, self.metadata or ())
        session.rounds[0] = response.round_index + 1
        if response.HasField("ms_per_token"):
            session.ms_per_token = response.ms_per_token  # the service's cost now (`CostReporter` of later sessions)
        self.counters.add(request, response)
        token_ids = token_ids_from_pb(response.draft_token_ids, self._vocab_size, "draft_token_ids")
        q = None
        if response.HasField("distributions"):
            q = distributions_from_pb(response.distributions, len(token_ids), self._vocab_size)
        acceptance = response.first_token_acceptance if response.HasField("first_token_acceptance") else None
        if acceptance is not None and not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"first_token_acceptance {acceptance} is not a probability")
        ahead_ms = response.ahead_forward_ms if response.HasField("ahead_forward_ms") else None
        return DraftProposal(token_ids=token_ids, q=q, parents=list(response.tree_parents) or None, acceptance=acceptance,
                             ahead_forward_ms=ahead_ms)

    async def close(self, session: RemoteDraftSession) -> None:
        await _close_quietly(self.stub.CloseSession(draft_pb2.DraftCloseSessionRequest(session_id=session.session_id),
                                                    timeout=self.timeout_s, metadata=self.metadata))


def outcome_from_pb(response: verify_pb2.VerifyResponse, proposal: DraftProposal) -> VerifyOutcome:
    """The VerifyOutcome a VerifyResponse reports for `proposal`."""
    tokens = list(response.accepted_token_ids)
    num_accepted = response.num_accepted_tokens
    if len(tokens) != num_accepted + 1:
        raise ValueError(f"malformed VerifyResponse: {len(tokens)} tokens for {num_accepted} accepted")
    if proposal.is_tree:
        nodes = list(response.accepted_tree_nodes)
        leaf_row = nodes[-1] + 1 if nodes else 0
        bonus = not tree_children(proposal.parents)[leaf_row]
    else:
        nodes = list(range(num_accepted))
        bonus = num_accepted == proposal.num_tokens
    return VerifyOutcome(nodes, tokens[:num_accepted], tokens[num_accepted],
                         FinalTokenKind.BONUS if bonus else FinalTokenKind.RECOVERED, cost=forward_cost_from_pb(response))


def forward_cost_from_pb(response) -> ForwardCost | None:
    """The Verify service's fit of its forwards as a VerifyResponse or VerifyOpenSessionResponse carries it, or None."""
    if response.HasField("forward_fixed_ms") and response.HasField("forward_ms_per_token"):
        return ForwardCost(response.forward_fixed_ms, response.forward_ms_per_token, max(1, response.batch_size))
    return None


def _token_level(params: SamplingParams):
    """The params a service gets: stop strings stay with the driver, which decodes text (the
    services work on token ids and refuse them)."""
    return sampling_to_pb(dataclasses.replace(params, stop=[]) if params.stop else params)


async def _close_quietly(call) -> None:
    try:
        await call
    except grpc.aio.AioRpcError:
        pass  # the session already expired or the service went away: nothing left to free
