"""How a Skeleton-of-Thought answer (`specmesh.skeleton.answer`) reaches the Verify and Draft services:
`Links` is its `SkeletonLinks`, over the failover wrappers of `coordinator.driver`.

- `PlanVerifier` opens the plan's session with a `SkeletonConstraint` (the service masks every target
  row with the plan grammar; a failover re-open counts the plan written so far as forced).
- `BranchVerifier.fork` forks the plan's session with Verify.Fork (`num_prefix_tokens` shared, the rest
  appended, the request's BranchLayout); a fork that cannot happen (the plan's replica died, its
  session expired) is `ForkUnavailable`, so the branch prefills on a healthy replica. Forks of
  branches launched together leave as one Fork RPC, and the rounds the `RoundGate` releases as one
  VerifyBatch RPC per replica (`coordinator.siblings`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.driver import Calls, DraftCosts, FailoverDrafter, Failovers, FailoverVerifier, VerifyHandle, replica_failed
from coordinator.pools import ServicePool
from coordinator.siblings import SiblingCalls
from servicekit.convert import sampling_to_pb
from servicekit.remote import RemoteVerifier
from specmesh.decoding.adaptive import KPolicy
from specmesh.decoding.async_driver import TargetInfo
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.types import VerifyOutcome
from specmesh.proto.v1 import common_pb2, verify_pb2
from specmesh.skeleton.automaton import SkeletonFormat
from specmesh.skeleton.sessions import ForkUnavailable


@dataclass
class Links:
    """How one request reaches the services (made by the servicer per request)."""

    verify: ServicePool
    draft: ServicePool
    info: TargetInfo
    calls: Calls
    failovers: Failovers
    drafter_kind: str  # "service" (the Draft service), "ngram" (in the coordinator) or "none" (target only)
    q_dtype: Any  # torch dtype of q on the wire
    sparse_q: bool
    k_policy: Callable[[], KPolicy | None]  # a fresh policy per stream (None: adaptive)
    drafters: list[FailoverDrafter] = field(default_factory=list)  # every drafter made, for the stats
    draft_costs: DraftCosts | None = None  # the coordinator's (FailoverDrafter: Draft sessions opened when first drafting)
    layout: int = common_pb2.BRANCH_LAYOUT_BATCHING  # how the Verify service lays out forked branches (BranchLayout)
    siblings: SiblingCalls = field(default_factory=SiblingCalls)  # the branches' Forks and rounds, grouped per turn

    def drafter(self) -> FailoverDrafter | None:
        if self.drafter_kind == "none":
            return None
        drafter = FailoverDrafter(self.draft, self.calls, self.failovers, use_service=self.drafter_kind == "service",
                                  q_dtype=self.q_dtype, sparse_q=self.sparse_q, costs=self.draft_costs)
        self.drafters.append(drafter)
        return drafter

    @property
    def drafter_names(self) -> str:
        """The drafters that finished the streams, e.g. "draft-service" or "draft-service,ngram"."""
        return ",".join(sorted({d.current for d in self.drafters}))

    def verifier(self) -> FailoverVerifier:
        return FailoverVerifier(self.verify, self.info, self.calls, self.failovers, sparse_q=self.sparse_q)

    def plan_verifier(self, fmt: SkeletonFormat, num_forced_tokens: int) -> PlanVerifier:
        return PlanVerifier(self, fmt, num_forced_tokens)

    def branch_verifier(self) -> BranchVerifier:
        return BranchVerifier(self)


class PlanVerifier(FailoverVerifier):
    """The plan's Verify session, opened with the plan grammar."""

    def __init__(self, links: Links, fmt: SkeletonFormat, num_forced_tokens: int):
        super().__init__(links.verify, links.info, links.calls, links.failovers, sparse_q=links.sparse_q)
        self.fmt = fmt
        self.num_forced_tokens = num_forced_tokens

    async def _open_on(self, remote: RemoteVerifier, prompt: list[int], params: SamplingParams) -> tuple[str, int]:
        # a re-opened session's prompt ends with the tokens emitted so far: plan output too
        num_forced = self.num_forced_tokens + len(prompt) - len(self._prompt)
        constraint = verify_pb2.SkeletonConstraint(
            max_points=self.fmt.max_points, max_title_bytes=self.fmt.max_title_bytes, max_est_digits=self.fmt.max_est_digits,
            max_direct_bytes=self.fmt.max_direct_bytes, num_forced_tokens=num_forced)
        response = await remote.stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(
            prompt_token_ids=prompt, sampling=token_level(params), skeleton=constraint),
            timeout=remote.timeout_s, metadata=remote.metadata)
        return response.session_id, response.first_token_id


class BranchVerifier(FailoverVerifier):
    """A branch's Verify session (a `ForkVerifier`): its fork and its rounds go out through
    `links.siblings`, with those of the siblings in the same turn."""

    def __init__(self, links: Links):
        super().__init__(links.verify, links.info, links.calls, links.failovers, sparse_q=links.sparse_q)
        self.layout = links.layout
        self.siblings = links.siblings

    async def _send_verify(self, handle: VerifyHandle, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        return await self.siblings.verify(handle.remote, handle.session_id, proposal)

    async def fork(self, parent: VerifyHandle, num_shared_tokens: int, prompt_ids: Sequence[int],
                   params: SamplingParams) -> tuple[VerifyHandle, int]:
        self._prompt, self._params = list(prompt_ids), params  # what a failover re-opens
        try:  # a child whose caller is gone is closed (`coordinator.siblings`)
            child_id, first = await self.siblings.fork(parent.remote, parent.session_id, num_shared_tokens,
                                                       self._prompt[num_shared_tokens:], token_level(params), self.layout,
                                                       self.calls.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if not replica_failed(exc):
                raise
            self.failovers.add(f"fork on verify {parent.replica.id} failed ({exc.code().name}) -> prefill")
            raise ForkUnavailable(exc.code().name) from exc
        self.pool.replicas.start(parent.replica)
        return VerifyHandle(parent.replica, parent.remote, child_id, [first]), first


def token_level(params: SamplingParams) -> common_pb2.SamplingParams:
    """Params as a Verify session takes them: stop strings stay with the driver, which decodes text."""
    return sampling_to_pb(dataclasses.replace(params, stop=[]))


def describe_error(exc: BaseException) -> str:
    """A branch's in-band error text."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
