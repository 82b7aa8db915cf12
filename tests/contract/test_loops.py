"""Speculation loops a client runs over the wire give exactly what Verify.Generate gives."""

from __future__ import annotations

import pytest
from contract_helpers import GREEDY, PROMPT_A, PROMPT_B, SAMPLED, repeat_last


@pytest.mark.parametrize("prompt", [PROMPT_A, PROMPT_B])
def test_propose_verify_loop_equals_generate(wire, prompt):
    """Greedy: Draft.Propose (the same tiny model) + Verify, round after round, token for token."""
    expected, finish = wire.generate(prompt, **GREEDY, max_new_tokens=30)
    loop = wire.draft_loop(prompt, k=4, **GREEDY, max_new_tokens=30)
    assert loop.tokens == expected
    assert loop.finish_reason == finish == wire.pb.common.FINISH_REASON_LENGTH
    assert sum(r.num_accepted_tokens for r in loop.responses) > 0  # the drafter's tokens were used


@pytest.mark.parametrize("prompt", [PROMPT_A, PROMPT_B])
def test_step_loop_equals_generate(wire, prompt):
    """Greedy: Step with the service's fused drafter (n-gram by default) is plain decoding, faster."""
    assert wire.info().fused_drafter == "ngram"
    expected, finish = wire.generate(prompt, **GREEDY, max_new_tokens=30)
    loop = wire.step_loop(wire.open(prompt, **GREEDY, max_new_tokens=30), k=4)
    assert loop.tokens == expected
    assert loop.finish_reason == finish


@pytest.mark.parametrize("max_new_tokens", [2, 13])
def test_service_caps_k_greedy(wire, max_new_tokens):
    """A client that always sends k = 4 gets exactly max_new_tokens tokens: the service caps k."""
    expected, _ = wire.generate(PROMPT_A, **GREEDY, max_new_tokens=max_new_tokens)
    loop = wire.verify_loop(wire.open(PROMPT_A, **GREEDY, max_new_tokens=max_new_tokens), repeat_last(4))
    assert len(loop.tokens) == max_new_tokens
    assert loop.tokens == expected
    assert loop.finish_reason == wire.pb.common.FINISH_REASON_LENGTH


@pytest.mark.parametrize("seed", [0, 7])
def test_service_caps_k_sampled_equals_generate(wire, seed):
    """Seeded sampling, k = 4 deterministic drafts every round: exactly Generate's tokens (same seed)."""
    params = dict(SAMPLED, seed=seed, max_new_tokens=13)
    expected, _ = wire.generate(PROMPT_B, **params)
    loop = wire.verify_loop(wire.open(PROMPT_B, **params), repeat_last(4), deterministic_draft=True)
    assert len(loop.tokens) == 13
    assert loop.finish_reason == wire.pb.common.FINISH_REASON_LENGTH
    assert loop.tokens == expected
