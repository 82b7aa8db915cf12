"""Drafting ahead (`ModelDrafter.draft_ahead_step`): a proposal is the one drafting without looking
ahead makes, token for token and q for q, whatever the verdict and however far ahead it got."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PairedDrafters, same_proposal

from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, make_generator
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.wire_q import RoundQ
from specmesh.models.load import load_engine

PROMPTS = [[100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3], [5, 17, 33, 5, 17, 33, 5, 17]]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=40),
    "standard": SamplingParams(temperature=0.8, top_k=0, seed=3, ignore_eos=True, max_new_tokens=40,
                               acceptance_rule=AcceptanceRule.STANDARD),
    "coupled": SamplingParams(temperature=0.8, top_k=0, seed=3, ignore_eos=True, max_new_tokens=40,
                              acceptance_rule=AcceptanceRule.COUPLED),
}


@pytest.fixture(scope="module", params=["fast path", "torch path"])
def engines(tiny_model_dir, request):
    """The draft engine on the CPU fast path (its steps equal its chains: drafting ahead keeps the guess
    forward's KV) and on the torch path (the guess forward is truncated and fed again)."""
    target_dir = tiny_model_dir("llama", init_std=0.2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECMESH_FASTPATH", "1" if request.param == "fast path" else "0")
        draft = load_engine(target_dir, dtype="float32")
    assert draft.steps_equal_chains == (request.param == "fast path")
    return {"target": load_engine(target_dir, dtype="float64"), "draft": draft}


_same = same_proposal


class Shadowed(PairedDrafters):
    """A ModelDrafter that drafts ahead after every proposal (a number of forwards that changes from
    round to round, to a depth that does too), each proposal checked against a drafter that never does."""

    def __init__(self, engine, q_transform=None):
        super().__init__(ModelDrafter(engine, q_transform), ModelDrafter(engine, q_transform))
        self.ahead = self.mine

    def after(self, state, k, params, generator):
        rounds = self.num_proposals
        forwards, depth = rounds % (k + 4), max(1, k + rounds % 3 - 1)  # 0 .. k + 3; k - 1 .. k + 1
        for _ in range(forwards):
            self.ahead.draft_ahead_step([state], [depth], [params], [generator])


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_decoding_with_drafts_ahead_equals_without(engines, mode, k):
    verifier = TargetVerifier(engines["target"])
    params = PARAMS[mode]
    shadowed = Shadowed(engines["draft"])
    for prompt in PROMPTS:
        with_ahead = generate(verifier, shadowed, prompt, params, k_policy=FixedK(k))
        without = generate(verifier, ModelDrafter(engines["draft"]), prompt, params, k_policy=FixedK(k))
        assert with_ahead.token_ids == without.token_ids
    assert shadowed.ahead.ahead_served > 0  # drafts ahead were served, not only dropped
    assert engines["draft"].kv_usage().free_blocks == engines["draft"].kv_usage().total_blocks  # every session's KV freed


def test_q_rounded_for_the_wire_is_the_same_ahead(engines):
    verifier = TargetVerifier(engines["target"])
    shadowed = Shadowed(engines["draft"], RoundQ(torch.bfloat16))
    result = generate(verifier, shadowed, PROMPTS[0], PARAMS["standard"], k_policy=FixedK(3))
    assert result.stats.num_draft_tokens > 0 and shadowed.ahead.ahead_served > 0
    assert shadowed.ahead.ahead_dropped > 0  # misses put the generator back


def test_batched_proposals_mix_hits_misses_and_sessions_without_drafts_ahead(engines):
    """Three sessions drafted together each round: one always served from its drafts ahead (its
    verdict is built to be a hit), one whose drafts ahead always miss, one never drafting ahead."""
    engine = engines["draft"]
    if not engine.steps_equal_chains:  # its rows change in the last bits with the batch they ride in
        pytest.skip("q for q only where a row's numbers do not depend on its batch (the CPU fast path)")
    ahead, plain = ModelDrafter(engine), ModelDrafter(engine)
    params = [PARAMS["standard"]] * 3
    ahead_states = [ahead.open(PROMPTS[i % 2]) for i in range(3)]
    plain_states = [plain.open(PROMPTS[i % 2]) for i in range(3)]
    ahead_gens = [make_generator(10 + i, engine.device)[0] for i in range(3)]
    plain_gens = [make_generator(10 + i, engine.device)[0] for i in range(3)]
    accepted = [[], [], []]
    for round_ in range(6):
        k = [3, 2 + round_ % 3, 4]
        mine = ahead.propose_many(ahead_states, accepted, k, params, ahead_gens)
        theirs = plain.propose_many(plain_states, accepted, k, params, plain_gens)
        for m, t in zip(mine, theirs):
            _same(m, t)
        for _ in range(round_ % 4 + 1):
            ahead.draft_ahead_step(ahead_states[:2], [4, 4], params[:2], ahead_gens[:2])
        guess = ahead_states[0].ahead.guess
        accepted = [[*mine[0].token_ids, guess],  # every draft and the guess: a hit
                    [*mine[1].token_ids[:1], (mine[1].token_ids[1] + 1) % engine.vocab_size],  # a miss
                    [*mine[2].token_ids, 7]]
    assert ahead.ahead_served > 0 and ahead.ahead_dropped > 0
    for state, generator in zip(ahead_states, ahead_gens):
        ahead.drop_ahead(state, generator)
        assert engine.seq_len(state.seq_id) == state.base_len + state.num_drafted - 1
        ahead.close(state)
    for state in plain_states:
        plain.close(state)
    assert engine.kv_usage().free_blocks == engine.kv_usage().total_blocks


def test_drafts_ahead_stop_at_the_context_window(engines):
    engine = engines["draft"]
    drafter = ModelDrafter(engine)
    state = drafter.open([1 + i % 300 for i in range(engine.max_context - 4)])
    generator = make_generator(0, engine.device)[0]
    params = PARAMS["greedy"]
    proposal = drafter.propose(state, [], 2, params, generator)
    forwards = 0
    while drafter.wants_ahead(state, 8):
        drafter.draft_ahead_step([state], [8], [params], [generator])
        forwards += 1
    assert forwards == 2  # the guess, then one draft: the context ends after it
    assert engine.seq_len(state.seq_id) <= engine.max_context
    nxt = drafter.propose(state, [*proposal.token_ids, state.ahead.guess], 4, params, generator)
    assert len(nxt.token_ids) == 1 and drafter.ahead_served == 1
    drafter.close(state)


def test_where_steps_equal_chains_the_first_draft_ahead_feeds_the_guess_alone(engines):
    """After the guess forward (the last draft fed alone), the first draft ahead feeds the guess alone
    where the engine's steps equal its chains (the KV of the last draft stays), else the last draft and
    the guess again; later drafts feed one token either way."""
    engine = engines["draft"]
    drafter = ModelDrafter(engine)
    state = drafter.open(PROMPTS[0])
    generator = make_generator(5, engine.device)[0]
    drafter.propose(state, [], 3, PARAMS["greedy"], generator)
    fed: list[list[int]] = []
    forward = engine.forward

    def counting(batch):
        fed.append([len(item.token_ids) for item in batch])
        return forward(batch)

    engine.forward = counting
    try:
        for _ in range(3):
            drafter.draft_ahead_step([state], [3], [PARAMS["greedy"]], [generator])
    finally:
        del engine.forward
    assert fed == ([[1], [1], [1]] if engine.steps_equal_chains else [[1], [2], [1]])
    drafter.close(state)


def test_each_proposal_says_whether_the_verdict_was_the_guess_drafted_ahead_from(engines):
    """`guess_held` (the Draft service's hit rate reads it): True when the tokens brought are the last
    proposal and the guess, False when they differ, None when nothing was drafted ahead."""
    engine = engines["draft"]
    drafter = ModelDrafter(engine)
    states = [drafter.open(PROMPTS[0]) for _ in range(3)]
    generators = [make_generator(7, engine.device)[0] for _ in range(3)]
    params = [PARAMS["greedy"]] * 3
    first = drafter.propose_many(states, [[], [], []], [3, 3, 3], params, generators)
    drafter.draft_ahead_step(states[:2], [3, 3], params[:2], generators[:2])  # the guess forward only
    guess = states[0].ahead.guess
    accepted = [[*first[0].token_ids, guess], [*first[1].token_ids, (guess + 1) % engine.vocab_size],
                [*first[2].token_ids, guess]]
    drafter.propose_many(states, accepted, [3, 3, 3], params, generators)
    assert [s.guess_held for s in states] == [True, False, None]
    for state in states:
        drafter.close(state)


@pytest.mark.parametrize("mode", list(PARAMS))
def test_a_prompt_prefilled_at_open_gives_the_same_proposals(engines, mode):
    """`ModelDrafter.prefill` (a drafting-ahead Draft service's OpenSession): the prompt but its last token
    goes into the KV at once, and every proposal after is the one a drafter that fed it with its first
    proposal makes; a state with a draft outstanding is left alone."""
    engine = engines["draft"]
    early, lazy = ModelDrafter(engine), ModelDrafter(engine)
    params = PARAMS[mode]
    for prompt in PROMPTS:
        mine, theirs = early.open(prompt), lazy.open(prompt)
        early.prefill([mine])
        assert mine.pending == prompt[-1:] and engine.seq_len(mine.seq_id) == len(prompt) - 1
        if not engine.steps_equal_chains:  # the prompt in two forwards instead of one: the last bits may move
            early.close(mine)
            lazy.close(theirs)
            pytest.skip("proposal for proposal only where a chain's numbers equal its steps' (the CPU fast path)")
        generators = [make_generator(4, engine.device)[0] for _ in range(2)]
        accepted: list[int] = [77]  # the target's first token
        for k in (3, 1, 4):
            a = early.propose(mine, accepted, k, params, generators[0])
            b = lazy.propose(theirs, accepted, k, params, generators[1])
            _same(a, b)
            early.prefill([mine])  # a draft outstanding: nothing to do
            assert mine.num_drafted == k
            accepted = [*a.token_ids[:2], 5]
        early.close(mine)
        lazy.close(theirs)
    assert engine.kv_usage().free_blocks == engine.kv_usage().total_blocks
