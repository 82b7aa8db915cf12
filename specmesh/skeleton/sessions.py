"""The sessions a Skeleton-of-Thought answer decodes on, over the async driver's verifier protocols.

What the answer needs from its transport (`SkeletonLinks`: the Coordinator's gRPC adapters, or
in-process objects in a test), each a fresh object per stream:
- `plan_verifier(fmt, num_forced_tokens)`: an `AsyncVerifier` whose sessions decode under the plan
  grammar (the first `num_forced_tokens` generated positions are the forced prefix, already in
  the prompt);
- `branch_verifier()`: a `ForkVerifier`, whose session may start as a child of the plan's session;
- `verifier()` (a direct answer), `drafter()` (None: target only), `k_policy()` (None: adaptive).

Two wrappers put the answer's own rules on top:
- `KeptSession` (the plan): the stream's `close` keeps the session open so that branches can fork
  from it; `release` closes it. It records every token the session holds (`session_ids`).
- `BranchSession` (a branch): `open` forks the plan's session when the branch prompt extends
  some of its tokens, else (or when the fork is `ForkUnavailable`) prefills; each `verify` first
  waits at the `RoundGate` for the siblings' rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from specmesh.decoding.adaptive import KPolicy
from specmesh.decoding.async_driver import AsyncDrafter, AsyncVerifier, TargetInfo
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import FinishReason
from specmesh.decoding.types import VerifyOutcome
from specmesh.skeleton.automaton import SkeletonFormat
from specmesh.skeleton.rounds import RoundGate


class ForkUnavailable(Exception):
    """The parent session cannot be forked any more (its replica died, it expired): prefill instead."""


class ForkVerifier(AsyncVerifier, Protocol):
    async def fork(self, parent: Any, num_shared_tokens: int, prompt_ids: Sequence[int],
                   params: SamplingParams) -> tuple[Any, int]:
        """Open a session for `prompt_ids` as a child of the open session `parent`, sharing its first
        `num_shared_tokens` tokens (0 < num_shared_tokens < len(prompt_ids); the rest is appended):
        (session, first token), as `open` returns. Raises `ForkUnavailable` when it cannot."""
        ...


class SkeletonLinks(Protocol):
    def plan_verifier(self, fmt: SkeletonFormat, num_forced_tokens: int) -> AsyncVerifier: ...

    def branch_verifier(self) -> ForkVerifier: ...

    def verifier(self) -> AsyncVerifier: ...

    def drafter(self) -> AsyncDrafter | None: ...

    def k_policy(self) -> KPolicy | None: ...


class KeptSession:
    """The plan's verifier: an `AsyncVerifier` whose `close` keeps the session (`kept`) for forks."""

    def __init__(self, inner: AsyncVerifier):
        self.inner = inner
        self.kept: Any | None = None  # the plan's session once its stream ended, until `release`
        self._prompt_ids: list[int] = []
        self._emitted: list[int] = []  # every token the target emitted into the session

    @property
    def session_ids(self) -> list[int]:
        """Every token the session holds: prompt, plan, EOS, and any token emitted after it."""
        return [*self._prompt_ids, *self._emitted]

    async def info(self) -> TargetInfo:
        return await self.inner.info()

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[Any, int]:
        session, first = await self.inner.open(prompt_ids, params)
        self._prompt_ids, self._emitted = list(prompt_ids), [first]
        return session, first

    async def verify(self, session: Any, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        outcome, finish = await self.inner.verify(session, proposal)
        self._emitted.extend(outcome.token_ids)
        return outcome, finish

    async def commit(self, session: Any, token_ids: Sequence[int]) -> None:
        await self.inner.commit(session, token_ids)
        self._emitted.extend(token_ids)

    async def close(self, session: Any) -> None:
        self.kept = session

    async def release(self) -> None:
        """Close the kept session (idempotent)."""
        if self.kept is not None:
            session, self.kept = self.kept, None
            await self.inner.close(session)


class BranchSession:
    """A branch's verifier (module docstring). It joins `gate` as `member` when made; `leave` when
    its rounds are over, so the siblings stop waiting for it."""

    def __init__(self, inner: ForkVerifier, parent: Any | None, num_shared_tokens: int, gate: RoundGate,
                 member: int):
        self.inner = inner
        self.parent = parent  # the plan's kept session (None: released, or never opened)
        self.num_shared_tokens = num_shared_tokens
        self.gate, self.member = gate, member
        self.prefilled = False  # opened with a full prefill instead of a fork
        self.opened = False  # the open (fork or prefill) is over, however it went
        gate.join(member)

    def leave(self) -> None:
        self.gate.leave(self.member)

    async def info(self) -> TargetInfo:
        return await self.inner.info()

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[Any, int]:
        try:
            if self.parent is not None and 0 < self.num_shared_tokens < len(prompt_ids):
                try:
                    return await self.inner.fork(self.parent, self.num_shared_tokens, prompt_ids, params)
                except ForkUnavailable:
                    pass
            self.prefilled = True
            return await self.inner.open(prompt_ids, params)
        finally:
            self.opened = True

    async def verify(self, session: Any, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        await self.gate.arrive(self.member)
        return await self.inner.verify(session, proposal)

    async def commit(self, session: Any, token_ids: Sequence[int]) -> None:
        await self.inner.commit(session, token_ids)

    async def close(self, session: Any) -> None:
        await self.inner.close(session)
