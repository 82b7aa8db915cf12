"""Withholding drafts that do not pay: the prompt-lookup index scores each match order on the tokens
it sees (free: nothing is verified), its proposals carry the estimated acceptance of their first
token, and an adaptive k policy verifies them only when that beats the cost of a verified token."""

from __future__ import annotations

import pytest

from specmesh.decoding.adaptive import AdaptiveK, FixedK, ForwardCost, LinearCostFit
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import PLAIN_RUN_MAX, SpeculationState
from specmesh.drafters.ngram import ACCEPTANCE_PRIOR, PromptLookupDrafter, PromptLookupIndex


def _prior_mean(hits: int = 0, predictions: int = 0) -> float:
    return (hits + ACCEPTANCE_PRIOR[0]) / (predictions + sum(ACCEPTANCE_PRIOR))


def _policy_at_zero(draft_ms: float, decode_ms: float) -> AdaptiveK:
    policy = AdaptiveK()
    policy.acceptance = 0.05  # no k beats plain decoding at these costs
    policy.prior_costs(draft_ms, decode_ms)
    assert policy.next_k() == 0
    return policy


@pytest.mark.parametrize("draft_ms, expected_rounds", [(1.0, 10), (20.0, 70)])
def test_a_plain_run_goes_on_while_the_policy_stays_at_zero(draft_ms, expected_rounds):
    """At k = 0 a round and its stretch are plain, and so is every round after them at which the policy
    stays at 0: `plain_rounds_from_here` hands them out together, up to the first round after a stretch
    at which the policy would probe (its probe comes due after probe_every = 8 rounds: the stretches of
    1, 2, 4 end at rounds 2, 5, 10), or to the first such round past PLAIN_RUN_MAX when no probe can come (a
    draft token costs more than the step it saves; stretches of 1, 2, 4, 8, 16, 16, 16 end at round 70).
    Stepped round by round, every one of them is plain."""
    state = SpeculationState(SamplingParams(temperature=0, max_new_tokens=500), num_prompt_tokens=4, max_context=1024,
                             k_policy=_policy_at_zero(draft_ms, 10.0), plain_stretches=True)
    state.start(7)
    if draft_ms < 10.0:
        assert state.k_policy.plain_rounds_ahead() == 8
    else:
        assert not state.k_policy.could_pay() and state.k_policy.plain_rounds_ahead() is None
    rounds = state.plain_rounds_from_here()
    assert rounds == expected_rounds and (draft_ms < 10.0 or rounds >= PLAIN_RUN_MAX)
    for _ in range(rounds):
        assert state.next_k() == 0
        state.record(0, 0, [6], verify_ms=10.0)
    if draft_ms < 10.0:  # the probe came due inside the last stretch (round 8)
        assert state.k_policy._probe_interval == 16


def test_the_index_scores_each_match_order_on_the_tokens_it_is_given():
    index = PromptLookupIndex(min_n=1, max_n=2)
    index.extend([1, 2, 3, 1])  # unscored (a prompt)
    assert index.acceptance() == pytest.approx(_prior_mean())  # [1] matches (order 1), which has no record yet
    index.extend([2], score=True)  # before it: suffix [1] (order 1) predicted 2: right
    index.extend([9], score=True)  # before it: suffix [1, 2] (order 2) predicted 3: wrong
    index.extend([5], score=True)  # before it: no earlier [2, 9] nor [9]: not a prediction
    assert index._scores == {1: (1, 1), 2: (0, 1)}
    assert index.acceptance() is None  # nothing matches [9, 5] or [5]
    index.extend([1], score=True)  # suffix [5]: unseen before; [1] continues at 4 (after the prompt's last 1)
    assert index.propose(1) == [2]
    assert index.acceptance() == pytest.approx(_prior_mean(1, 1))  # the order-1 record: 1 right of 1


def test_a_drafters_proposal_carries_its_acceptance_estimate():
    drafter = PromptLookupDrafter(min_n=1, max_n=3)
    state = drafter.open([10, 11, 12, 13, 10])
    params = SamplingParams(temperature=0)
    first = drafter.propose(state, [11], 3, params, None)
    # scoring 11: [10] (order 1) had predicted it; the draft comes from [10, 11] (order 2), which has no record yet
    assert first.token_ids == [12, 13, 10] and first.acceptance == pytest.approx(_prior_mean())
    assert state._scores == {1: (1, 1)}
    assert drafter.propose(state, [12, 99], 3, params, None).acceptance is None  # no match: no draft, no estimate


def _state(k_policy) -> SpeculationState:
    state = SpeculationState(SamplingParams(temperature=0, max_new_tokens=50), num_prompt_tokens=4, max_context=512,
                             k_policy=k_policy)
    state.start(7)
    return state


def test_an_adaptive_policy_withholds_drafts_whose_first_token_does_not_pay():
    policy = AdaptiveK()
    policy.update(0, 0, 0.0, 10.0, ForwardCost(fixed_ms=7.0, ms_per_token=2.2))  # a low-bit CPU target: beta ~ 0.24
    assert policy.beta == pytest.approx(2.2 / 9.2)  # the first measured cost replaces the prior (0.1)
    state = _state(policy)
    unlikely = DraftProposal([1, 2, 3], acceptance=policy.beta - 0.05)
    likely = DraftProposal([1, 2, 3], acceptance=policy.beta + 0.05)
    assert state.gate(unlikely).token_ids == [] and state.stats.num_withheld_drafts == 1
    assert state.gate(likely) is likely
    assert state.gate(DraftProposal([4])).token_ids == [4]  # no estimate: verified as drafted
    assert state.stats.num_withheld_drafts == 1
    # a fixed k is the caller's choice: every draft is verified
    fixed = _state(FixedK(3))
    assert fixed.gate(unlikely) is unlikely and fixed.stats.num_withheld_drafts == 0


def test_cheap_verification_keeps_unproved_drafts_and_costly_verification_waits_for_proof():
    cheap, costly = AdaptiveK(), AdaptiveK()
    for _ in range(10):
        cheap.update(0, 0, 0.0, 30.0, ForwardCost(fixed_ms=30.0, ms_per_token=0.5))  # fp32, one session: beta ~ 0.02
        costly.update(0, 0, 0.0, 9.0, ForwardCost(fixed_ms=7.0, ms_per_token=2.2))  # Q4_1 on a CPU: beta ~ 0.24
    unproved = _prior_mean()
    assert cheap.pays(unproved) and not costly.pays(unproved)
    assert costly.pays(_prior_mean(8, 9))  # a proven order (8 right of 9) pays on the costly target too


def test_a_fitted_token_cost_outlives_a_stretch_of_plain_decoding():
    """Rounds that all feed one token cannot tell the slope; the fit keeps its last estimate (a
    withheld draft must not make the next draft look cheap again)."""
    fit = LinearCostFit()
    assert fit.estimate() is None
    for tokens in (1, 2, 5, 1, 3):
        fit.observe(tokens, 7.0 + 2.0 * tokens)
    fixed, per_token = fit.estimate()
    assert (fixed, per_token) == (pytest.approx(7.0), pytest.approx(2.0))
    for _ in range(2000):  # the old spread decays away
        fit.observe(1, 9.0)
    assert fit.estimate() == (pytest.approx(7.0), pytest.approx(2.0))


def _plain_round(state: SpeculationState, token: int = 5) -> None:
    state.gate(DraftProposal([1, 2], acceptance=0.0))  # asked only outside a stretch; withheld by an adaptive k
    state.record(0, 0, [token])


def test_plain_stretches_grow_while_drafts_do_not_pay_and_end_at_a_verified_draft():
    """m rounds in a row that accept no draft token (here: withheld drafts) make the next
    min(2^(m-1), 16) rounds plain without asking the drafter; an accepted draft token starts over, a
    rejected draft does not. Off unless asked for."""
    policy = AdaptiveK(beta=0.5, allow_zero=False)  # acceptance 0.0 never beats it; k stays >= 1 (a policy at 0: below)
    state = SpeculationState(SamplingParams(temperature=0, max_new_tokens=900), num_prompt_tokens=4, max_context=2048,
                             k_policy=policy, plain_stretches=True)
    state.start(7)
    stretches = []
    for _ in range(7):
        assert state.plain_rounds() == 0 and state.next_k() > 0  # a decision: the drafter is asked ...
        assert state.plain_rounds_from_here() == 1 + min(16, 2 ** len(stretches))  # (were nothing verified)
        _plain_round(state)  # ... and its draft withheld
        stretches.append(state.plain_rounds())
        for _ in range(state.plain_rounds()):
            assert state.next_k() == 0  # inside a stretch nothing is drafted
            state.record(0, 0, [6])
    assert stretches == [1, 2, 4, 8, 16, 16, 16]
    assert state.stats.num_withheld_drafts == 7  # stretch rounds are not withheld drafts: nothing was asked
    state.next_k()
    state.record(2, 0, [1])  # a draft rejected whole: still fruitless, a stretch of 16 ...
    assert state.plain_rounds() == 0  # ... whose first round still tells the drafter its verdict
    assert state.next_k() == 0 and state.asks_drafter(0) and state.plain_rounds_from_here() == 16
    state.record(0, 0, [6])
    assert state.plain_rounds() == 15 and not state.asks_drafter(0)  # then no calls: the next draft takes the tokens in
    for _ in range(15):
        state.record(0, 0, [6])
    state.next_k()
    state.record(2, 1, [1, 3])  # an accepted draft token: the streak starts over
    _plain_round(state)
    assert state.plain_rounds() == 1
    state.record(0, 0, [6])
    _plain_round(state)
    assert state.plain_rounds() == 2
    # a fixed k is the caller's: its rejected drafts start no stretch
    fixed = SpeculationState(SamplingParams(temperature=0, max_new_tokens=50), num_prompt_tokens=4, max_context=512,
                             k_policy=FixedK(3), plain_stretches=True)
    fixed.start(7)
    for _ in range(5):
        assert fixed.next_k() == 3
        fixed.record(3, 0, [5])
        assert fixed.plain_rounds() == 0 and fixed.plain_rounds_from_here() == 1
    # without plain_stretches every round asks the drafter
    off = SpeculationState(SamplingParams(temperature=0, max_new_tokens=50), num_prompt_tokens=4, max_context=512,
                           k_policy=AdaptiveK(beta=0.5))
    off.start(7)
    for _ in range(10):
        off.next_k()
        _plain_round(off)
        assert off.plain_rounds() == 0


def test_the_verifiers_known_token_cost_prices_a_requests_first_draft():
    """A verifier that has fitted its forwards' cost (earlier requests' rounds) hands it to each new
    request's policy before its first round: an unproved match (the prior's 1 in 6) is withheld at the
    beta of a low-bit target on a CPU (0.25), where the prior beta (0.1) would let it through."""
    first_round = AdaptiveK()
    assert first_round.pays(_prior_mean())  # the prior beta: an unproved match is verified
    informed = AdaptiveK()
    informed.prior_costs(None, None, forward_cost=ForwardCost(fixed_ms=6.0, ms_per_token=2.0))
    assert informed.beta == pytest.approx(2.0 / 8.0) and not informed.pays(_prior_mean())
    informed.update(0, 0, 0.0, 11.0, ForwardCost(fixed_ms=9.0, ms_per_token=1.0))  # later rounds average in
    assert 1.0 / 10.0 < informed.beta < 2.0 / 8.0
    late = AdaptiveK()
    late.update(0, 0, 0.0, 11.0, ForwardCost(fixed_ms=9.0, ms_per_token=1.0))
    late.prior_costs(None, None, forward_cost=ForwardCost(fixed_ms=6.0, ms_per_token=2.0))  # rounds measured first
    assert late.beta == pytest.approx(0.1)


def test_speculative_stream_gives_the_policy_the_verifiers_fit(tiny_model_dir):
    import torch

    from specmesh.decoding.speculative import generate
    from specmesh.decoding.verifier import TargetVerifier
    from specmesh.models.load import load_engine

    class Unlikely:
        """Proposes two tokens whose first it rates at 12% (above the prior beta, below the fit's)."""
        device = torch.device("cpu")

        def open(self, prompt_ids):
            return None

        def propose(self, state, accepted_since_last, max_tokens, params, generator):
            return DraftProposal([3, 4][:max_tokens], acceptance=0.12)

        def close(self, state):
            pass

    engine = load_engine(tiny_model_dir("llama"), dtype="float32")
    params = SamplingParams(temperature=0, max_new_tokens=6)
    cold = generate(TargetVerifier(engine), Unlikely(), [5, 6, 7, 8], params, k_policy=AdaptiveK())
    assert cold.stats.num_draft_tokens > 0  # nothing fitted yet: the prior beta lets the first draft through
    # a verifier whose fit holds earlier requests' rounds, and none of the cold run's (their timings, which a
    # loaded machine moves, could pull the slope down): a draft token costs a quarter of a step, twice what a
    # 12% first token pays for. The warm run's own plain rounds (fast, one token) join the fit as it goes and
    # only raise that
    verifier = TargetVerifier(engine)
    for tokens in (1, 3) * 50:
        verifier._round_costs.observe(tokens, 6.0 + 2.0 * tokens)
    warm = generate(verifier, Unlikely(), [5, 6, 7, 8], params, k_policy=AdaptiveK())
    assert warm.stats.num_draft_tokens == 0 and warm.stats.num_withheld_drafts > 0
    assert warm.token_ids == cold.token_ids
