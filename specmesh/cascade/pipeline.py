"""The lossless cascade as a drafter: base drafter -> stage 1 -> ... -> stage S, verified by the target.

    drafter = CascadeDrafter(PromptLookupDrafter(), [StageModel(mid_engine)], [StageSpec(num_extend_tokens=1)])
    result = generate(TargetVerifier(target_engine), drafter, prompt_ids, params)   # = target-only output

The target's round (`specmesh.decoding.state`) is unchanged: the cascade is one more `Drafter`, so
every driver steps it as it steps any drafter. `CascadeDrafter` runs in-process (a `Drafter` over a
base `Drafter` and in-process `Stage`s such as `StageModel`); `AsyncCascadeDrafter` is the same round
as an `AsyncDrafter` over an async base drafter and `AsyncStage`s (a Stage service through
`servicekit.remote_stage.RemoteStage`), for the Coordinator. What each level drafts, the caps, which
q goes up and how the base drafter is told what the target confirmed is `specmesh.cascade.plan`; the
two classes here only make the calls.

Adaptive (lossy, opt-in): given an `AdaptiveStopper`, both decide after each stage whether to stop
there (`specmesh.cascade.chunk_stopping`); a stopped chunk comes back as an `unverified` proposal,
which the driver commits without the target's verification. lam = inf (the default when no lambda
is given and the stopper's own is inf) gives exactly the lossless pipeline's tokens.

    drafter = CascadeDrafter(None, [StageModel(int8_engine)], [StageSpec(4)], stopper=stopper, lam=2.0)

Randomness: each stage draws from its own generator, seeded with `stage_seed(request seed, i)`;
in-process the request's seed is read back from the draft generator (seeded with `draft_seed` of it),
so a seeded run gives the same tokens in-process and over the wire. With the coupled rule
(`specmesh.decoding.coupled`) every level samples each position with the request's own noise instead
(a stage's params keep the request's seed), so the levels agree as often as their distributions allow,
and no q goes up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specmesh.cascade.chunk_stopping import ChunkStopping
from specmesh.cascade.plan import CascadeBook, StageCall, StageSpec, StageStats, stage_seed
from specmesh.cascade.policy import AdaptiveStopper
from specmesh.cascade.stage_model import StageOutput
from specmesh.decoding.async_driver import AsyncDrafter, CostReporter
from specmesh.decoding.proposal import Drafter, DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator, resolve_seed
from specmesh.decoding.state import draft_seed


class Stage(Protocol):
    """A middle model of the cascade, in-process (`specmesh.cascade.stage_model.StageModel`)."""

    @property
    def max_context(self) -> int:
        """Its context window, tokens."""
        ...

    @property
    def device(self) -> torch.device:
        """Where its generator lives."""
        ...

    def open(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> Any: ...

    def verify_and_extend(self, session: Any, accepted: Sequence[int], draft: Sequence[int], q: torch.Tensor | None,
                          num_extend: int, fill_to: int = 0) -> StageOutput: ...

    def close(self, session: Any) -> None: ...


@runtime_checkable
class AheadStage(Protocol):
    """Optional, on an async stage: whether its service extends the session's proposals ahead while the
    level above verifies them (a Stage service with `draft_ahead`), and what one of its forwards ahead
    costs as it last said (None: not said)."""

    def drafts_ahead(self, session: Any) -> bool: ...

    def ahead_forward_ms(self, session: Any) -> float | None: ...


class AsyncStage(Protocol):
    """A middle model of the cascade behind `await` (`servicekit.remote_stage.RemoteStage`)."""

    async def max_context(self) -> int: ...

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> Any:
        """`params.seed` is this stage's seed (`stage_seed`)."""
        ...

    async def verify_and_extend(self, session: Any, accepted: Sequence[int], draft: Sequence[int], q: torch.Tensor | None,
                                num_extend: int, fill_to: int = 0) -> StageOutput: ...

    async def close(self, session: Any) -> None: ...

    def opened_ms_per_token(self, session: Any) -> float | None:
        """One of the stage's own tokens, as it said when `session` opened or last answered (None: not said)."""
        ...


def cost_floor(base_ms: float | None, specs: Sequence[StageSpec], stage_ms: Sequence[float | None]) -> float | None:
    """A floor of a cascade draft token's cost, for the k policy's prior (`AdaptiveK.prior_costs`): the
    base drafter's token, plus each filling stage's (a filling stage drafts what the base did not give,
    a forward a token); stages of a fixed extension add a forward a round, left to rounds to measure.
    None when no part is known (an n-gram base, which is free, or none, under stages that do not fill)
    or a filling stage's cost is not yet timed. Without a prior the first round, which also prefills
    the prompt on every level, stands for a draft token's cost, and keeps the cascade at k = 0 for the
    rest of a request (measured: 34 ms a token for a bf16 stage whose forwards take 10).

    >>> cost_floor(None, [StageSpec(fill=True)], [10.0]), cost_floor(2.0, [StageSpec()], [10.0])
    (10.0, 2.0)
    >>> cost_floor(None, [StageSpec()], [10.0]) is None, cost_floor(None, [StageSpec(fill=True)], [None]) is None
    (True, True)
    """
    filling = [ms for spec, ms in zip(specs, stage_ms) if spec.fill]
    if any(ms is None for ms in filling) or (base_ms is None and not filling):
        return None
    return (base_ms or 0.0) + sum(ms for ms in filling if ms is not None)


def _check_specs(num_stages: int, specs: Sequence[StageSpec] | None) -> list[StageSpec]:
    specs = [StageSpec() for _ in range(num_stages)] if specs is None else list(specs)
    if len(specs) != num_stages:
        raise ValueError(f"{len(specs)} stage specs for {num_stages} stages")
    return specs


@dataclass
class CascadeState:
    base: Any  # the base drafter's state (None without a base drafter)
    prompt_ids: list[int]
    book: CascadeBook | None = None  # made on the first proposal, which brings the sampling params
    stages: list[Any] = field(default_factory=list)  # each stage's session
    stopping: ChunkStopping | None = None  # adaptive cascades only

    @property
    def stage_stats(self) -> list[StageStats]:
        return self.book.stats if self.book is not None else []

    @property
    def lossy(self) -> bool:
        """True once a chunk was committed below the target (adaptive cascades only)."""
        return any(s.num_chunks_stopped for s in self.stage_stats)

    @property
    def num_chunks_to_target(self) -> int:
        """Chunks the target verified (adaptive cascades; 0 in a lossless one, which does not count)."""
        return self.stopping.num_chunks_to_target if self.stopping is not None else 0


def _check_stopper(stopper: AdaptiveStopper | None, num_stages: int) -> None:
    if stopper is not None and stopper.num_stages != num_stages + 1:
        raise ValueError(f"the stopper was made for {stopper.num_stages} levels; this cascade has {num_stages} "
                         f"stages and the target ({num_stages + 1})")


def _adaptive_start(state: CascadeState, accepted: Sequence[int]) -> None:
    if state.stopping is not None and state.book is not None:
        state.stopping.start_round(accepted, state.book.stats)


def _adaptive_stop(state: CascadeState, index: int, call: StageCall, out: StageOutput, proposal: DraftProposal) -> bool:
    """After stage `index` ran: feed the stopper its judgment of the lower chunk; True = stop here."""
    book, stopping = state.book, state.stopping
    if stopping is None or book is None:
        return False
    stopping.stage_verified(index, call, out, book.stats)
    return stopping.decide(index, call, out, proposal, book.num_confirmed - len(state.prompt_ids), book.stats)


def _adaptive_result(state: CascadeState, proposal: DraftProposal, stopped: bool) -> DraftProposal:
    if stopped:
        return DraftProposal(list(proposal.token_ids), unverified=True)
    if state.stopping is not None:
        state.stopping.sent_to_target(proposal)
    return proposal


class CascadeDrafter:
    """`Drafter` over a base drafter (None: the first stage drafts alone) and in-process stages.
    Not thread-safe: one engine thread calls it (all its models)."""

    name = "cascade"

    def __init__(self, base: Drafter | None, stages: Sequence[Stage], specs: Sequence[StageSpec] | None = None, *,
                 stopper: AdaptiveStopper | None = None, lam: float | None = None, pass_agreed: bool = True):
        self.base = base
        self.stages = list(stages)
        self.specs = _check_specs(len(self.stages), specs)
        _check_stopper(stopper, len(self.stages))
        self.stopper = stopper  # None: lossless; else adaptive (lossy unless lam is inf)
        self.pass_agreed = pass_agreed and stopper is None  # `CascadeBook.pass_agreed`
        self.lam = lam  # lambda of the sessions opened from now on; None = the stopper's default
        self.device = base.device if base is not None else torch.device("cpu")  # of the generator `propose` gets
        self.last_state: CascadeState | None = None  # the session opened last: its stage stats

    def open(self, prompt_ids: Sequence[int]) -> CascadeState:
        """The base drafter's session now; the stages' on the first proposal (they need the params)."""
        prompt = [int(t) for t in prompt_ids]
        self.last_state = CascadeState(self.base.open(prompt) if self.base is not None else None, prompt)
        return self.last_state

    @property
    def ms_per_token(self) -> float | None:
        """A floor of a draft token's cost here (`cost_floor`), from the engines' one-token forwards."""
        base_ms = getattr(self.base, "ms_per_token", None)
        return cost_floor(base_ms, self.specs, [getattr(stage, "ms_per_token", None) for stage in self.stages])

    def check_call(self, state: CascadeState, accepted_since_last: Sequence[int], max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")

    def propose(self, state: CascadeState, accepted_since_last: Sequence[int], max_tokens: int,
                params: SamplingParams, generator: torch.Generator) -> DraftProposal:
        if state.book is None:
            self._open_stages(state, params, generator)
        book = state.book
        assert book is not None  # made just above
        proposal = DraftProposal(token_ids=[])
        _adaptive_start(state, accepted_since_last)
        for tokens, k in book.start_round(accepted_since_last, max_tokens):
            if self.base is not None:
                proposal = self.base.propose(state.base, tokens, k, params, generator)
        proposal = book.base_proposed(proposal)
        for i, stage in enumerate(self.stages):
            call = book.stage_call(i, proposal)
            if call is None:
                continue
            start = time.perf_counter()
            out = stage.verify_and_extend(state.stages[i], call.accepted, call.draft.token_ids, call.draft.q,
                                          call.num_extend_tokens, call.fill_to)
            proposal = book.stage_done(i, call, out, (time.perf_counter() - start) * 1e3)
            if _adaptive_stop(state, i, call, out, proposal):
                return _adaptive_result(state, proposal, stopped=True)
        return _adaptive_result(state, proposal, stopped=False)

    def propose_many(self, states, accepted, max_tokens, params, generators) -> list[DraftProposal]:
        return [self.propose(*call) for call in zip(states, accepted, max_tokens, params, generators)]

    def close(self, state: CascadeState) -> None:
        for stage, session in zip(self.stages, state.stages):
            stage.close(session)
        state.stages = []
        if self.base is not None:
            self.base.close(state.base)

    def _open_stages(self, state: CascadeState, params: SamplingParams, generator: torch.Generator) -> None:
        seed = draft_seed(generator.initial_seed())  # the request's seed (draft_seed is its own inverse)
        for i, stage in enumerate(self.stages):
            stage_generator, _ = make_generator(stage_seed(seed, i), stage.device)
            state.stages.append(stage.open(state.prompt_ids, params, stage_generator))
        state.book = CascadeBook(self.specs, [stage.max_context for stage in self.stages], len(state.prompt_ids),
                                 keep_q=params.needs_q, pass_agreed=self.pass_agreed)
        if self.stopper is not None:
            state.stopping = ChunkStopping(self.stopper, len(self.stages), len(state.prompt_ids), self.lam)


class AsyncCascadeDrafter:
    """`AsyncDrafter` over an async base drafter (None: the first stage drafts alone) and async stages.

    `is_stage_failure(index, exc)`: True for an error of stage `index` that retires the stage for the
    rest of the session, the round going on without it (exact: the proposal below it is a valid
    draft); on False the error propagates. The Coordinator says True for a dead replica and logs it.
    """

    name = "cascade"

    def __init__(self, base: AsyncDrafter | None, stages: Sequence[AsyncStage], specs: Sequence[StageSpec] | None = None,
                 is_stage_failure: Callable[[int, BaseException], bool] = lambda index, exc: False, *,
                 stopper: AdaptiveStopper | None = None, lam: float | None = None, pass_agreed: bool = True):
        self.base = base
        self.stages = list(stages)
        self.specs = _check_specs(len(self.stages), specs)
        _check_stopper(stopper, len(self.stages))
        self.stopper = stopper  # None: lossless; else adaptive (lossy unless lam is inf)
        self.pass_agreed = pass_agreed and stopper is None  # `CascadeBook.pass_agreed`
        self.lam = lam  # None = the stopper's default
        self.is_stage_failure = is_stage_failure
        self.last_state: CascadeState | None = None  # the session opened last: its `stage_stats` (the Coordinator builds one per request)

    async def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> CascadeState:
        params = resolve_seed(params)
        seed = params.seed
        assert seed is not None  # resolved
        prompt = [int(t) for t in prompt_ids]
        state = CascadeState(None, prompt)
        max_contexts, failed = [], []
        try:
            if self.base is not None:
                state.base = await self.base.open(prompt, params)
            for i, stage in enumerate(self.stages):
                try:
                    max_contexts.append(await stage.max_context())
                    own_seed = seed if params.is_coupled else stage_seed(seed, i)  # coupled: the request's noise
                    state.stages.append(await stage.open(prompt, dataclasses.replace(params, seed=own_seed)))
                except Exception as exc:
                    if not self.is_stage_failure(i, exc):
                        raise
                    max_contexts[i:] = [0]
                    state.stages.append(None)
                    failed.append(i)
        except BaseException:
            await self.close(state)
            raise
        state.book = CascadeBook(self.specs, max_contexts, len(prompt), keep_q=params.needs_q,
                                 pass_agreed=self.pass_agreed)
        for i in failed:
            state.book.retire(i)
        if self.stopper is not None:
            state.stopping = ChunkStopping(self.stopper, len(self.stages), len(prompt), self.lam)
        self.last_state = state
        return state

    def opened_ms_per_token(self, state: CascadeState) -> float | None:
        """`CostReporter`: a floor of a cascade token's cost (`cost_floor`) from what the base drafter and
        the filling stages reported when they opened; rounds then measure it."""
        base_ms = None
        if isinstance(self.base, CostReporter) and state.base is not None:
            base_ms = self.base.opened_ms_per_token(state.base)
        live = [(spec, None if session is None else stage.opened_ms_per_token(session))
                for spec, stage, session, stats in zip(self.specs, self.stages, state.stages, state.stage_stats)
                if not stats.retired]
        return cost_floor(base_ms, [spec for spec, _ in live], [ms for _, ms in live])

    def opened_drafting_ahead(self, state: CascadeState) -> bool:
        """`AheadReporter`: the top stage fills the level above's k and extends ahead for this session, so
        its work on a round is mostly done while the target verifies the last one (on a hit, as a Draft
        service drafting ahead: the k policy prices rounds alike, `AdaptiveK.set_drafting_ahead`)."""
        return self._top_ahead(state) is not None

    def _top_ahead(self, state: CascadeState) -> tuple[AheadStage, Any] | None:
        if not self.stages or len(state.stages) < len(self.stages):
            return None
        top, session = self.stages[-1], state.stages[-1]
        if (session is None or not self.specs[-1].fill or not isinstance(top, AheadStage)
                or (state.stage_stats and state.stage_stats[-1].retired) or not top.drafts_ahead(session)):
            return None
        return top, session

    def _ahead_ms(self, state: CascadeState) -> float | None:
        """What a forward ahead of the top stage costs, when it extends ahead (its last word, else its token's)."""
        top = self._top_ahead(state)
        if top is None:
            return None
        stage, session = top
        said = stage.ahead_forward_ms(session)
        return said if said is not None else self.stages[-1].opened_ms_per_token(session)

    async def propose(self, state: CascadeState, accepted_since_last: Sequence[int], max_tokens: int) -> DraftProposal:
        proposal = await self._propose(state, accepted_since_last, max_tokens)
        if not proposal.unverified:
            proposal.ahead_forward_ms = self._ahead_ms(state)
        return proposal

    async def _propose(self, state: CascadeState, accepted_since_last: Sequence[int], max_tokens: int) -> DraftProposal:
        book = state.book
        assert book is not None  # made by open
        proposal = DraftProposal(token_ids=[])
        _adaptive_start(state, accepted_since_last)
        for tokens, k in book.start_round(accepted_since_last, max_tokens):
            if self.base is not None:
                proposal = await self.base.propose(state.base, tokens, k)
        proposal = book.base_proposed(proposal)
        for i, stage in enumerate(self.stages):
            call = book.stage_call(i, proposal)
            if call is None:
                continue
            start = time.perf_counter()
            try:
                out = await stage.verify_and_extend(state.stages[i], call.accepted, call.draft.token_ids, call.draft.q,
                                                    call.num_extend_tokens, call.fill_to)
            except Exception as exc:
                if not self.is_stage_failure(i, exc):
                    raise
                book.retire(i)
                proposal = call.draft
                continue
            proposal = book.stage_done(i, call, out, (time.perf_counter() - start) * 1e3)
            if _adaptive_stop(state, i, call, out, proposal):
                return _adaptive_result(state, proposal, stopped=True)
        return _adaptive_result(state, proposal, stopped=False)

    async def close(self, state: CascadeState) -> None:
        for stage, session in zip(self.stages, state.stages):
            if session is not None:  # None: it failed to open
                await stage.close(session)
        state.stages = []
        if self.base is not None and state.base is not None:
            await self.base.close(state.base)
