"""The execution plan as a value: `choose_plan` over every (mode, drafter, placement, cascade,
server rounds) a request can bring, the plan's own properties, the driver's refusal of a plan that
does not match its drafter, and the draft sub-step (`SpeculationState.draft_step`) every driver runs."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from specmesh.decoding.adaptive import AdaptiveK, FixedK
from specmesh.decoding.async_driver import generate_async
from specmesh.decoding.plan import MODES, Plan, choose_plan
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import SpeculationState

EXPECTED = {  # (mode, drafter, drafter_on_verify, cascade, server_rounds) -> plan, for every valid input
    ("speculative", True, False, False, False): Plan.CLIENT_ROUNDS,
    ("speculative", True, False, False, True): Plan.CLIENT_ROUNDS_PLAIN_RUNS,
    ("speculative", True, True, False, False): Plan.FUSED_STEP,
    ("speculative", True, True, False, True): Plan.FUSED_RUN,
    ("speculative", False, False, False, False): Plan.PLAIN_ROUNDS,
    ("speculative", False, False, False, True): Plan.SERVER_RUN,
    ("fused", False, False, False, False): Plan.FUSED_STEP,
    ("fused", False, False, False, True): Plan.FUSED_RUN,
    ("autoregressive", False, False, False, False): Plan.PLAIN_ROUNDS,
    ("autoregressive", False, False, False, True): Plan.SERVER_RUN,
    ("skeleton", False, False, False, False): Plan.SKELETON,
    ("skeleton", True, False, False, True): Plan.SKELETON,
}


@pytest.mark.parametrize("mode, drafter, on_verify, cascade, server_rounds",
                         list(itertools.product(MODES, (False, True), (False, True), (False, True), (False, True))))
def test_every_input_gets_one_plan_or_a_clear_refusal(mode, drafter, on_verify, cascade, server_rounds):
    if cascade and mode != "speculative":
        with pytest.raises(ValueError, match="a cascade runs in speculative mode"):
            choose_plan(mode, drafter=drafter, drafter_on_verify=on_verify, cascade=cascade, server_rounds=server_rounds)
        return
    plan = choose_plan(mode, drafter=drafter, drafter_on_verify=on_verify, cascade=cascade, server_rounds=server_rounds)
    if cascade:  # the stages draft for the target, whatever sits below them; plain stretches as one Run where it can
        assert plan is (Plan.CASCADE_PLAIN_RUNS if server_rounds else Plan.CASCADE)
    elif (mode, drafter, on_verify, cascade, server_rounds) in EXPECTED:
        assert plan is EXPECTED[mode, drafter, on_verify, cascade, server_rounds]
    # the rules the table spells out, for every input
    assert plan.server_steps == (server_rounds and plan in (Plan.FUSED_RUN, Plan.SERVER_RUN))
    if mode in ("fused", "autoregressive") or (mode == "speculative" and not drafter and not cascade):
        assert not plan.drafts_here  # nothing beside the driver drafts
    if mode == "speculative" and drafter and not on_verify and not cascade:
        assert plan.drafts_here and plan is (Plan.CLIENT_ROUNDS_PLAIN_RUNS if server_rounds else Plan.CLIENT_ROUNDS)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown mode 'beam'"):
        choose_plan("beam", drafter=False, server_rounds=False)


def test_the_plans_are_the_wire_names_of_the_stats():
    assert [p.value for p in Plan] == ["client_rounds", "client_rounds_plain_runs", "cascade", "cascade_plain_runs",
                                       "fused_step", "fused_run", "plain_rounds", "server_run", "skeleton"]
    assert {p for p in Plan if p.fused} == {Plan.FUSED_STEP, Plan.FUSED_RUN}
    assert {p for p in Plan if p.drafts_here} == {Plan.CLIENT_ROUNDS, Plan.CLIENT_ROUNDS_PLAIN_RUNS, Plan.CASCADE,
                                                  Plan.CASCADE_PLAIN_RUNS}
    assert {p for p in Plan if p.plain_runs} == {Plan.CLIENT_ROUNDS_PLAIN_RUNS, Plan.CASCADE_PLAIN_RUNS}


class _NoCalls:
    """A verifier / drafter the driver must refuse before it calls anything."""

    def __getattr__(self, name):
        if name.startswith("__"):  # pytest's and python's own probes
            raise AttributeError(name)
        raise AssertionError(f"called {name} of a refused plan")


@pytest.mark.parametrize("plan, drafter", [(Plan.CLIENT_ROUNDS, None), (Plan.CASCADE, None), (Plan.FUSED_RUN, _NoCalls()),
                                           (Plan.SERVER_RUN, _NoCalls()), (Plan.SKELETON, None)])
def test_the_driver_refuses_a_plan_its_drafter_does_not_match(plan, drafter):
    with pytest.raises(ValueError, match="plan|Skeleton"):
        asyncio.run(generate_async(_NoCalls(), drafter, [1, 2], SamplingParams(max_new_tokens=4), plan=plan))


def _state(k_policy) -> SpeculationState:
    state = SpeculationState(SamplingParams(max_new_tokens=32, ignore_eos=True), num_prompt_tokens=3, max_context=64,
                             k_policy=k_policy)
    state.start(7)
    return state


def test_the_draft_step_tells_the_drafter_what_it_missed_once():
    state = _state(FixedK(2))
    step = state.draft_step(state.next_k())
    assert step.asks and step.k == 2 and step.new_tokens == [7]
    assert step.take(DraftProposal([8, 9])).token_ids == [8, 9]
    state.record(2, 1, [8, 5])
    assert state.draft_step(state.next_k()).new_tokens == [8, 5]


def test_the_draft_step_gates_a_policys_k_and_keeps_a_callers():
    unlikely = DraftProposal([4, 5], acceptance=0.01)
    gated = _state(AdaptiveK(beta=0.5)).draft_step(2)
    assert gated.take(unlikely).token_ids == []  # an adaptive k withholds a draft that does not pay
    fixed = _state(AdaptiveK(beta=0.5)).draft_step(2, fixed_k=True)
    assert fixed.take(unlikely) is unlikely  # a caller's k: verified as drafted


def test_a_round_that_does_not_ask_the_drafter_takes_nothing():
    state = SpeculationState(SamplingParams(max_new_tokens=32, ignore_eos=True), num_prompt_tokens=3, max_context=64,
                             has_drafter=False)
    state.start(7)
    step = state.draft_step(state.next_k())
    assert not step.asks and step.new_tokens == []
    with pytest.raises(RuntimeError, match="not asked"):
        step.take(DraftProposal([1]))
