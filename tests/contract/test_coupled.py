"""The coupled acceptance rule (the default) as a client in another language meets it: with a seed
(and the rule unspecified, or COUPLED), a session's tokens are Verify.Generate's tokens of that seed
whatever it is drafted, how (no q, no deterministic flag needed) and in how many rounds; a session
re-opened on the prompt and the tokens so far (a replay on another replica) goes on with the same
tokens."""

from __future__ import annotations

import grpc
from contract_helpers import PROMPT_A, PROMPT_B, SAMPLED, assert_code, repeat_last

SEED = 2**64 - 3  # all 64 bits of a seed count
N = 24


def _junk(k: int):
    """A drafter that is mostly wrong: shifted copies of the last tokens (never one-hot-flagged)."""
    return lambda tokens: [(t * 7 + 3) % 256 for t in tokens[-k:]]


def test_every_way_of_drafting_gives_generates_tokens(wire):
    params = dict(SAMPLED, seed=SEED, max_new_tokens=N)
    expected, _ = wire.generate(PROMPT_B, **params)
    assert len(expected) == N
    for draft_fn in (repeat_last(1), repeat_last(4), _junk(3), lambda tokens: []):
        loop = wire.verify_loop(wire.open(PROMPT_B, **params), draft_fn)
        assert loop.tokens == expected
    coupled = wire.pb.common.ACCEPTANCE_RULE_COUPLED
    assert wire.verify_loop(wire.open(PROMPT_B, **params, acceptance_rule=coupled), _junk(2)).tokens == expected
    for k in (1, 5):  # the service's own fused drafter
        assert wire.step_loop(wire.open(PROMPT_B, **params), k=k).tokens == expected


def test_a_replay_from_any_point_goes_on_with_the_same_tokens(wire):
    params = dict(SAMPLED, seed=SEED)
    expected, _ = wire.generate(PROMPT_A, **params, max_new_tokens=N)
    for cut in (1, 9, 17):
        replay = wire.verify_loop(wire.open(PROMPT_A + expected[:cut], **params, max_new_tokens=N - cut), repeat_last(3))
        assert replay.tokens == expected[cut:]


def test_the_standard_rule_differs_and_an_unknown_rule_is_refused(wire):
    params = dict(SAMPLED, seed=SEED, max_new_tokens=N)
    standard, _ = wire.generate(PROMPT_B, **params, acceptance_rule=wire.pb.common.ACCEPTANCE_RULE_STANDARD)
    assert standard != wire.generate(PROMPT_B, **params)[0]
    assert_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: wire.open(PROMPT_B, **params, acceptance_rule=7))
