"""Sampled speculative decoding through the real engine follows the target's distribution exactly.

Target and drafter are two different tiny random models (the target also as a Q4_1 low-bit model). Each trial opens a target session
(prefill samples token 1), then runs speculative rounds with k = 2 model drafts until tokens 2 and
3 exist. The joint distribution of (token 1, 2, 3) over 10,000 seeded trials is compared, with a
chi-square test, to p(t1) p(t2 | t1) p(t3 | t1 t2) computed from the target alone. Top-k = 3 keeps
the support at 27 cells. Trials run 1,000 sessions at a time through the batched verifier. Both
acceptance rules (`specmesh.decoding.rejection`, `specmesh.decoding.coupled`).
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


def _speculative_samples(target, draft, seeds, rule):
    verifier, drafter = TargetVerifier(target), ModelDrafter(draft)
    params = [dataclasses.replace(PARAMS, seed=s, acceptance_rule=rule) for s in seeds]
    generators = [make_generator(s)[0] for s in seeds]
    draft_generators = [make_generator(draft_seed(s))[0] for s in seeds]
    sessions = verifier.open_many([PROMPT] * len(seeds), params, generators)
    states = [drafter.open(PROMPT) for _ in seeds]
    outputs = [[s.pending_token_id] for s in sessions]
    pending = [list(o) for o in outputs]
    try:
        for _ in range(2):  # every round adds >= 1 token, so two rounds give tokens 2 and 3
            proposals = drafter.propose_many(states, pending, [2] * len(seeds), params, draft_generators)
            outcomes = verifier.verify_many(sessions, proposals)
            for output, outcome, acc in zip(outputs, outcomes, pending):
                output.extend(outcome.token_ids)
                acc[:] = outcome.token_ids
    finally:
        for session, state in zip(sessions, states):
            verifier.close(session)
            drafter.close(state)
    return [tuple(o[:3]) for o in outputs]


# the float64 target under both acceptance rules, and a low-bit one (8-bit activations, 4-bit weights: a
# model of its own, exact all the same)
@pytest.mark.parametrize("draft_family,target_options,rule", [
    ("qwen2", {"dtype": "float64"}, AcceptanceRule.STANDARD), ("qwen2", {"dtype": "float64"}, AcceptanceRule.COUPLED),
    ("qwen2", {"dtype": "float32", "quantize": "q4_1"}, AcceptanceRule.STANDARD)])
def test_joint_of_three_tokens_matches_target(tiny_model_dir, draft_family, target_options, rule):
    target = load_engine(tiny_model_dir("llama", seed=5, init_std=0.08), max_kv_tokens=64 * CHUNK, **target_options)
    draft = load_engine(tiny_model_dir(draft_family, seed=6, init_std=0.08), dtype="float64", max_kv_tokens=64 * CHUNK)
    expected = target_joint(target, PROMPT, PARAMS)
    counts = dict.fromkeys(expected, 0)
    for start in range(0, NUM_TRIALS, CHUNK):
        for sample in _speculative_samples(target, draft, range(start, start + CHUNK), rule):
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
