"""Adaptive k: the worked example of the docstring, the fall back to plain decoding, and probing."""

import pytest

from specmesh.decoding.adaptive import AdaptiveK, FixedK, expected_tokens
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


def test_useless_drafts_fall_back_to_plain_decoding_then_probe():
    policy = AdaptiveK(k_init=4, k_min=1, k_max=8, probe_every=3)
    ks = []
    for _ in range(12):
        k = policy.next_k()
        ks.append(k)
        policy.update(k, 0, draft_ms=5.0 * k, verify_ms=10.0 * (1 + 0.1 * k))
    assert ks[0] == 4
    assert 0 in ks, ks
    zero_runs = "".join("0" if k == 0 else "x" for k in ks[1:]).split("x")
    assert max(len(run) for run in zero_runs) <= 3  # a probe round at least every probe_every rounds
    assert any(k == 1 for k in ks[2:])  # the probe uses k_min


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
