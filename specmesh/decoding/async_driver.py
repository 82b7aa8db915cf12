"""The asyncio driver of the speculation round, over drafters and verifiers that live elsewhere.

    async for event in speculative_stream_async(verifier, drafter, prompt_ids, params, plan=plan):
        ...                                   # the same StepEvents as the in-process loop

`plan` (`specmesh.decoding.plan.Plan`; by default client rounds, drafted or plain) says where the draft comes from and
who steps the rounds; one small driver per shape below (`_client_rounds`, `_fused_steps`,
`_server_rounds`), each stepping the one `SpeculationState`.

`verifier` / `drafter` are anything with the `AsyncVerifier` / `AsyncDrafter` methods: gRPC
adapters for the Verify and Draft services (`servicekit.remote`), or in-process objects in tests.
The round (k, finish rules, stats) is `specmesh.decoding.state`, stepped exactly as the in-process
driver steps it, so for the same models and seed both yield the same tokens. The request's seed is
resolved here (its acceptance rule pinned first, `resolve_seed`) and sent to both sides; each derives
its generator from it (the drafter's through `draft_seed`), as in-process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from specmesh.decoding.adaptive import AdaptiveK, FixedK, ForwardCost, KPolicy
from specmesh.decoding.plan import Plan
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, resolve_seed
from specmesh.decoding.state import FinishReason, SpeculationState, StepEvent
from specmesh.decoding.types import VerifyOutcome


@dataclass(frozen=True)
class TargetInfo:
    """What the driver needs to know of the target model."""

    vocab_size: int
    max_context: int  # tokens
    eos_token_ids: tuple[int, ...]


class AsyncVerifier(Protocol):
    async def info(self) -> TargetInfo: ...

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[Any, int]:
        """Prefill; returns (session handle, the target's first token). `params.seed` is set."""
        ...

    async def verify(self, session: Any, proposal: DraftProposal) -> tuple[VerifyOutcome, FinishReason | None]:
        """One round; returns the outcome and the verifier's own finish verdict (None: not finished
        or not known), which must agree with the driver's."""
        ...

    async def commit(self, session: Any, token_ids: Sequence[int]) -> None:
        """Take tokens without judging them (a lossy cascade's unverified chunk, opt-in): the next
        `verify` feeds them before its draft."""
        ...

    async def close(self, session: Any) -> None: ...


class AsyncStepper(AsyncVerifier, Protocol):
    """A verifier that also drafts (fused mode: the Verify service hosts the drafter)."""

    async def step(self, session: Any, k: int) -> tuple[int, VerifyOutcome, FinishReason | None, float]:
        """Draft k tokens and verify them in one call: (tokens drafted, outcome, finish verdict, draft ms)."""
        ...


class AsyncRunner(AsyncVerifier, Protocol):
    """A verifier that can step a session's rounds itself and stream them (server-driven rounds)."""

    def run(self, session: Any, *, draft: bool, k: int = 0, max_rounds: int = 0
            ) -> AsyncIterator[tuple[int, VerifyOutcome, FinishReason | None, float]]:
        """Rounds until the session finishes (or `max_rounds` of them, the session left open), each
        as it lands: (tokens drafted, outcome, finish verdict, draft ms); `draft`: with the verifier's
        own drafter (k fixed, or 0 for its policy's)."""
        ...


class AsyncDrafter(Protocol):
    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> Any: ...

    async def propose(self, state: Any, accepted_since_last: Sequence[int], max_tokens: int) -> DraftProposal: ...

    async def close(self, state: Any) -> None: ...


@runtime_checkable
class CostReporter(Protocol):
    """Optional, on either side: what its session said, when it opened, a token costs there (ms; None:
    not known yet). The drafter's draft token and the verifier's one-token step stand in as the
    adaptive k policy's prior costs (`AdaptiveK.prior_costs`) before rounds measure them, as the
    in-process loop's engines do, so a drafter that cannot pay is not run for a first round."""

    def opened_ms_per_token(self, session: Any) -> float | None: ...


@runtime_checkable
class ForwardCostReporter(Protocol):
    """Optional, on the verifier: its fit of its verify forwards when the session opened (None: not known
    yet), at the batch the session will likely share. The adaptive k policy's prior beta, as the in-process
    loop's verifier gives it (`TargetVerifier.forward_cost`): without it a first round prices a draft token at
    beta 0.1, where a CPU's verify forward grows 15-17% a token alone, and far more in a batch of 16."""

    def opened_forward_cost(self, session: Any) -> ForwardCost | None: ...


@runtime_checkable
class AheadReporter(Protocol):
    """Optional, on the drafter: whether it drafts the session's next round while the last one is verified
    (a Draft service with `draft_ahead`). The adaptive k policy then prices a round by what that hides
    (`AdaptiveK.set_drafting_ahead`) from the first round on; each proposal then says what a forward costs
    (`DraftProposal.ahead_forward_ms`)."""

    def opened_drafting_ahead(self, session: Any) -> bool: ...


async def speculative_stream_async(
    verifier: AsyncVerifier,
    drafter: AsyncDrafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    plan: Plan | None = None,
    k_policy: KPolicy | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> AsyncIterator[StepEvent]:
    """Speculative decoding with remote parts, run as `plan` (`specmesh.decoding.plan`; None:
    CLIENT_ROUNDS with a drafter, PLAIN_ROUNDS without). The plans that draft here (`Plan.drafts_here`)
    take the `drafter`; the others take None: the verifier is an `AsyncStepper`
    (FUSED_STEP), or an `AsyncRunner` that steps the rounds itself and streams them (FUSED_RUN,
    SERVER_RUN: no round waits for a round trip to this driver; the state folds them in as they land
    and stops the stream at its own finish, e.g. a stop string; k is then the verifier's policy's
    unless `k_policy` is a `FixedK`). CLIENT_ROUNDS_PLAIN_RUNS, CASCADE_PLAIN_RUNS: the verifier is an `AsyncRunner`,
    and a round with nothing to verify and the plain stretch it starts
    (`SpeculationState.plain_rounds_from_here`) are handed to it in one `run`. The final event's
    stats name the plan."""
    plan = plan or (Plan.CLIENT_ROUNDS if drafter is not None else Plan.PLAIN_ROUNDS)
    _check_plan(plan, drafter)
    info = await verifier.info()
    params = resolve_seed(params)  # the rule pinned, then the seed drawn if missing: both sides get both
    seed = params.seed
    assert seed is not None  # resolved
    state = SpeculationState(
        params, num_prompt_tokens=len(prompt_ids), max_context=info.max_context, eos_token_ids=info.eos_token_ids,
        k_policy=k_policy, has_drafter=drafter is not None or plan.fused, decode=decode, prompt_ids=prompt_ids, seed=seed,
        vocab_size=info.vocab_size, plain_stretches=plan.plain_runs,
    )
    state.stats.plan = plan.value
    start = time.perf_counter()
    # the drafter's session opens beside the verifier's (a Draft service drafting ahead prefills it then)
    draft_opening = asyncio.ensure_future(drafter.open(prompt_ids, params)) if drafter is not None else None
    try:
        session, first_token_id = await verifier.open(prompt_ids, params)
    except BaseException:
        await _discard_opening(drafter, draft_opening)
        raise
    draft_state = None
    try:
        yield state.start(first_token_id, (time.perf_counter() - start) * 1e3)
        if state.finished:
            return
        if plan.server_steps:
            fixed_k = k_policy.k if isinstance(k_policy, FixedK) else 0
            rounds = _server_rounds(verifier, session, state, draft=plan.fused, k=fixed_k)
        elif plan is Plan.FUSED_STEP:
            rounds = _fused_steps(verifier, session, state)
        else:
            if drafter is not None:
                assert draft_opening is not None
                draft_state = await draft_opening
                _prior_costs(state, verifier, session, drafter, draft_state)
            rounds = _client_rounds(verifier, session, state, drafter, draft_state,
                                    plain_runs=plan.plain_runs)
        async with aclosing(rounds):
            async for event in rounds:  # (closed at once when this stream is: the call is cancelled)
                yield event
        if not state.finished:
            raise RuntimeError("the verifier's rounds ended before the session finished")
    finally:
        await verifier.close(session)
        if drafter is not None and draft_state is not None:
            await drafter.close(draft_state)
        elif draft_opening is not None:  # not taken (finished at the first token, or a failure)
            await _discard_opening(drafter, draft_opening)


async def _discard_opening(drafter: Any, opening: asyncio.Future | None) -> None:
    """A drafter's session opened beside the verifier's and not used: the open cancelled, or its session
    closed; an open that failed is dropped (the request fails, or ends, for its own reason)."""
    if opening is None:
        return
    opening.cancel()
    outcomes: tuple[Any, ...] = await asyncio.gather(opening, return_exceptions=True)
    if not isinstance(outcomes[0], BaseException):  # else cancelled, or failed: nothing opened
        await drafter.close(outcomes[0])


def _prior_costs(state: SpeculationState, verifier: Any, session: Any, drafter: Any, draft_state: Any) -> None:
    """Both sides' `CostReporter` figures, if both have them, as the adaptive policy's prior."""
    if isinstance(state.k_policy, AdaptiveK) and isinstance(verifier, CostReporter) and isinstance(drafter, CostReporter):
        forward_cost = verifier.opened_forward_cost(session) if isinstance(verifier, ForwardCostReporter) else None
        if isinstance(drafter, AheadReporter) and drafter.opened_drafting_ahead(draft_state):
            state.k_policy.set_drafting_ahead(True)  # first: the first k is priced as drafted ahead
        state.prior_costs(drafter.opened_ms_per_token(draft_state), verifier.opened_ms_per_token(session),
                          forward_cost=forward_cost)


def _check_plan(plan: Plan, drafter: AsyncDrafter | None) -> None:
    if plan is Plan.SKELETON:
        raise ValueError("a Skeleton-of-Thought plan runs its streams through specmesh.skeleton, each with its own plan")
    if plan.drafts_here and drafter is None:
        raise ValueError(f"plan {plan.value} drafts here: pass a drafter")
    if not plan.drafts_here and drafter is not None:
        raise ValueError(f"plan {plan.value} drafts on the verifier, or not at all: pass no drafter")


async def _client_rounds(verifier: Any, session: Any, state: SpeculationState, drafter: AsyncDrafter | None,
                         draft_state: Any, *, plain_runs: bool) -> AsyncGenerator[StepEvent, None]:
    """Rounds stepped here: the draft sub-step with the drafter beside this driver (or none), then a
    Verify call; with `plain_runs`, a plain stretch goes to the verifier's Run in one call."""
    while not state.finished:
        k = state.next_k()
        proposal, draft_ms, step = DraftProposal(token_ids=[]), 0.0, state.draft_step(k)
        if step.asks:
            assert drafter is not None  # has_drafter
            start = time.perf_counter()
            drafted = await drafter.propose(draft_state, step.new_tokens, k)
            draft_ms = (time.perf_counter() - start) * 1e3
            if isinstance(state.k_policy, AdaptiveK) and (state.k_policy.drafts_ahead or drafted.ahead_forward_ms is not None):
                state.k_policy.set_drafting_ahead(drafted.ahead_forward_ms is not None, drafted.ahead_forward_ms)  # off: a failover
            # the drafter's figure after these forwards
            proposal = step.take(drafted, drafter.opened_ms_per_token(draft_state) if isinstance(drafter, CostReporter) else None)
        if proposal.unverified:  # lossy, opt-in: an adaptive cascade stopped below the target
            await verifier.commit(session, proposal.token_ids)  # the next Verify carries them (forced_token_ids)
            yield state.record_unverified(proposal.token_ids, draft_ms)
            continue
        plain = state.plain_rounds_from_here() if plain_runs and not proposal.num_tokens else 1
        if plain > 1:  # this plain round and the stretch it starts: one Run
            async with aclosing(_plain_rounds(verifier, session, state, plain, draft_ms)) as rounds:
                async for event in rounds:
                    yield event
            continue
        start = time.perf_counter()
        outcome, their_finish = await verifier.verify(session, proposal)
        verify_ms = (time.perf_counter() - start) * 1e3
        event = state.record(proposal.num_tokens, outcome.num_accepted, outcome.token_ids, draft_ms, verify_ms,
                             outcome.cost)
        _check_agreement(state, their_finish)
        yield event


async def _fused_steps(verifier: Any, session: Any, state: SpeculationState) -> AsyncGenerator[StepEvent, None]:
    """Rounds stepped here, each one Step: the verifier drafts k (its hosted drafter) and verifies;
    a round at k = 0 is a plain Verify."""
    while not state.finished:
        k = state.next_k()
        start = time.perf_counter()
        if k:
            num_drafted, outcome, their_finish, draft_ms = await verifier.step(session, k)
        else:
            (outcome, their_finish), num_drafted, draft_ms = await verifier.verify(session, DraftProposal([])), 0, 0.0
        verify_ms = (time.perf_counter() - start) * 1e3 - draft_ms
        event = state.record(num_drafted, outcome.num_accepted, outcome.token_ids, draft_ms, verify_ms, outcome.cost)
        _check_agreement(state, their_finish)
        yield event


async def _server_rounds(verifier: Any, session: Any, state: SpeculationState, *, draft: bool, k: int = 0,
                         max_rounds: int = 0, asked_ms: float = 0.0) -> AsyncGenerator[StepEvent, None]:
    """The verifier's own rounds (`AsyncRunner.run`), folded into the state as they land; stops at
    the state's finish (a stop string the verifier does not know), which cancels the stream.
    `asked_ms`: time this driver spent asking its drafter for the first round (which drafted nothing)."""
    rounds = verifier.run(session, draft=draft, k=k, max_rounds=max_rounds)
    try:
        start = time.perf_counter()
        async for num_drafted, outcome, their_finish, draft_ms in rounds:
            now = time.perf_counter()  # a round's verify time: since the last one landed, less its drafting
            event = state.record(num_drafted, outcome.num_accepted, outcome.token_ids, draft_ms + asked_ms,
                                 (now - start) * 1e3 - draft_ms, outcome.cost)
            start, asked_ms = now, 0.0
            _check_agreement(state, their_finish)
            yield event
            if state.finished:
                break
    finally:
        await rounds.aclose()


async def _plain_rounds(verifier: Any, session: Any, state: SpeculationState, num_rounds: int,
                        asked_ms: float = 0.0) -> AsyncGenerator[StepEvent, None]:
    """`num_rounds` plain rounds stepped by the verifier (one bounded `run`); at least one must land."""
    landed = 0
    async with aclosing(_server_rounds(verifier, session, state, draft=False, max_rounds=num_rounds,
                                       asked_ms=asked_ms)) as rounds:
        async for event in rounds:
            landed += 1
            yield event
    if not landed:
        raise RuntimeError("the verifier's rounds ended before the session finished")


def _check_agreement(state: SpeculationState, their_finish: FinishReason | None) -> None:
    if their_finish is not None and not state.finished:
        raise RuntimeError(f"the verifier finished the session ({their_finish.value}) before the driver did: "
                           "their sampling params or model limits differ")


async def generate_async(
    verifier: AsyncVerifier,
    drafter: AsyncDrafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    **kwargs,
) -> list[StepEvent]:
    """`speculative_stream_async`, collected into its events."""
    return [event async for event in speculative_stream_async(verifier, drafter, prompt_ids, params, **kwargs)]
