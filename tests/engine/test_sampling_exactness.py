"""Sampled speculative decoding through the real engine follows the target's distribution exactly.

Target and drafter are two different tiny random models (the target also as a Q4_1 low-bit model). Each trial opens a target session
(prefill samples token 1), then runs speculative rounds with k = 2 model drafts until tokens 2 and
3 exist. The joint distribution of (token 1, 2, 3) over 10,000 seeded trials is compared, with a
chi-square test, to p(t1) p(t2 | t1) p(t3 | t1 t2) computed from the target alone. Top-k = 3 keeps
the support at 27 cells. Trials run 1,000 sessions at a time through the batched verifier. Both
acceptance rules (`specmesh.decoding.rejection`, `specmesh.decoding.coupled`). And with the drafter
drafting ahead while each round is verified (`ModelDrafter.draft_ahead_step`: drafts made on a guess
the verdict refutes are thrown away, and must not bias what is sampled): k = 1 rounds until token 4
exists, so token 4's draft may come from the drafts ahead; the joint of four tokens (81 cells).
"""

from __future__ import annotations

import dataclasses

import pytest
from sampling_helpers import target_joint
from scipy.stats import chisquare

from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, make_generator
from specmesh.decoding.speculative import draft_seed
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.load import load_engine

PROMPT = [11, 40, 7, 93]
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True)
NUM_TRIALS = 10_000
CHUNK = 1_000


def _speculative_samples(target, draft, seeds, rule, ahead=False):
    verifier, drafter = TargetVerifier(target), ModelDrafter(draft)
    length, k = (4, 1) if ahead else (3, 2)
    params = [dataclasses.replace(PARAMS, seed=s, acceptance_rule=rule, max_new_tokens=length) for s in seeds]
    generators = [make_generator(s)[0] for s in seeds]
    draft_generators = [make_generator(draft_seed(s))[0] for s in seeds]
    sessions = verifier.open_many([PROMPT] * len(seeds), params, generators)
    states = [drafter.open(PROMPT) for _ in seeds]
    outputs = [[s.pending_token_id] for s in sessions]
    pending = [list(o) for o in outputs]
    try:
        for _ in range(length - 1):  # every round adds >= 1 token, so these rounds give tokens 2 .. length
            proposals = drafter.propose_many(states, pending, [k] * len(seeds), params, draft_generators)
            for _ in range(2 if ahead else 0):  # the guess at the target's token, then a draft past it
                drafter.draft_ahead_step(states, [k] * len(seeds), params, draft_generators)
            outcomes = verifier.verify_many(sessions, proposals)
            for output, outcome, acc in zip(outputs, outcomes, pending):
                output.extend(outcome.token_ids)
                acc[:] = outcome.token_ids
    finally:
        for session, state in zip(sessions, states):
            verifier.close(session)
            drafter.close(state)
    assert not ahead or drafter.ahead_served > 0  # some second rounds were served from drafts ahead
    return [tuple(o[:length]) for o in outputs]


# the float64 target under both acceptance rules, and a low-bit one (8-bit activations, 4-bit weights: a
# model of its own, exact all the same). Drafting ahead, the drafter is the target itself: q = p, so
# every draft is accepted and token 4 is, whenever the guess held, the draft served from those made ahead
OTHER, SELF = ("qwen2", 6), ("llama", 5)


@pytest.mark.parametrize("draft_model,target_options,rule,ahead", [
    (OTHER, {"dtype": "float64"}, AcceptanceRule.STANDARD, False), (OTHER, {"dtype": "float64"}, AcceptanceRule.COUPLED, False),
    (OTHER, {"dtype": "float32", "quantize": "q4_1"}, AcceptanceRule.STANDARD, False),
    (SELF, {"dtype": "float64"}, AcceptanceRule.STANDARD, True)])
def test_joint_of_the_first_tokens_matches_target(tiny_model_dir, draft_model, target_options, rule, ahead):
    target = load_engine(tiny_model_dir("llama", seed=5, init_std=0.08), max_kv_tokens=64 * CHUNK, **target_options)
    family, seed = draft_model
    draft = load_engine(tiny_model_dir(family, seed=seed, init_std=0.08), dtype="float64", max_kv_tokens=64 * CHUNK)
    expected = target_joint(target, PROMPT, PARAMS, length=4 if ahead else 3)
    counts = dict.fromkeys(expected, 0)
    for start in range(0, NUM_TRIALS, CHUNK):
        for sample in _speculative_samples(target, draft, range(start, start + CHUNK), rule, ahead):
            assert sample in counts, f"{sample} has probability 0 under the target"
            counts[sample] += 1
    cells = sorted(expected, key=expected.get, reverse=True)
    observed = [counts[c] for c in cells]
    wanted = [expected[c] * NUM_TRIALS for c in cells]
    # pool the cells expected fewer than 5 times into one, as the chi-square test needs
    big = [i for i, w in enumerate(wanted) if w >= 5]
    small = [i for i, w in enumerate(wanted) if w < 5]
    obs = [observed[i] for i in big] + ([sum(observed[i] for i in small)] if small else [])
    exp = [wanted[i] for i in big] + ([sum(wanted[i] for i in small)] if small else [])
    exp = [e * sum(obs) / sum(exp) for e in exp]
    result = chisquare(obs, exp)
    assert result.pvalue > 1e-3, (result, list(zip(obs, exp)))
    assert len(big) >= 10  # the test has power: many well-populated cells
