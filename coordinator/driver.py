"""One request's session with the services, and how it survives their failures.

The round is `specmesh.decoding.state`, stepped by `specmesh.decoding.async_driver`; this module
supplies the verifier and drafter it steps, as failover wrappers over the gRPC adapters of
`servicekit.remote`:

- `FailoverVerifier` opens the session on a Verify replica the router picks (`ServicePool`). If that
  replica dies mid-request (UNAVAILABLE, the session lost, ...), the session is re-opened on another
  from the prompt and every token emitted so far: the new replica's first token is the round's final
  token (the round's draft is dropped, as if all of it were rejected), so the stream goes on with
  no token repeated or lost. The new session gets the tokens left of max_new_tokens and, with the
  standard rule, a seed derived from the request's (a fresh stream: re-reading the first one would
  correlate positions); with the coupled rule the request's own seed, whose noise is a function of
  the position only, so the new replica goes on with exactly the tokens the first would have sampled.
  No replica left: `NoHealthyReplica`, answered UNAVAILABLE.
- `FailoverDrafter` drafts on a Draft replica; if it fails, the request goes on with prompt-lookup
  n-gram drafts made here, from the whole context (exact: a deterministic draft). Both say so in
  `failovers`, which the final stats report. A request that finds no Draft replica up drafts n-grams
  from the start: nothing moved, so no failover (its stats' drafter says "ngram").
  It opens the Draft session when the request first drafts, not with the request, once a Draft
  session has said what a draft token costs (`DraftCosts`: the k policy's prior without a session
  of its own). A request whose adaptive k starts at plain decoding and never probes (under load, or a
  drafter that cannot pay) then costs the Draft replica nothing: no OpenSession, no CloseSession, no
  engine job to take its cores from a Verify service that borrows them. Opened late, the session gets
  the same prompt and, with its first Propose, every token since: what it would have been told had it
  opened first (a model drafter prefills lazily anyway; its generator is seeded at open), so the
  drafts are the same. `DraftCosts` follows the cost each Propose answer reports, so the next
  request's prior is what an OpenSession would say then.
  Nor is a call sent that asks for no draft tokens while the session owes no verdict (a request's last
  round after plain decoding, k capped at 0): its tokens go with the next call, if any. Sent, it made a
  model drafter prefill the whole context for nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import torch

from coordinator.pools import ServicePool
from servicekit.remote import Metadata, RemoteDrafter, RemoteDraftSession, RemoteVerifier
from specmesh.decoding.adaptive import ForwardCost
from specmesh.decoding.async_driver import TargetInfo
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.types import FinalTokenKind, VerifyOutcome
from specmesh.drafters.ngram import PromptLookupDrafter, PromptLookupIndex
from specmesh.proto.v1 import common_pb2, draft_pb2_grpc, verify_pb2_grpc
from specmesh.routing.replica import NoHealthyReplica, Replica

log = logging.getLogger("specmesh.coordinator")
T = TypeVar("T")
_BACKGROUND: set[asyncio.Future] = set()  # closes of sessions whose request went away

# codes that indict the replica (or lose the session on it), not the request
REPLICA_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
})
FAILOVER_SEED_STRIDE = 0x9E3779B97F4A7C15  # a new stream per failover: seed + n * stride (mod 2**63)


async def open_or_close_later(opening: Awaitable[T], close: Callable[[T], Awaitable[None]]) -> T:
    """Await a session open; if the request is cancelled meanwhile, let the open finish and close
    the session it made (else the service would keep it, and count it in quotas, until its TTL)."""
    task = asyncio.ensure_future(opening)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def close_when_opened(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                closing = asyncio.ensure_future(close(done.result()))
                _BACKGROUND.add(closing)
                closing.add_done_callback(_BACKGROUND.discard)

        task.add_done_callback(close_when_opened)
        raise


def replica_failed(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in REPLICA_FAILURES


@dataclass
class Failovers:
    """What replaced what during one request (reported in its stats)."""

    events: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        log.warning("failover: %s", what)
        self.events.append(what)


@dataclass
class Calls:
    """How a request calls the services: per-call deadline and metadata (the end user it acts for)."""

    timeout_s: float
    metadata: Metadata = ()
    deadline_at: float | None = None  # time.monotonic() at which the request's own deadline passes (None: it has none)

    def remaining_s(self) -> float | None:
        """What is left of the request's deadline: it bounds a whole stream of rounds."""
        return None if self.deadline_at is None else max(0.001, self.deadline_at - time.monotonic())


@dataclass
class VerifyHandle:
    replica: Replica
    remote: RemoteVerifier
    session_id: str
    emitted: list[int]  # every token the target emitted for this request (the pending one last)
    opened_s: float = field(default_factory=time.perf_counter)


class FailoverVerifier:
    """An `AsyncStepper` over the Verify replicas of `pool` (module docstring)."""

    def __init__(self, pool: ServicePool, info: TargetInfo, calls: Calls, failovers: Failovers, sparse_q: bool = False,
                 encoder_input_ids: Sequence[int] = (), stream_interval_ms: int = 0, fused_drafter: str = ""):
        self.pool = pool
        self.stream_interval_ms = stream_interval_ms  # a Run's messages: at most one per this many ms (0: per round)
        self.fused_drafter = fused_drafter  # which hosted drafter fused rounds draft with ("": the replica's default)
        self._info = info
        self.encoder_input_ids = list(encoder_input_ids)  # an encoder-decoder target's input (every replica opened gets it)
        self.calls = calls
        self.failovers = failovers
        self.sparse_q = sparse_q
        self._prompt: list[int] = []
        self._params: SamplingParams | None = None
        self.handle: VerifyHandle | None = None  # the request's session (a failover moves it to another replica)

    async def info(self) -> TargetInfo:
        return self._info

    def target_kv(self) -> common_pb2.TargetKv | None:
        """Where the session's KV lies in its replica's shared cache, as the replica last said (None: it shares none)."""
        handle = self.handle
        return handle.remote.target_kv.get(handle.session_id) if handle is not None else None

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[VerifyHandle, int]:
        self._prompt, self._params = list(prompt_ids), params
        replica, remote, session_id, first = await self._open_somewhere(self._prompt, params)
        self.handle = VerifyHandle(replica, remote, session_id, [first])
        return self.handle, first

    def opened_ms_per_token(self, handle: VerifyHandle) -> float | None:
        """`CostReporter`: the one-token forward of the replica the session is on, as it reported."""
        return handle.remote.opened_ms_per_token(handle.session_id)

    def opened_forward_cost(self, handle: VerifyHandle) -> ForwardCost | None:
        """`ForwardCostReporter`: that replica's fit of its verify forwards, at its recent batch size."""
        return handle.remote.opened_forward_cost(handle.session_id)

    async def verify(self, handle: VerifyHandle, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        try:
            outcome, finish = await self._send_verify(handle, proposal)
        except grpc.aio.AioRpcError as exc:
            if not replica_failed(exc):
                raise
            return await self._reopen(handle), None
        handle.emitted.extend(outcome.token_ids)
        return outcome, finish

    async def _send_verify(self, handle: VerifyHandle, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        """The round's RPC (a branch of a skeleton answer sends it with its siblings' instead)."""
        return await handle.remote.verify(handle.session_id, proposal)

    async def step(self, handle: VerifyHandle, k: int) -> tuple[int, VerifyOutcome, FinishReason | None, float]:
        try:
            num_drafted, outcome, finish, draft_ms = await handle.remote.step(handle.session_id, k, self.fused_drafter)
        except grpc.aio.AioRpcError as exc:
            if not replica_failed(exc):
                raise
            return k, await self._reopen(handle), None, 0.0
        handle.emitted.extend(outcome.token_ids)
        return num_drafted, outcome, finish, draft_ms

    async def run(self, handle: VerifyHandle, *, draft: bool, k: int = 0, max_rounds: int = 0
                  ) -> AsyncIterator[tuple[int, VerifyOutcome, FinishReason | None, float]]:
        """Server-driven rounds (`AsyncRunner`). If the replica fails mid-stream, the session is
        re-opened elsewhere as in `verify` (its first token ends the round in flight, and counts as
        one of `max_rounds`) and the rounds go on there. A replica that fails after the last of
        `max_rounds` landed (before its stream ended) has lost nothing: the rounds end, and the
        caller's next call on the handle fails over."""
        left = max_rounds
        while True:
            rounds = handle.remote.run(handle.session_id, draft=draft, k=k, max_rounds=left,
                                       deadline_s=self.calls.remaining_s(), fused_drafter=self.fused_drafter if draft else "")
            try:
                async for num_drafted, outcome, finish, draft_ms in rounds:
                    handle.emitted.extend(outcome.token_ids)
                    left -= 1 if max_rounds else 0
                    yield num_drafted, outcome, finish, draft_ms
                return
            except grpc.aio.AioRpcError as exc:
                if not replica_failed(exc):
                    raise
                if max_rounds and not left:
                    return
                reopened = await self._reopen(handle)
            finally:
                await rounds.aclose()
            yield 0, reopened, None, 0.0
            if max_rounds:
                left -= 1
                if not left:
                    return

    async def commit(self, handle: VerifyHandle, token_ids: Sequence[int]) -> None:
        """A lossy cascade's unverified chunk: sent with the next Verify (a re-open includes it)."""
        await handle.remote.commit(handle.session_id, token_ids)
        handle.emitted.extend(token_ids)

    async def close(self, handle: VerifyHandle) -> None:
        await handle.remote.close(handle.session_id)
        self.pool.release(handle.replica, time.perf_counter() - handle.opened_s, len(handle.emitted))

    async def _reopen(self, handle: VerifyHandle) -> VerifyOutcome:
        """The session's replica failed: the same sequence on another one; its first token ends the round."""
        assert self._params is not None
        failed = handle.replica
        self.pool.fail(failed)
        seed = self._params.seed if self._params.is_coupled else (  # coupled: stateless noise, the same seed
            ((self._params.seed or 0) + (len(self.failovers.events) + 1) * FAILOVER_SEED_STRIDE) % 2**63)
        params = dataclasses.replace(self._params, max_new_tokens=self._params.max_new_tokens - len(handle.emitted),
                                     seed=seed)
        replica, remote, session_id, first = await self._open_somewhere([*self._prompt, *handle.emitted], params)
        self.failovers.add(f"verify {failed.id} -> {replica.id}")
        handle.replica, handle.remote, handle.session_id = replica, remote, session_id
        handle.emitted.append(first)
        return VerifyOutcome(accepted_nodes=[], accepted_token_ids=[], final_token_id=first,
                             final_kind=FinalTokenKind.RECOVERED)

    async def _open_on(self, remote: RemoteVerifier, prompt: list[int], params: SamplingParams) -> tuple[str, int]:
        """OpenSession on one replica: (session id, first token); a subclass may open differently."""
        return await remote.open(prompt, params)

    async def _open_somewhere(self, prompt: list[int], params: SamplingParams) -> tuple[Replica, RemoteVerifier, str, int]:
        """Open on the router's choice, moving on past replicas that fail; NoHealthyReplica at the end."""
        while True:
            replica = self.pool.acquire()
            remote = RemoteVerifier(verify_pb2_grpc.VerifyServiceStub(self.pool.channel(replica)), timeout_s=self.calls.timeout_s,
                                    sparse_q=self.sparse_q, metadata=self.calls.metadata, info=self._info,
                                    encoder_input_ids=self.encoder_input_ids, stream_interval_ms=self.stream_interval_ms)
            try:
                session_id, first = await open_or_close_later(self._open_on(remote, prompt, params),
                                                              lambda opened: remote.close(opened[0]))  # noqa: B023
                return replica, remote, session_id, first
            except grpc.aio.AioRpcError as exc:
                if not replica_failed(exc):
                    self.pool.replicas.release(replica)
                    raise
                self.pool.fail(replica)
            except BaseException:
                self.pool.replicas.release(replica)
                raise


@dataclass
class DraftCosts:
    """What the Draft replicas said last, at an OpenSession or in a Propose answer (module docstring): a
    draft token's cost (ms; None until a session opened) and whether they draft ahead. Shared by the
    requests of one Coordinator."""

    ms_per_token: float | None = None
    drafts_ahead: bool = False

    def heard(self, session: RemoteDraftSession) -> None:
        self.ms_per_token, self.drafts_ahead = session.ms_per_token, session.drafts_ahead


@dataclass
class DraftHandle:
    context: list[int]  # the prompt and every token accepted since (what a local drafter needs)
    params: SamplingParams
    replica: Replica | None = None
    remote: RemoteDrafter | None = None
    remote_session: RemoteDraftSession | None = None
    local: PromptLookupIndex | None = None
    opened_s: float = field(default_factory=time.perf_counter)
    num_prompt_tokens: int = 0
    deferred: bool = False  # the Draft session opens with the first Propose (module docstring)
    held: list[int] = field(default_factory=list)  # tokens of calls not sent (module docstring): the next one's
    last_drafted: int = 0  # tokens the Draft session's last proposal drafted (its verdict must come next)


class FailoverDrafter:
    """An `AsyncDrafter`: the Draft replicas of `pool` when `use_service`, else (or once they fail)
    prompt-lookup n-grams drafted here."""

    def __init__(self, pool: ServicePool | None, calls: Calls, failovers: Failovers, *, use_service: bool,
                 q_dtype: torch.dtype = torch.float32, sparse_q: bool = False,
                 ngram: Callable[[], PromptLookupDrafter] = PromptLookupDrafter, encoder_input_ids: Sequence[int] = (),
                 costs: DraftCosts | None = None, target_kv: Callable[[], common_pb2.TargetKv | None] | None = None):
        """`target_kv`: the request's target session's KV in a shared cache (`FailoverVerifier.target_kv`), handed to
        each Propose: a Draft replica on the Verify replica's host copies the context from there."""
        self.pool = pool if use_service else None
        self.target_kv = target_kv
        self.costs = costs  # None: every request opens its Draft session with the request
        self.encoder_input_ids = list(encoder_input_ids)  # an encoder-decoder pair's input (n-grams draft without it)
        self.calls = calls
        self.failovers = failovers
        self.q_dtype = q_dtype
        self.sparse_q = sparse_q
        self.ngram = ngram()
        self.current = "draft-service" if self.pool else "ngram"  # the drafter drafting now (for the stats)

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftHandle:
        handle = DraftHandle(list(prompt_ids), params, num_prompt_tokens=len(prompt_ids))
        if not self.pool:
            return handle
        costs = self.costs
        if costs is not None and costs.ms_per_token is not None and not costs.drafts_ahead and not self.encoder_input_ids:
            handle.deferred = True  # a drafting-ahead replica starts at open; an encoder input is sent at open
            return handle
        await self._open_remote(handle)
        return handle

    async def _open_remote(self, handle: DraftHandle) -> None:
        """The request's session on a Draft replica (its prompt: the context's first tokens); none up: n-grams."""
        handle.deferred = False
        prompt_ids = handle.context[:handle.num_prompt_tokens]
        params = handle.params
        handle.opened_s = time.perf_counter()
        assert self.pool  # (open defers only with a pool)
        try:
            handle.replica = self.pool.acquire()
        except NoHealthyReplica:  # no Draft replica up: this request drafts n-grams from the start, no failover of its own
            log.debug("no healthy draft replica: n-gram drafts from the start")
            self.current = "ngram"
            return
        handle.remote = RemoteDrafter(draft_pb2_grpc.DraftServiceStub(self.pool.channel(handle.replica)), q_dtype=self.q_dtype,
                                      sparse_q=self.sparse_q, timeout_s=self.calls.timeout_s, metadata=self.calls.metadata,
                                      encoder_input_ids=self.encoder_input_ids)
        remote = handle.remote
        try:
            handle.remote_session = await open_or_close_later(remote.open(prompt_ids, params), remote.close)
        except grpc.aio.AioRpcError as exc:
            if not replica_failed(exc):
                self._drop_remote(handle, failed=False)
                raise
            self._fall_back(handle)
            return
        if self.costs is not None:
            self.costs.heard(handle.remote_session)

    def opened_ms_per_token(self, handle: DraftHandle) -> float | None:
        """`CostReporter`: a draft token's cost on the Draft replica, as it reported (a deferred session: as the
        replicas said last, `DraftCosts`; n-grams: not known)."""
        if handle.deferred:
            return self.costs.ms_per_token if self.costs is not None else None
        return handle.remote_session.ms_per_token if handle.remote_session is not None else None

    def opened_drafting_ahead(self, handle: DraftHandle) -> bool:
        """`AheadReporter`: whether the Draft replica drafts the session's next round while its last is verified."""
        return handle.remote_session is not None and handle.remote_session.drafts_ahead

    async def propose(self, handle: DraftHandle, accepted_since_last: Sequence[int], max_tokens: int) -> DraftProposal:
        handle.context.extend(accepted_since_last)
        told = [*handle.held, *accepted_since_last]  # what the Draft session is told with this call
        if (handle.deferred or handle.remote_session is not None) and not max_tokens and not handle.last_drafted:
            handle.held = told  # nothing to draft and no verdict owed (a request's last round): not sent
            return DraftProposal(token_ids=[])
        if handle.deferred:
            await self._open_remote(handle)  # opened with the prompt: `told` is every token since
        if handle.remote is not None and handle.remote_session is not None:
            try:
                target_kv = self.target_kv() if self.target_kv is not None else None
                proposal = await handle.remote.propose(handle.remote_session, told, max_tokens, target_kv)
                handle.held, handle.last_drafted = [], proposal.num_tokens
                if self.costs is not None:
                    self.costs.heard(handle.remote_session)  # its cost now, as the answer said
                return proposal
            except grpc.aio.AioRpcError as exc:
                if not replica_failed(exc):
                    raise
                self._fall_back(handle)
        if handle.local is None:
            handle.local = self.ngram.open(handle.context)
            return self.ngram.propose(handle.local, [], max_tokens, handle.params, None)  # type: ignore[arg-type]
        return self.ngram.propose(handle.local, accepted_since_last, max_tokens, handle.params, None)  # type: ignore[arg-type]

    async def close(self, handle: DraftHandle) -> None:
        if handle.remote is not None and handle.remote_session is not None:
            await handle.remote.close(handle.remote_session)
        if handle.replica is not None and self.pool:
            self.pool.release(handle.replica, time.perf_counter() - handle.opened_s, len(handle.context))

    def _fall_back(self, handle: DraftHandle) -> None:
        failed = handle.replica
        self._drop_remote(handle, failed=True)
        self.failovers.add(f"draft {failed.id if failed else '?'} -> ngram")
        self.current = "ngram"

    def _drop_remote(self, handle: DraftHandle, failed: bool) -> None:
        if handle.replica is not None and self.pool:
            if failed:
                self.pool.fail(handle.replica)
            else:
                self.pool.replicas.release(handle.replica)
        handle.replica, handle.remote, handle.remote_session = None, None, None
