"""Adaptive k: the worked example of the docstring, the fall back to plain decoding, and probing."""

import random

import pytest

from specmesh.decoding.adaptive import AcceptanceMemory, AdaptiveK, FixedK, ForwardCost, LinearCostFit, Outlook, expected_tokens
from specmesh.decoding.stats import SpecStats


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_docstring_worked_example_picks_k4():
    policy = AdaptiveK(k_init=1, k_max=16)
    policy.acceptance, policy.draft_ms_per_token, policy.decode_ms, policy.beta = 0.8, 1.0, 10.0, 0.1
    assert policy.speed(0) == pytest.approx(0.1)
    assert policy.speed(4) == pytest.approx(3.3616 / 18)
    assert policy._choose(last_k=4) == 4


def test_the_one_pass_choice_is_the_argmax_of_speed():
    """`_best` sums E(k) as k grows, in one pass; its k is one of the fastest by `speed`."""
    rng = random.Random(7)
    for _ in range(2000):
        k_min = rng.choice([1, 2, 3])
        policy = AdaptiveK(k_min=k_min, k_init=k_min, k_max=rng.choice([3, 8, 16]), allow_zero=rng.random() < 0.8)
        policy.acceptance = rng.choice([0.0, 0.05, 0.5, 0.9, 1.0, rng.random()])
        policy.draft_ms_per_token = rng.choice([None, 0.0, rng.uniform(0.01, 20)])
        policy.decode_ms = rng.choice([None, rng.uniform(1, 40)])
        policy.beta = rng.choice([0.0, 0.1, rng.uniform(0, 0.5)])
        candidates = [*range(policy.k_min, policy.k_max + 1), *([0] if policy.allow_zero else [])]
        speeds = {k: policy.speed(k) for k in candidates}
        best = policy._best()
        assert speeds[best] == pytest.approx(max(speeds.values()), rel=1e-12)


def test_useless_drafts_fall_back_to_plain_decoding_then_probe():
    policy = AdaptiveK(k_init=4, k_min=1, k_max=8, probe_every=3, max_probe_every=12)
    ks = []
    for _ in range(60):
        k = policy.next_k()
        ks.append(k)
        policy.update(k, 0, draft_ms=5.0 * k, verify_ms=10.0 * (1 + 0.1 * k))
    assert ks[0] == 4
    assert 0 in ks, ks
    # rounds from one probe to the next (the probe included): 3, then 6, 12, and 12 at the cap
    periods = [len(run) + 1 for run in "".join("0" if k == 0 else "x" for k in ks[1:]).split("x")][:-1]
    assert periods[:3] == [3, 6, 12] and set(periods[3:]) == {12}, ks
    assert all(k == 1 for k in ks[2:] if k)  # the probe uses k_min


def test_a_probe_that_pays_resets_the_backoff():
    policy = AdaptiveK(k_init=4, k_min=1, k_max=8, probe_every=2)
    for _ in range(12):  # useless drafts: probes back off
        k = policy.next_k()
        policy.update(k, 0, draft_ms=0.1 * k, verify_ms=10.0 * (1 + 0.1 * k))
    assert policy._probe_interval > 2
    for _ in range(30):  # the text turns repetitive: every draft token is accepted
        k = policy.next_k()
        policy.update(k, k, draft_ms=0.1 * k, verify_ms=10.0 * (1 + 0.1 * k))
    assert policy.next_k() > 1 and policy._probe_interval == 2


def test_cheap_accurate_drafts_grow_k():
    policy = AdaptiveK(k_init=2, k_max=16)
    for _ in range(10):
        k = policy.next_k()
        policy.update(k, k, draft_ms=0.01 * k, verify_ms=10.0 * (1 + 0.05 * k))
    assert policy.next_k() >= 8


def test_bad_bounds():
    with pytest.raises(ValueError):
        AdaptiveK(k_init=0)
    assert FixedK(3).next_k() == 3


def test_stats_definitions():
    stats = SpecStats()
    stats.record_round(4, 4, 1.0, 2.0)  # all accepted
    stats.record_round(4, 1, 1.0, 2.0)
    stats.record_round(0, 0, 0.0, 2.0)  # a plain decoding round is not a draft
    assert stats.num_drafts == 2 and stats.num_draft_tokens == 8 and stats.num_accepted_tokens == 5
    assert stats.mean_accepted_length == pytest.approx(1 + 5 / 2)
    assert stats.acceptance_rate == pytest.approx(5 / 8)
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.per_position_acceptance() == [1.0, 0.5, 0.5, 0.5]
    assert stats.num_target_forwards == 3
    total = SpecStats()
    total.merge(stats)
    total.merge(stats)
    assert total.accepted_per_position == [4, 2, 2, 2] and total.num_drafts == 4


def test_forward_cost_beta_worked_example():
    assert ForwardCost(24.0, 2.0, 1).beta() == pytest.approx(2 / 26)
    assert ForwardCost(24.0, 2.0, 16).beta() == pytest.approx(2 / 3.5)
    assert ForwardCost(0.0, 0.0, 4).beta() == 0.0


def _settle(policy: AdaptiveK, acceptance_per_token: float, cost: ForwardCost | None, rounds: int = 40) -> list[int]:
    """Rounds where each draft token is accepted with the given rate (deterministically, by counting)."""
    ks, credit = [], 0.0
    for _ in range(rounds):
        k = policy.next_k()
        ks.append(k)
        accepted = 0
        for _ in range(k):
            credit += acceptance_per_token
            if credit < 1:
                break
            credit -= 1
            accepted += 1
        share = 1.5 + 2.0 * (1 + k) if cost is None else cost.fixed_ms / cost.batch_size + cost.ms_per_token * (1 + k)
        policy.update(k, accepted, draft_ms=0.0, verify_ms=share, cost=cost)
    return ks


def test_a_loaded_batch_makes_mediocre_drafts_stop_but_one_session_keeps_them():
    """The docstring's example: a = 0.5 pays alone (beta 0.08) and not in a batch of 16 (beta 0.57)."""
    alone = _settle(AdaptiveK(k_init=2, k_max=8), 0.5, ForwardCost(24.0, 2.0, 1))
    loaded = _settle(AdaptiveK(k_init=2, k_max=8), 0.5, ForwardCost(24.0, 2.0, 16))
    assert all(k > 0 for k in alone[-10:]), alone
    assert sum(k == 0 for k in loaded[-16:]) >= 12, loaded  # plain decoding, but for probes
    # the prior beta (0.1) cannot tell: without the reported cost the loaded session keeps drafting
    unaware = _settle(AdaptiveK(k_init=2, k_max=8), 0.5, None)
    assert all(k > 0 for k in unaware[-10:]), unaware


def test_linear_cost_fit_waits_for_spread_then_follows_recent_forwards():
    fit = LinearCostFit(decay=0.9)
    for _ in range(5):
        fit.observe(16, 40.0)
    assert fit.estimate() is None and fit.cost(4) is None  # one batch size: no slope
    for _ in range(200):
        for tokens in (8, 16, 32):
            fit.observe(tokens, 10.0 + 3.0 * tokens)
    fixed, per_token = fit.estimate()
    assert fixed == pytest.approx(10.0, rel=1e-3) and per_token == pytest.approx(3.0, rel=1e-3)
    assert fit.cost(4) == ForwardCost(fixed, per_token, 4)
    assert LinearCostFit().estimate() is None
    noisy = LinearCostFit()  # a slope never comes out negative (noise on a flat cost): 0, and the mean
    for tokens, ms in ((8, 50.0), (32, 20.0)) * 10:
        noisy.observe(tokens, ms)
    assert noisy.estimate() == (pytest.approx(35.0, abs=0.1), 0.0)


def test_a_drafter_that_cannot_pay_at_its_measured_cost_is_never_run():
    """Prior costs (this process's engine step times) choose the first k: a draft token costing as much
    as a target step gives k = 0 from the first round, and no probe follows, since no acceptance could
    make a token that costs more than the verify time it saves pay."""
    policy = AdaptiveK(probe_every=2, max_probe_every=4)
    policy.prior_costs(draft_ms_per_token=40.0, decode_ms=38.0)
    assert not policy.could_pay()
    ks = []
    for _ in range(100):
        ks.append(policy.next_k())
        policy.update(0, 0, draft_ms=0.0, verify_ms=38.0)
    assert ks == [0] * 100


def test_a_drafter_that_could_pay_keeps_its_probes():
    """A draft token at 0.6 of a step pays only at high acceptance: k = 0 at the prior acceptance,
    but probes still run (one of them may find the acceptance that pays): perfect drafts would save
    27% of a step (k = 16: 16 * 24.5 + 40 * 2.6 = 496 ms for 17 tokens)."""
    policy = AdaptiveK(probe_every=2, max_probe_every=4)
    policy.prior_costs(draft_ms_per_token=24.5, decode_ms=40.0)
    assert policy.could_pay() and policy.next_k() == 0
    ks = []
    for _ in range(20):
        k = policy.next_k()
        ks.append(k)
        policy.update(k, 0, draft_ms=24.5 * k, verify_ms=40.0)
    assert sum(k > 0 for k in ks) >= 3


def test_a_drafter_whose_best_case_is_a_few_percent_is_not_run():
    """A bf16 self-draft at 0.7 of the target's step with verify forwards growing 14% a token: perfect
    drafts would save 15% of a step at best (k = 16), which what the costs miss eats (bench/never_costs.py
    measured 0.87-0.98x plain with such drafts on the held-out prompts): below `min_gain`, no round
    drafts, but for the one probe that checks the priors (`may_probe`), whose round times a draft token at
    what the priors said. The same drafter against a step slowed to 18 ms (memory contended) saves 34%, and
    probes."""
    fast = AdaptiveK(beta=0.14)
    fast.prior_costs(draft_ms_per_token=8.1, decode_ms=11.6)
    assert not fast.could_pay() and fast.next_k() == 0
    ks = []
    for _ in range(100):
        k = fast.next_k()
        ks.append(k)
        fast.update(k, k, draft_ms=8.1 * k, verify_ms=11.6 * (1 + 0.14 * k))
    assert sorted(ks)[-2:] == [0, 2] and ks.index(2) == fast.probe_every  # one check, after a probe's plain rounds
    slow = AdaptiveK(beta=0.14, probe_every=2)
    slow.prior_costs(draft_ms_per_token=9.0, decode_ms=18.0)
    assert slow.could_pay()
    ks = []
    for _ in range(10):
        ks.append(slow.next_k())
        slow.update(ks[-1], ks[-1], draft_ms=9.0 * ks[-1], verify_ms=18.0 * (1 + 0.14 * ks[-1]))
    assert max(ks) > 1


def test_prior_costs_stand_in_only_until_rounds_measure():
    cheap = AdaptiveK()
    cheap.prior_costs(draft_ms_per_token=4.0, decode_ms=38.0)
    assert cheap.next_k() > 0  # a cheap drafter drafts from the first round
    measured = AdaptiveK()
    measured.update(4, 4, draft_ms=4.0, verify_ms=40.0)
    k = measured.next_k()
    measured.prior_costs(draft_ms_per_token=400.0, decode_ms=38.0)  # too late: rounds measured the costs
    assert measured.next_k() == k and measured.draft_ms_per_token == pytest.approx(1.0)
    unknown = AdaptiveK()
    unknown.prior_costs(None, 38.0)  # nothing measured of the drafter: the old start
    assert unknown.next_k() == unknown.k_init and unknown.could_pay()


def _probes(outlook: Outlook | None, rounds: int = 20, catch_up_ms: float | None = None) -> int:
    """A bf16 self-draft on a CPU: 29 ms a draft token against a 22 ms step (no k pays, k = 0 from
    the start), then steps measured at 48 ms (the machine got busy): perfect drafts would now save 28%
    of a step (13.4 ms a token at k = 16), so probes are due again. How many of `rounds` rounds drafted.
    `catch_up_ms`: the drafter engine's prefill ms per token, as the prior of a catch-up token."""
    policy = AdaptiveK(probe_every=2, max_probe_every=4)
    policy.prior_costs(draft_ms_per_token=29.0, decode_ms=22.0, catch_up_ms_per_token=catch_up_ms)
    assert policy.next_k() == 0 and not policy.could_pay()
    ks = []
    for _ in range(rounds):
        k = policy.next_k()
        ks.append(k)
        policy.update(k, 0, draft_ms=29.0 * k, verify_ms=48.0, outlook=outlook)
    assert policy.could_pay()
    return sum(k > 0 for k in ks)


def test_a_probe_whose_catch_up_perfect_drafts_could_not_win_back_is_not_made():
    """Issue 30's make demo run 2: after a plain stretch, one probe made the bf16 drafter prefill the
    whole context (905 ms) for one draft token. The catch-up prior, beta of a draft step per token:
    0.1 * 29 = 2.9 ms, 80 tokens = 232 ms, against at most 13.4 ms saved per token over 15 tokens."""
    assert _probes(Outlook(catch_up_tokens=80, tokens_left=15)) == 0
    assert _probes(Outlook(catch_up_tokens=80, tokens_left=400)) >= 2
    assert _probes(Outlook(catch_up_tokens=0, tokens_left=15)) >= 2
    assert _probes(None) >= 2  # nothing known of the next round


def test_catch_up_rounds_measure_the_catch_up_cost_not_a_draft_token():
    """A catch-up round's draft time beyond its drafts' (at the known per-token cost) is the catch-up's,
    per token taken in; a free drafter (n-gram lookups) has a free catch-up, and always probes."""
    policy = AdaptiveK()
    policy.update(2, 2, draft_ms=2 * 5.0, verify_ms=30.0)
    policy.update(2, 1, draft_ms=2 * 5.0 + 40 * 1.5, verify_ms=30.0, catch_up=40)
    assert policy.draft_ms_per_token == pytest.approx(5.0) and policy.catch_up_ms() == pytest.approx(1.5)
    assert not policy.probe_pays(Outlook(catch_up_tokens=1000, tokens_left=10))
    free = AdaptiveK()
    free.update(4, 0, draft_ms=0.0, verify_ms=30.0, catch_up=50)
    assert free.catch_up_ms() == 0.0 and free.probe_pays(Outlook(catch_up_tokens=10_000, tokens_left=1))


def test_the_drafters_prefill_cost_prices_a_probes_catch_up_until_a_catch_up_round_measures_it():
    """A drafter whose prefill costs more per token than beta of its step (the int8 kernel's on a CPU):
    80 tokens to catch up at 20 ms (its prefill's cost) = 1,600 ms, against at most 100 * 13.4 = 1,340 ms
    saved: no probe, where beta's prior (2.9 ms a token: 232 ms) makes them. A measured catch-up wins."""
    assert _probes(Outlook(catch_up_tokens=80, tokens_left=100)) >= 2
    assert _probes(Outlook(catch_up_tokens=80, tokens_left=100), catch_up_ms=20.0) == 0
    assert _probes(Outlook(catch_up_tokens=0, tokens_left=100), catch_up_ms=20.0) >= 2  # nothing to catch up
    policy = AdaptiveK()
    policy.prior_costs(draft_ms_per_token=5.0, decode_ms=30.0, catch_up_ms_per_token=20.0)
    assert policy.catch_up_ms() == 20.0
    policy.update(2, 1, draft_ms=2 * 5.0 + 40 * 1.5, verify_ms=30.0, catch_up=40)
    assert policy.catch_up_ms() == pytest.approx(1.5)
    policy.prior_costs(5.0, 30.0, catch_up_ms_per_token=20.0)  # too late: a round measured it
    assert policy.catch_up_ms() == pytest.approx(1.5)


def _ahead_policy(**kwargs) -> AdaptiveK:
    policy = AdaptiveK(**kwargs)
    policy.acceptance, policy.draft_ms_per_token, policy.decode_ms, policy.beta = 0.9, 16.0, 24.0, 0.125
    return policy


def test_drafting_ahead_docstring_worked_example():
    """A drafter on cores of its own that drafts the next round while the last is verified: k = 1 hides
    most of its forward behind the verify, where drafting in turn barely beats plain decoding."""
    turns = _ahead_policy()
    assert turns.speed(1) == pytest.approx(1.9 / 43) and turns.speed(4) == pytest.approx(4.0951 / 100)
    ahead = _ahead_policy()
    ahead.set_drafting_ahead(True)
    held = 0.9**2
    assert ahead.speed(1) == pytest.approx(1.9 / (27 + held * 5 + (1 - held) * 16))
    assert ahead.speed(1) > 1.25 * turns.speed(1) and ahead._best() == 1
    assert ahead.speed(4) == pytest.approx(4.0951 / (36 + 0.9**5 * 44 + (1 - 0.9**5) * 64))


def test_drafting_ahead_takes_the_drafters_forward_cost_and_measures_what_the_model_misses():
    """Drafting ahead, a round's draft wait is not a forward's cost: d follows what the drafter reports,
    and the wait beyond the model (the Propose round trip, say) is measured as o, which prices every
    drafting round from then on; a draft that stops drafting ahead (a failover) is priced by its waits again."""
    policy = _ahead_policy(k_init=2, k_min=2, k_max=2)
    policy.set_drafting_ahead(True, forward_ms=16.0)
    for _ in range(40):  # every round held: the wait is only the 3 ms round trip; the verify slowed by the drafting
        k = policy.next_k()
        policy.set_drafting_ahead(True, forward_ms=16.0)
        policy.update(k, k, draft_ms=3.0, verify_ms=30.0 * (1 + 0.125 * k))
    assert policy.draft_ms_per_token == 16.0  # the waits did not lower it
    assert policy.decode_ms == 24.0 and policy.ahead_decode_ms == pytest.approx(30.0)  # a plain step is not slowed
    assert policy._verify_ms(0) == 24.0 and policy._verify_ms(2) == pytest.approx(30.0 * 1.25)
    assert policy.acceptance > 0.99 and policy.next_k() == k == 2
    modelled = policy._round_ms(k, policy.acceptance, overhead=False) - policy._verify_ms(k)
    assert policy.ahead_overhead_ms == pytest.approx(3.0 - modelled, abs=0.5)
    for _ in range(40):  # the waits grow by 10 ms a round: o follows, and prices drafting rounds
        k = policy.next_k()
        policy.update(k, k, draft_ms=13.0 + modelled, verify_ms=30.0 * (1 + 0.125 * k))
    assert policy.ahead_overhead_ms == pytest.approx(13.0, abs=0.5)
    assert policy._round_ms(k, 1.0) == pytest.approx(policy._round_ms(k, 1.0, overhead=False) + policy.ahead_overhead_ms)
    policy.set_drafting_ahead(False)
    policy.update(2, 2, draft_ms=2.0, verify_ms=30.0)
    assert policy.draft_ms_per_token == pytest.approx(0.7 * 16.0 + 0.3 * 1.0)
    assert policy._verify_ms(2) == pytest.approx(policy.decode_ms * 1.25)


def test_drafted_ahead_a_draft_dearer_in_turn_keeps_drafting_and_one_dearer_than_a_step_stops():
    """The first k is the prior costs'; from then on rounds drafted ahead are priced as such. A draft forward
    at 0.8 of the target's step, every token accepted: drafting in turn falls back to plain decoding,
    drafting ahead keeps drafting (most of each round's drafting hides behind its verify). A forward dearer
    than the step stops even drafted ahead: held or not, each emitted token waits for at least one."""
    def run(ahead: bool, forward_ms: float) -> list[int]:
        policy = AdaptiveK(beta=0.14)
        policy.set_drafting_ahead(ahead, forward_ms)
        ks = []
        for _ in range(30):
            k = policy.next_k()
            ks.append(k)
            if ahead:
                policy.set_drafting_ahead(True, forward_ms)
            wait = k * forward_ms if not ahead else max(0.0, (k + 1) * forward_ms - 25.0 * (1 + 0.14 * k))
            policy.update(k, k, draft_ms=wait, verify_ms=25.0 * (1 + 0.14 * k))
        return ks

    assert run(False, 20.0)[-10:] == [0] * 10
    assert min(run(True, 20.0)[-10:]) > 0
    assert run(True, 30.0)[-10:] == [0] * 10


def test_drafting_ahead_k_at_most_doubles_and_a_deeper_round_does_not_move_o():
    """The drafter drafts as far ahead as the round before drafted, so a round deeper than that waits for the
    rest of its drafts: k grows at most twofold a round, and such a round's wait is not taken for the
    overhead o (it would price every later round by a catch-up that a run of rounds at that k does not have)."""
    policy = _ahead_policy(k_init=1, k_max=16)
    policy.set_drafting_ahead(True, forward_ms=4.0)  # cheap forwards: the model's best k is far above 1
    assert policy._best() > 2
    ks, overheads = [], []
    for _ in range(6):
        k = policy.next_k()
        ks.append(k)
        policy.set_drafting_ahead(True, forward_ms=4.0)
        policy.update(k, k, draft_ms=1.0, verify_ms=24.0 * (1 + 0.125 * k))
        overheads.append(policy.ahead_overhead_ms)
    assert ks == [1, 2, 4, 8, 16, 16]
    assert overheads[:5] == [None] * 5 and overheads[5] is not None  # the first round no deeper than the one before


def test_one_rejection_after_a_long_accepted_run_does_not_collapse_k():
    """`acceptance` is the discounted share of the token verdicts: 30 tokens accepted then one rejected leave
    it near 0.9 (an average of weight 0.3 left 0.7, and k fell from 16 to 1); from the prior a first round's
    three accepted tokens lift it as quickly as before; and over a long run it tracks the true rate. (Read
    at rounds' ends, most of them just after a rejection, it reads a little low: 0.27, 0.56, 0.89 for 0.3,
    0.6, 0.9, where the average read 0.21, 0.48, 0.85.)"""
    def policy_at_costs() -> AdaptiveK:
        policy = AdaptiveK()
        policy.draft_ms_per_token, policy.decode_ms, policy.beta = 10.0, 18.0, 0.06
        return policy

    policy = policy_at_costs()
    policy.update(3, 3, 30.0, 20.0)
    assert policy.acceptance > 0.88
    for _ in range(3):
        policy.update(10, 10, 100.0, 29.0)
    assert policy.acceptance > 0.99 and policy.next_k() == policy.k_max
    policy.update(16, 15, 160.0, 35.0)
    assert 0.85 < policy.acceptance < 0.95 and policy.next_k() >= 2

    rng = random.Random(3)
    for rate in (0.3, 0.6, 0.9):
        policy, estimates = policy_at_costs(), []
        for _ in range(3000):
            accepted = 0
            while accepted < 4 and rng.random() < rate:
                accepted += 1
            policy.update(4, accepted, 40.0, 20.0)
            estimates.append(policy.acceptance)
        assert sum(estimates[500:]) / len(estimates[500:]) == pytest.approx(rate, abs=0.05)


def test_a_prior_that_shuts_the_gate_is_checked_once():
    """A Draft service's figure timed while the machine was busy (16.3 ms, where its forwards take 10)
    against an 18-20 ms target step shuts the gate (`could_pay`), and a request that decodes plainly
    drafts nothing that could correct it. One probe of two drafts is made; the drafter's figure after its
    forwards (`refresh_draft_cost`) opens the gate. A prior checked and confirmed is not probed again, and
    a prior that says perfect drafts would save nothing is never probed."""
    stale = AdaptiveK(beta=0.03)
    stale.prior_costs(draft_ms_per_token=16.3, decode_ms=20.0)
    assert not stale.could_pay() and stale.may_probe() and stale.next_k() == 0
    assert stale.plain_rounds_ahead() == stale.probe_every  # a driver's plain stretch stops for the probe
    ks = []
    for _ in range(40):
        k = stale.next_k()
        ks.append(k)
        if k:
            stale.refresh_draft_cost(10.0)  # what the drafter's engine says after the probe's forwards
        stale.update(k, k, draft_ms=10.0 * k + (30.0 if len(ks) == stale.probe_every + 1 else 0.0),
                     verify_ms=20.0 * (1 + 0.03 * k), catch_up=stale.probe_every if len(ks) == stale.probe_every + 1 else 0)
    assert ks[stale.probe_every] == 2 and sum(k > 0 for k in ks) > 25 and max(ks) > 4
    confirmed = AdaptiveK(beta=0.03)
    confirmed.prior_costs(draft_ms_per_token=16.3, decode_ms=20.0)
    ks = []
    for _ in range(100):
        k = confirmed.next_k()
        ks.append(k)
        if k:
            confirmed.refresh_draft_cost(16.3)
        confirmed.update(k, k, draft_ms=16.3 * k, verify_ms=20.0 * (1 + 0.03 * k), catch_up=8 if k else 0)
    assert sum(k > 0 for k in ks) == 1 and confirmed.plain_rounds_ahead() is None
    hopeless = AdaptiveK(beta=0.03)
    hopeless.prior_costs(draft_ms_per_token=21.0, decode_ms=20.0)
    assert not hopeless.may_probe() and hopeless.plain_rounds_ahead() is None


def test_a_probe_chosen_inside_a_plain_run_is_made_after_it():
    """A driver runs a plain stretch in one go (`plain_rounds_ahead`); the stretches it spans can end past
    the round at which the policy chose its probe, and the rounds after would choose k = 0 again: the probe
    stays due until a round asks for it (`next_k`), then it is made, whatever the drafter had. A prior's
    check (once a request) was lost so and a cluster request decoded plainly to its end."""
    for prior_ms, probe in ((9.0, 1), (16.3, 2)):  # the gate open (an ordinary probe); shut (the prior's check)
        policy = AdaptiveK(beta=0.03)
        policy.prior_costs(draft_ms_per_token=prior_ms, decode_ms=20.0)
        policy.acceptance = 0.05 if probe == 1 else policy.acceptance  # an ordinary probe: drafting does not pay
        policy._k = policy._best()
        assert policy.next_k() == 0
        ahead = policy.plain_rounds_ahead()
        assert ahead == policy.probe_every
        for _ in range(ahead + 3):  # the run goes 3 rounds past the probe
            policy.update(0, 0, draft_ms=0.0, verify_ms=20.0)
        assert policy.next_k() == probe
        policy.update(0, 0, draft_ms=0.0, verify_ms=20.0)  # the drafter had nothing: the probe is made all the same
        assert policy.next_k() == 0


def _request_ks(policy: AdaptiveK, draft_ms: float, decode_ms: float, beta: float, accepted, rounds: int = 30) -> list[int]:
    """One request's k choices at these costs, `accepted(k)` of each round's drafts accepted."""
    policy.prior_costs(draft_ms_per_token=draft_ms, decode_ms=decode_ms)
    ks = []
    for _ in range(rounds):
        k = policy.next_k()
        ks.append(k)
        if k:
            policy.refresh_draft_cost(draft_ms)
        policy.update(k, accepted(k), draft_ms=draft_ms * k, verify_ms=decode_ms * (1 + beta * k))
    return ks


def test_a_remembered_acceptance_opens_a_marginal_drafter_and_ramps_its_first_rounds():
    """A bf16 self-draft at 0.66 of the target's step (verify forwards growing 9.3% a token; perfect drafts
    save 23% of a step, below `min_gain`), accepted 95-98% (the demo's chat prompt, 2026-11-29): each request
    alone probes once and decodes plainly, where a fixed k of 8 ran 1.13x faster. Requests that start from
    the acceptance of the earlier ones (`AcceptanceMemory`) draft once it says the best k is modelled
    `min_measured_gain` faster than plain decoding; their first round drafts k_init at most, then k at most
    doubles. Without the memory every request stays plain."""
    memory = AcceptanceMemory()
    requests = [_request_ks(AdaptiveK(beta=0.093, memory=memory), 8.66, 13.0, 0.093, lambda k: k) for _ in range(4)]
    assert [sum(k > 0 for k in ks) for ks in requests[:2]] == [1, 1]  # a probe each: the memory not yet convincing
    assert sum(k > 0 for k in requests[3]) == 30 and requests[3][:3] == [4, 8, 16]
    alone = [_request_ks(AdaptiveK(beta=0.093), 8.66, 13.0, 0.093, lambda k: k) for _ in range(4)]
    assert all(sum(k > 0 for k in ks) == 1 for ks in alone)


def test_a_remembered_acceptance_keeps_a_drafter_off_whose_measured_gain_is_small():
    """The gate's own case (test_a_drafter_whose_best_case_is_a_few_percent_is_not_run: 0.7 of the step,
    verify forwards growing 14% a token), every draft accepted: at the acceptance its requests build up
    the best k is modelled under `min_measured_gain` faster, and the gate stays shut from a request's start.
    A drafter accepted half the time never drafts past the probes either."""
    memory = AcceptanceMemory()
    few_percent = [_request_ks(AdaptiveK(beta=0.14, memory=memory), 8.1, 11.6, 0.14, lambda k: k) for _ in range(4)]
    assert all(sum(k > 0 for k in ks) <= 1 for ks in few_percent)
    assert memory.acceptance is not None and memory.acceptance > 0.9
    memory = AcceptanceMemory()
    halves = [_request_ks(AdaptiveK(beta=0.093, memory=memory), 8.66, 13.0, 0.093, lambda k: k // 2) for _ in range(4)]
    assert all(sum(k > 0 for k in ks) <= 1 for ks in halves) and memory.acceptance < 0.6


def test_acceptance_memory_records_drafting_rounds_and_caps_its_weight():
    """Only rounds that drafted are recorded; the verdicts the remembered estimate stands on are capped, so a
    new request's rounds still move it: from 1.0 (8 trials), one rejection after 3 accepted brings it below 0.9."""
    memory = AcceptanceMemory(max_trials=8.0)
    assert not memory.seed(AdaptiveK())  # nothing remembered: the prior
    policy = AdaptiveK(memory=memory)
    policy.update(0, 0, draft_ms=0.0, verify_ms=10.0)
    assert memory.acceptance is None
    for _ in range(20):
        policy.update(4, 4, draft_ms=4.0, verify_ms=10.0)
    assert memory.acceptance == pytest.approx(1.0, abs=1e-3) and memory.trials == 8.0
    seeded = AdaptiveK(memory=memory)
    assert seeded.acceptance == memory.acceptance
    seeded.update(4, 3, draft_ms=4.0, verify_ms=10.0)
    assert seeded.acceptance < 0.9
