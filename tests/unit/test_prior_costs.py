"""The asyncio driver takes the costs both sides reported when their sessions opened (`CostReporter`:
the Draft service's ms per draft token, the Verify replica's one-token step) as the adaptive k
policy's prior, as the in-process loop takes its engines': a drafter slower than the target step is
never asked for a draft, one that is cheap drafts from the first round, and without the reports the
first round drafts at the policy's initial k as before."""

from __future__ import annotations

import asyncio

import pytest

from specmesh.decoding.adaptive import AdaptiveK
from specmesh.decoding.async_driver import TargetInfo, generate_async
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.types import FinalTokenKind, VerifyOutcome

VOCAB = 50


def _next(token: int) -> int:
    return (token * 7 + 3) % VOCAB


class CountingTarget:
    """A target whose token after t is `_next(t)`; its step costs `step_ms` as reported at open."""

    def __init__(self, step_ms: float | None):
        self.step_ms = step_ms

    async def info(self) -> TargetInfo:
        return TargetInfo(vocab_size=VOCAB, max_context=512, eos_token_ids=())

    async def open(self, prompt_ids, params):
        return [_next(prompt_ids[-1])], _next(prompt_ids[-1])

    async def verify(self, session, proposal: DraftProposal):
        accepted = []
        for token in proposal.token_ids:
            if token != _next(session[-1]):
                break
            accepted.append(token)
            session.append(token)
        final = _next(session[-1])
        session.append(final)
        return VerifyOutcome(list(range(len(accepted))), accepted, final, FinalTokenKind.BONUS), None

    async def commit(self, session, token_ids):
        raise AssertionError("no lossy cascade here")

    async def close(self, session):
        pass


class ReportingTarget(CountingTarget):
    def opened_ms_per_token(self, session) -> float | None:
        return self.step_ms


class OracleDrafter:
    """Drafts the target's own tokens; records the k of every proposal."""

    def __init__(self, ms_per_token: float | None):
        self.ms_per_token = ms_per_token
        self.asked: list[int] = []

    async def open(self, prompt_ids, params):
        return list(prompt_ids)

    async def propose(self, context, accepted_since_last, max_tokens):
        context.extend(accepted_since_last)
        self.asked.append(max_tokens)
        tokens, last = [], context[-1]
        for _ in range(max_tokens):
            last = _next(last)
            tokens.append(last)
        return DraftProposal(token_ids=tokens)

    async def close(self, context):
        pass


class ReportingDrafter(OracleDrafter):
    def opened_ms_per_token(self, context) -> float | None:
        return self.ms_per_token


def _generate(target, drafter) -> list[int]:
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    events = asyncio.run(generate_async(target, drafter, [1, 2, 3], params, k_policy=AdaptiveK()))
    return [t for event in events for t in event.token_ids]


def _expected() -> list[int]:
    tokens, last = [], 3
    for _ in range(24):
        last = _next(last)
        tokens.append(last)
    return tokens


def test_a_drafter_slower_than_the_target_step_is_never_asked_for_a_draft():
    drafter = ReportingDrafter(ms_per_token=60.0)
    assert _generate(ReportingTarget(step_ms=28.0), drafter) == _expected()
    assert not any(drafter.asked)  # no draft token in any round (no probe either: it could not pay)


def test_a_cheap_drafter_drafts_from_the_first_round():
    drafter = ReportingDrafter(ms_per_token=0.5)
    assert _generate(ReportingTarget(step_ms=28.0), drafter) == _expected()
    assert drafter.asked[0] > 0


@pytest.mark.parametrize("target, drafter", [
    (CountingTarget(step_ms=28.0), ReportingDrafter(ms_per_token=60.0)),  # one side does not report
    (ReportingTarget(step_ms=None), ReportingDrafter(ms_per_token=60.0)),  # a side that has not measured yet
    (ReportingTarget(step_ms=28.0), OracleDrafter(ms_per_token=60.0)),
])
def test_without_both_reports_the_first_round_drafts_at_the_initial_k(target, drafter):
    assert _generate(target, drafter) == _expected()
    assert drafter.asked[0] == AdaptiveK().k_init


@pytest.mark.parametrize("base_ms, drafts", [(60.0, False), (0.5, True)])
def test_a_cascade_reports_its_base_drafters_cost(base_ms, drafts):
    """A cascade is a `CostReporter` through its base drafter: its first round is priced at the base's
    reported draft token (the stages add their cost per round, which rounds then measure), not at what
    the first round took, which also prefills the prompt on every level. No base report, no prior."""
    from specmesh.cascade.pipeline import AsyncCascadeDrafter

    base = ReportingDrafter(ms_per_token=base_ms)
    cascade = AsyncCascadeDrafter(base, [])
    state = asyncio.run(cascade.open([1, 2, 3], SamplingParams(temperature=0)))
    assert cascade.opened_ms_per_token(state) == base_ms
    assert _generate(ReportingTarget(step_ms=28.0), AsyncCascadeDrafter(base, [])) == _expected()
    assert any(base.asked) is drafts
    silent = AsyncCascadeDrafter(OracleDrafter(ms_per_token=base_ms), [])
    assert silent.opened_ms_per_token(asyncio.run(silent.open([1, 2, 3], SamplingParams(temperature=0)))) is None


class AheadDrafter(ReportingDrafter):
    """Drafts ahead while the target verifies (`AheadReporter`), each forward costing `forward_ms` as
    each proposal says, until `stops_after` proposals (a failover to a drafter that does not)."""

    def __init__(self, ms_per_token: float, forward_ms: float, stops_after: int = 10**6):
        super().__init__(ms_per_token)
        self.forward_ms, self.stops_after = forward_ms, stops_after

    def opened_drafting_ahead(self, context) -> bool:
        return True

    async def propose(self, context, accepted_since_last, max_tokens):
        proposal = await super().propose(context, accepted_since_last, max_tokens)
        if len(self.asked) <= self.stops_after:
            proposal.ahead_forward_ms = self.forward_ms
        return proposal


def test_a_drafter_that_drafts_ahead_has_its_rounds_priced_so():
    """A drafter that says it drafts ahead (`AheadReporter`) sets the policy's mode when the session opens
    (the first k is still the prior costs'); each proposal's reported forward cost, not the round's wait,
    is then the policy's draft cost. A drafter that stops saying it (a failover to one that does not draft
    ahead) turns the mode off."""
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ahead = AheadDrafter(ms_per_token=0.5, forward_ms=19.0)
    policy = AdaptiveK()
    events = asyncio.run(generate_async(ReportingTarget(step_ms=28.0), ahead, [1, 2, 3], params, k_policy=policy))
    assert [t for event in events for t in event.token_ids] == _expected()
    assert ahead.asked[0] > 0 and policy.drafts_ahead and policy.draft_ms_per_token == 19.0
    stops = AheadDrafter(ms_per_token=0.5, forward_ms=19.0, stops_after=1)
    policy = AdaptiveK()
    asyncio.run(generate_async(ReportingTarget(step_ms=28.0), stops, [1, 2, 3], params, k_policy=policy))
    assert len(stops.asked) > 1 and not policy.drafts_ahead


class SleepingTarget(ReportingTarget):
    """A verify forward takes `step_ms` (slept: rounds measure the costs the policy prices)."""

    async def verify(self, session, proposal: DraftProposal):
        await asyncio.sleep(self.step_ms / 1e3)
        return await super().verify(session, proposal)


class StaleDrafter(ReportingDrafter):
    """Reports a draft token at `stale_ms` (timed on a busy machine) until its forwards, which take `ms`
    each, time it afresh."""

    def __init__(self, stale_ms: float, ms: float):
        super().__init__(stale_ms)
        self.ms = ms

    async def propose(self, context, accepted_since_last, max_tokens):
        await asyncio.sleep(self.ms * max_tokens / 1e3)
        self.ms_per_token = self.ms
        return await super().propose(context, accepted_since_last, max_tokens)


@pytest.mark.parametrize("ms, drafts", [(2.0, True), (8.0, False)])
def test_a_stale_report_that_shuts_the_gate_is_checked_by_one_probe(ms, drafts):
    """A Draft service whose figure read high (8 ms against a 10 ms step: perfect drafts would save too
    little, `AdaptiveK.could_pay`) is asked for one probe of two drafts; its figure after that Propose
    (`CostReporter`) replaces the prior, and at 2 ms the request drafts from then on. Confirmed at 8 ms,
    the request stays plain after the probe."""
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    drafter = StaleDrafter(8.0, ms)
    events = asyncio.run(generate_async(SleepingTarget(step_ms=10.0), drafter, [1, 2, 3], params, k_policy=AdaptiveK()))
    tokens = [t for event in events for t in event.token_ids]
    assert tokens[:24] == _expected()
    asked = [k for k in drafter.asked if k]
    assert asked[0] == 2 and (len(asked) > 2) is drafts and (len(asked) == 1) is not drafts
