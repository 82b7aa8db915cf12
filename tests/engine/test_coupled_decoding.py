"""The coupled rule on the real engine: a seeded request's tokens are autoregressive decoding's with
that seed, whatever the drafter, k (fixed or adaptive), batch, fork or replay (tiny random models).

The standard rule, kept for comparison, reads its generator round by round: its tokens change with k.
"""

from __future__ import annotations

import asyncio

import pytest

from specmesh.cascade.pipeline import CascadeDrafter
from specmesh.cascade.plan import StageSpec
from specmesh.cascade.stage_model import StageModel
from specmesh.decoding.adaptive import AdaptiveK, FixedK
from specmesh.decoding.async_driver import generate_async
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, make_generator
from specmesh.decoding.speculative import draft_seed, generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramStoreDrafter, PromptLookupDrafter

PROMPT = [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3]
COUPLED = dict(acceptance_rule=AcceptanceRule.COUPLED)
SAMPLINGS = {
    "t1": dict(temperature=1.0, seed=3),
    "t0.7-top_p": dict(temperature=0.7, top_p=0.9, seed=5),
    "t1.3-top_k": dict(temperature=1.3, top_k=30, seed=2**64 - 1),
}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from specmesh.models.load import load_engine

    target_dir = tiny_model_dir("llama", init_std=0.2)
    return {
        "target": load_engine(target_dir, dtype="float64"),
        "same": load_engine(target_dir, dtype="float64"),  # the target's own model: agrees everywhere
        "self": load_engine(target_dir, dtype="float32"),  # self-draft at lower precision
        "other": load_engine(tiny_model_dir("llama", seed=1, init_std=0.2), dtype="float64"),  # unrelated
    }


def _drafter(kind: str, engines):
    return {
        "self": lambda: ModelDrafter(engines["self"]),
        "other": lambda: ModelDrafter(engines["other"]),
        "ngram": lambda: PromptLookupDrafter(1, 3),
        "ngram-tree": lambda: NgramStoreDrafter(1, 3, max_branching=2),
        "cascade": lambda: CascadeDrafter(ModelDrafter(engines["other"]), [StageModel(engines["self"])], [StageSpec(1)]),
    }[kind]()


def _params(sampling: str, max_new_tokens: int = 40, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **{**SAMPLINGS[sampling], **extra})


@pytest.fixture(scope="module")
def autoregressive(engines):
    """Target-only decoding of PROMPT per sampling, the reference of every test (the default rule is
    the coupled one)."""
    verifier = TargetVerifier(engines["target"])
    return {name: generate(verifier, None, PROMPT, _params(name)).token_ids for name in SAMPLINGS}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("drafter_kind", ["self", "other", "ngram", "ngram-tree", "cascade"])
@pytest.mark.parametrize("k", [1, 3, 8, "adaptive"])
def test_speculative_tokens_are_the_autoregressive_tokens(engines, autoregressive, drafter_kind, k, sampling):
    policy = AdaptiveK() if k == "adaptive" else FixedK(k)
    result = generate(TargetVerifier(engines["target"]), _drafter(drafter_kind, engines), PROMPT, _params(sampling),
                      k_policy=policy, plain_stretches=k == "adaptive")
    assert result.token_ids == autoregressive[sampling]
    assert not result.lossy


def test_the_explicit_rule_equals_the_seeded_default_and_the_drafter_agrees_at_every_position(engines, autoregressive):
    """A drafter on the target's own model samples each position with the target's noise, so every
    draft token is accepted: the drafter and the verifier agree on every absolute position."""
    params = _params("t1", **COUPLED)
    result = generate(TargetVerifier(engines["target"]), ModelDrafter(engines["same"]), PROMPT, params, k_policy=FixedK(4))
    assert result.token_ids == autoregressive["t1"]
    assert result.stats.num_accepted_tokens == result.stats.num_draft_tokens > 0


def test_model_drafts_carry_no_q_under_the_coupled_rule(engines):
    drafter = ModelDrafter(engines["self"])
    state = drafter.open(PROMPT)
    generator = make_generator(draft_seed(3))[0]
    coupled = drafter.propose(state, [], 3, _params("t1"), generator)
    assert coupled.num_tokens == 3 and coupled.q is None
    drafter.close(state)
    state = drafter.open(PROMPT)
    standard = drafter.propose(state, [], 3, _params("t1", acceptance_rule=AcceptanceRule.STANDARD), generator)
    assert standard.q is not None and tuple(standard.q.shape) == (3, engines["self"].vocab_size)
    drafter.close(state)


def test_sessions_batched_together_get_their_own_tokens(engines):
    """Sessions of several seeds and prompts, each with its own k, verified in shared forwards (the
    drafter batched too): each gets exactly what it gets alone, autoregressively."""
    target, drafter = TargetVerifier(engines["target"]), ModelDrafter(engines["other"])
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:], PROMPT]
    params = [_params("t1", seed=seed, max_new_tokens=30) for seed in (1, 2, 3, 4)]
    generators = [make_generator(p.seed)[0] for p in params]
    draft_generators = [make_generator(draft_seed(p.seed))[0] for p in params]
    ks = [1, 2, 5, 3]
    sessions = target.open_many(prompts, params, generators)
    states = [drafter.open(p) for p in prompts]
    outputs = [[s.pending_token_id] for s in sessions]
    news = [list(o) for o in outputs]
    while min(map(len, outputs)) < 30:
        proposals = drafter.propose_many(states, news, ks, params, draft_generators)
        for outcome, output, new in zip(target.verify_many(sessions, proposals), outputs, news):
            output.extend(outcome.token_ids)
            new[:] = outcome.token_ids
    for session, state in zip(sessions, states):
        target.close(session)
        drafter.close(state)
    for prompt, p, output in zip(prompts, params, outputs):
        assert output[:30] == generate(target, None, prompt, p).token_ids


def test_forked_branches_and_replays_continue_the_sequence_they_sample(engines):
    """A fork's child (a Skeleton-of-Thought branch) samples as a fresh session opened on its sequence
    with its seed would; a session re-opened on the prompt and the tokens so far (a failover) goes on
    with exactly the tokens the first one would have sampled."""
    verifier = TargetVerifier(engines["target"])
    params = _params("t0.7-top_p", max_new_tokens=30)
    whole = generate(verifier, None, PROMPT, params).token_ids
    for cut in (1, 7, 19):
        replay = generate(verifier, _drafter("ngram", engines), PROMPT + whole[:cut],
                          _params("t0.7-top_p", max_new_tokens=30 - cut), k_policy=FixedK(3)).token_ids
        assert replay == whole[cut:]
    parent = verifier.open(PROMPT, params, make_generator(params.seed)[0])
    branch_params = [_params("t1", seed=seed, max_new_tokens=20) for seed in (11, 12)]
    appends = [[5, 6, 7], [8, 9]]
    children = verifier.fork(parent, branch_params, [make_generator(p.seed)[0] for p in branch_params],
                             child_appends=appends)
    for child, p, append in zip(children, branch_params, appends):
        tokens = [child.pending_token_id]
        while len(tokens) < 20:
            tokens.extend(verifier.verify(child, DraftProposal(token_ids=[])).token_ids)
        verifier.close(child)
        assert tokens == generate(verifier, None, [*PROMPT, parent.pending_token_id, *append], p).token_ids
    verifier.close(parent)


def test_the_async_driver_gives_the_same_tokens(engines, autoregressive):
    from test_drivers import InProcessDrafter, InProcessVerifier  # the async adapters of the driver tests

    verifier = TargetVerifier(engines["target"])
    events = asyncio.run(generate_async(InProcessVerifier(verifier), InProcessDrafter(_drafter("other", engines)),
                                        PROMPT, _params("t1"), k_policy=FixedK(2)))
    assert [t for e in events for t in e.token_ids] == autoregressive["t1"]


def test_the_standard_rule_depends_on_k_and_the_coupled_rule_does_not(engines):
    """The defect the coupled rule removes: with the standard rule a model drafter's rounds (k) change
    a seeded request's text."""
    verifier = TargetVerifier(engines["target"])

    def tokens(rule: AcceptanceRule, k: int) -> list[int]:
        return generate(verifier, _drafter("other", engines), PROMPT, _params("t1", acceptance_rule=rule),
                        k_policy=FixedK(k)).token_ids

    standard = {tokens(AcceptanceRule.STANDARD, k)[:20] == tokens(AcceptanceRule.STANDARD, 1)[:20] for k in (2, 4)}
    assert False in standard
    assert tokens(AcceptanceRule.COUPLED, 1) == tokens(AcceptanceRule.COUPLED, 2) == tokens(AcceptanceRule.COUPLED, 4)
