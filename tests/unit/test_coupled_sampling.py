"""The coupled rule (`specmesh.decoding.coupled`): exact in distribution, reproducible by position.

Statistics: the target and the drafter are Markov chains over a 5-token vocabulary (the next-token
distribution is a row of P resp. Q picked by the previous token), so p and q depend on the drafted
context like a real model's do. Each trial is a seed; speculative rounds of k = 3 run through the
production acceptance (`accept_batch`, coupled sessions) until three tokens exist, and the joint
distribution of the three over 8,000 seeds is compared with a chi-square test to the target
chain's. Broken rules run on the same harness and must fail it: one noise for every position, an
off-by-one in the rows' positions, and noise keyed by the row's index in its round instead of its
position in the sequence. A drafter with noise of its own is NOT a broken rule: it stays exact (the
verifier's tokens never depend on the draft), only its acceptance drops; that is tested too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specmesh.decoding.acceptance import accept_batch
from specmesh.decoding.coupled import (
    coupled_agreement,
    coupled_sample,
    exponential_noise,
    noise_rows,
    position_uniforms,
    row_positions,
    sample_at,
    standard_agreement,
    verify_coupled,
)
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, processed_probs, resolve_seed
from specmesh.decoding.types import FinalTokenKind

VOCAB_SIZE = 5
START = 0
K = 3
NUM_TOKENS = 3
NUM_TRIALS = 8_000
MIN_P_VALUE = 0.001
COUPLED = SamplingParams(temperature=1.0, acceptance_rule=AcceptanceRule.COUPLED)

P = torch.tensor([
    [0.10, 0.40, 0.25, 0.15, 0.10],
    [0.30, 0.05, 0.30, 0.25, 0.10],
    [0.20, 0.20, 0.20, 0.20, 0.20],
    [0.45, 0.10, 0.15, 0.30, 0.00],
    [0.05, 0.15, 0.50, 0.10, 0.20],
])
Q = torch.tensor([  # close to P in places, far in others, zero where P is not (and vice versa)
    [0.30, 0.10, 0.30, 0.00, 0.30],
    [0.25, 0.10, 0.35, 0.20, 0.10],
    [0.05, 0.60, 0.05, 0.25, 0.05],
    [0.40, 0.10, 0.10, 0.20, 0.20],
    [0.20, 0.20, 0.20, 0.20, 0.20],
])
DRAFT_NOISE_SALT = 0x1234_5678  # an independent drafter: its noise comes from seed ^ this


def draft_tokens(seed: int, context: list[int], k: int, noise_seed: int | None = None, same_position: bool = False) -> list[int]:
    """k draft tokens from the Q chain, each the coupled sample at its absolute position."""
    drafts: list[int] = []
    prev = context[-1]
    for j in range(k):
        position = 0 if same_position else len(context) + j
        prev = int(sample_at(Q[prev][None], seed if noise_seed is None else noise_seed, [position])[0])
        drafts.append(prev)
    return drafts


def target_rows(context: list[int], drafts: list[int]) -> torch.Tensor:
    """[k + 1, vocab] the target chain's logits after the pending token and after each draft token."""
    previous = [context[-1], *drafts]
    return torch.log(P[previous])


def coupled_round(seed: int, context: list[int], drafts: list[int]) -> list[int]:
    """The production rule for one trial (`coupled_rounds`)."""
    return coupled_rounds([seed], [context], [drafts])[0]


def coupled_rounds(seeds: list[int], contexts: list[list[int]], drafts: list[list[int]]) -> list[list[int]]:
    """The production rule: ONE `accept_batch` over every trial's coupled session, whose row 0 samples
    position len(context)."""
    outcomes = accept_batch([target_rows(c, d) for c, d in zip(contexts, drafts)], [DraftProposal(d) for d in drafts],
                            [resolve_seed(COUPLED, seed) for seed in seeds], [torch.Generator()] * len(seeds),
                            [len(c) for c in contexts])
    return [outcome.token_ids for outcome in outcomes]


def per_trial(rule):
    """A one-trial rule as a batch rule."""
    def rounds(seeds, contexts, drafts):
        return [rule(*args) for args in zip(seeds, contexts, drafts)]
    return rounds


def off_by_one_position(seed: int, context: list[int], drafts: list[int]) -> list[int]:
    """BROKEN: row j >= 1 samples with the noise of the position before its own (an off-by-one in the
    positions), so consecutive tokens share noise."""
    p = P[[context[-1], *drafts]]
    positions = [len(context) + max(j - 1, 0) for j in range(p.shape[0])]
    return verify_coupled(drafts, coupled_sample(p, noise_rows(seed, positions, VOCAB_SIZE)).tolist()).token_ids


def round_relative_position(seed: int, context: list[int], drafts: list[int]) -> list[int]:
    """BROKEN: the noise keyed by the row's index in the round, not its position in the sequence, so
    every round reuses the noise of the last."""
    p = P[[context[-1], *drafts]]
    positions = list(range(p.shape[0]))
    return verify_coupled(drafts, coupled_sample(p, noise_rows(seed, positions, VOCAB_SIZE)).tolist()).token_ids


def one_noise_for_every_position(seed: int, context: list[int], drafts: list[int]) -> list[int]:
    """BROKEN: the coupled walk, but every row sampled with the noise of position 0."""
    p = P[[context[-1], *drafts]]
    target = coupled_sample(p, noise_rows(seed, [0] * p.shape[0], VOCAB_SIZE)).tolist()
    return verify_coupled(drafts, target).token_ids


def run_trials(rounds, drafter=draft_tokens, num_trials: int = NUM_TRIALS) -> tuple[list[tuple[int, ...]], int, int]:
    """(the first NUM_TOKENS tokens of each seed's generation, draft tokens offered, accepted); the
    trials step in lock-step, one batch rule call per round."""
    contexts = [[START] for _ in range(num_trials)]
    offered = accepted = 0
    while True:
        live = [b for b, c in enumerate(contexts) if len(c) < 1 + NUM_TOKENS]
        if not live:
            break
        drafts = [drafter(b, contexts[b], K) for b in live]
        emitted = rounds(live, [contexts[b] for b in live], drafts)
        for b, d, e in zip(live, drafts, emitted):
            offered += len(d)
            accepted += len(e) - 1
            contexts[b].extend(e)
    return [tuple(c[1:1 + NUM_TOKENS]) for c in contexts], offered, accepted


def chain_joint() -> dict[tuple[int, ...], float]:
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        joint = {(*path, t): prob * float(P[path[-1] if path else START, t])
                 for path, prob in joint.items() for t in range(VOCAB_SIZE) if P[path[-1] if path else START, t] > 0}
    return joint


def chi_square_p_value(samples: list[tuple[int, ...]]) -> float:
    expected = chain_joint()
    counts = dict.fromkeys(expected, 0)
    for sample in samples:
        assert sample in counts, f"{sample} has probability 0 under the target"
        counts[sample] += 1
    cells = sorted(expected, key=expected.get, reverse=True)
    observed = [counts[c] for c in cells]
    wanted = [expected[c] * len(samples) for c in cells]
    big = [i for i, w in enumerate(wanted) if w >= 5]
    small = [i for i, w in enumerate(wanted) if w < 5]  # pooled: the test needs >= 5 expected per cell
    obs = [observed[i] for i in big] + ([sum(observed[i] for i in small)] if small else [])
    exp = [wanted[i] for i in big] + ([sum(wanted[i] for i in small)] if small else [])
    assert len(big) >= 40  # the test has power: many well-populated cells
    return float(chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue)


@pytest.fixture(scope="module")
def coupled_trials():
    return run_trials(coupled_rounds)


def test_the_coupled_rule_follows_the_target_chain(coupled_trials):
    samples, offered, accepted = coupled_trials
    assert chi_square_p_value(samples) > MIN_P_VALUE
    assert 0.2 < accepted / offered < 0.9  # drafts are judged, not rubber-stamped or all refused


def test_the_first_draft_token_is_accepted_as_often_as_the_gumbel_coupling_predicts():
    """P(accept) = sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) at the first position (4 sigma)."""
    p, q = P[START], Q[START]
    seeds = list(range(NUM_TRIALS))
    drafts = [draft_tokens(seed, [START], 1) for seed in seeds]
    hits = sum(len(e) == 2 for e in coupled_rounds(seeds, [[START]] * NUM_TRIALS, drafts))
    want = coupled_agreement(p, q)
    assert abs(hits / NUM_TRIALS - want) < 4 * math.sqrt(want * (1 - want) / NUM_TRIALS)
    # the price of reproducibility: below the standard rule's 1 - TV, above the coupling bound
    tv = 1 - standard_agreement(p, q)
    assert (1 - tv) / (1 + tv) <= want < 1 - tv


def test_a_drafter_with_noise_of_its_own_is_still_exact_but_accepted_less(coupled_trials):
    def independent(seed, context, k):
        return draft_tokens(seed, context, k, noise_seed=seed ^ DRAFT_NOISE_SALT)

    samples, offered, accepted = run_trials(coupled_rounds, independent)
    assert chi_square_p_value(samples) > MIN_P_VALUE
    # the same seeds give the same target tokens whatever the draft: the output is drafter-invariant
    assert samples == coupled_trials[0]
    assert accepted / offered < coupled_trials[2] / coupled_trials[1] - 0.05


@pytest.mark.parametrize("broken", [one_noise_for_every_position, off_by_one_position, round_relative_position])
def test_broken_rules_fail_the_same_test(broken):
    def drafter(seed, context, k):  # drafts with the noise the broken target uses
        return draft_tokens(seed, context, k, same_position=broken is one_noise_for_every_position)

    samples, _, _ = run_trials(per_trial(broken), drafter)
    assert chi_square_p_value(samples) < 1e-6


def test_noise_is_a_pure_function_of_seed_and_position():
    a = position_uniforms(2**64 - 1, 12, 1000)
    assert (a == position_uniforms(2**64 - 1, 12, 1000)).all()
    assert not (a == position_uniforms(2**64 - 1, 13, 1000)).any()  # every position its own noise
    assert not (a == position_uniforms(2**64 - 2, 12, 1000)).any()  # every seed its own noise
    assert (position_uniforms(5, 12, 10) == position_uniforms(5, 12, 1000)[:10]).all()  # a prefix of the wider row
    assert ((a > 0) & (a < 1)).all()
    # all 64 bits of the seed count (torch's CPU generator reads only 32 of them); a fresh Philox agrees
    assert (np.random.Philox(key=np.array([12, 34], dtype=np.uint64)).random_raw(6) >> np.uint64(12) ==
            ((position_uniforms(12, 34, 6) * 2.0**52) - 0.5).astype(np.uint64)).all()
    assert not (position_uniforms(1, 0, 8) == position_uniforms(1 + 2**32, 0, 8)).any()
    with pytest.raises(ValueError):
        position_uniforms(2**64, 0, 4)
    e = exponential_noise(9, 3, 16)
    assert e.dtype == torch.float64 and bool((e > 0).all()) and torch.isfinite(e).all()
    # the same numbers as a fresh computation, also once cached
    assert torch.equal(exponential_noise(9, 3, 16), torch.from_numpy(-np.log(position_uniforms(9, 3, 16))))


def test_coupled_sample_is_gumbel_max_and_never_picks_a_masked_token():
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0]] * 64)
    noise = noise_rows(3, list(range(64)), 4)
    ids = coupled_sample(probs, noise)
    assert set(ids.tolist()) <= {1, 2}
    gumbel = -torch.log(noise)
    log_p = torch.log(probs.double())
    assert torch.equal(ids, (log_p + gumbel).argmax(dim=-1))


def test_row_positions_of_chains_and_trees():
    assert row_positions(7, None, 0) == [7]
    assert row_positions(7, None, 2) == [7, 8, 9]
    assert row_positions(7, [-1, -1, 1], 3) == [7, 8, 8, 9]


def test_a_round_emits_the_target_tokens_of_plain_sampling_whatever_was_drafted():
    """Plain sampling's tokens y at positions 4.. ; a draft that agrees on the first two is kept up
    to them, then y; a draft wrong at once gives y alone; an empty draft (plain decoding) gives y."""
    context = [START, 2, 3, 1]
    seed = 41
    plain, prefix = [], list(context)
    for _ in range(4):
        plain.append(coupled_round(seed, prefix, [])[0])
        prefix.append(plain[-1])
    assert coupled_round(seed, context, plain[:3]) == plain[:4]
    assert coupled_round(seed, context, [plain[0], plain[1], (plain[2] + 1) % VOCAB_SIZE]) == plain[:3]
    wrong = (plain[0] + 1) % VOCAB_SIZE
    outcome = accept_batch([target_rows(context, [wrong])], [DraftProposal([wrong])], [resolve_seed(COUPLED, seed)],
                           [torch.Generator()], [len(context)])[0]
    assert outcome.token_ids == plain[:1] and outcome.final_kind is FinalTokenKind.RECOVERED


def test_trees_take_the_branch_that_equals_the_target_token():
    context = [START, 4]
    seed = 5
    y0 = coupled_round(seed, context, [])[0]
    y1 = coupled_round(seed, [*context, y0], [])[0]
    other = (y0 + 1) % VOCAB_SIZE
    # root -> other (rejected), root -> y0 -> y1: the second branch is walked to its end, then the bonus
    proposal = DraftProposal([other, y0, y1], parents=[-1, -1, 1])
    previous = [context[-1], other, y0, y1]
    outcome = accept_batch([torch.log(P[previous])], [proposal], [resolve_seed(COUPLED, seed)], [torch.Generator()],
                           [len(context)])[0]
    assert outcome.accepted_nodes == [1, 2] and outcome.accepted_token_ids == [y0, y1]
    assert outcome.final_kind is FinalTokenKind.BONUS
    assert outcome.final_token_id == coupled_round(seed, [*context, y0, y1], [])[0]


def test_a_batch_gives_each_session_what_it_gets_alone():
    """Sessions of every kind in one call: coupled ones judged by their own seed and position, greedy
    and standard ones as before (the standard session draws from its generator)."""
    context = [START, 1, 2]
    rows = target_rows(context, [3, 0])
    standard = SamplingParams(temperature=1.0, acceptance_rule=AcceptanceRule.STANDARD)
    params = [COUPLED, SamplingParams(temperature=0.0), standard, SamplingParams(temperature=1.0, seed=8)]
    generators = [torch.Generator().manual_seed(s) for s in range(4)]
    together = accept_batch([rows] * 4, [DraftProposal([3, 0])] * 4, params, generators, [3, 3, 3, 9])
    for b in range(4):
        alone = accept_batch([rows], [DraftProposal([3, 0])], [params[b]], [torch.Generator().manual_seed(b)],
                             [[3, 3, 3, 9][b]])[0]
        assert together[b].token_ids == alone.token_ids
    # a coupled session whose params carry no seed uses its generator's
    assert together[0].token_ids == accept_batch([rows], [DraftProposal([3, 0])], [resolve_seed(COUPLED, 0)],
                                                 [torch.Generator()], [3])[0].token_ids
    with pytest.raises(ValueError, match="positions"):
        accept_batch([rows], [DraftProposal([3, 0])], [COUPLED], [torch.Generator()])


def test_the_default_rule_is_coupled_and_greedy_stays_greedy():
    assert SamplingParams(temperature=1.0).rule is AcceptanceRule.COUPLED
    assert SamplingParams(temperature=1.0, seed=3).is_coupled
    assert SamplingParams(temperature=1.0, seed=3, acceptance_rule=AcceptanceRule.STANDARD).rule is AcceptanceRule.STANDARD
    unseeded = resolve_seed(SamplingParams(temperature=1.0))
    assert unseeded.seed is not None and unseeded.acceptance_rule is AcceptanceRule.COUPLED  # explicit on the wire
    assert not SamplingParams(temperature=0.0, seed=3).is_coupled  # greedy stays greedy
    assert not SamplingParams(temperature=1.0).needs_q
    assert SamplingParams(temperature=1.0, acceptance_rule=AcceptanceRule.STANDARD).needs_q
    with pytest.raises(ValueError, match="acceptance_rule"):
        SamplingParams(acceptance_rule="coupled").validate()  # type: ignore[arg-type]


def test_processed_distributions_are_what_is_sampled():
    """Top-k / top-p rows: the coupled sample never leaves the processed support."""
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=1)
    probs = processed_probs(logits, params)
    ids = sample_at(probs, 1, list(range(200)))
    assert bool((probs[torch.arange(200), ids] > 0).all())
