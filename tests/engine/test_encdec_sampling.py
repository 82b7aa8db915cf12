"""Sampled speculative decoding on encoder-decoder models follows the target's distribution exactly.

One encoder input; the target session is opened once (the encoder and the decoder prompt run once)
and forked into one child per trial, each with its own seeded generator, so every trial starts
from the same pending token t0. A model drafter (the target with noise on its weights, so q differs
from p and both acceptance and rejection run) opens its own session per trial; rounds of k = 2
run until the two tokens after t0 exist. Their joint over the trials is compared, with a
chi-square test, to p(t1 | t0) p(t2 | t0 t1) from the target alone. Top-k = 3 keeps 9 cells.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, make_generator, processed_probs
from specmesh.decoding.speculative import draft_seed
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.engine import SeqInput
from specmesh.models.load import load_engine
from specmesh.models.tiny_encdec import make_tiny_encdec, perturbed_copy

ENCODER_IDS = [5, 17, 33, 80, 120, 7, 2]
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=8, ignore_eos=True,
                        acceptance_rule=AcceptanceRule.STANDARD)  # q and the residual (coupled: test_encdec_services)
NUM_TRIALS = 1_200  # one model call per sequence (HF backend): ~6 calls a trial
K = 2


def _next_probs(engine, decoder_ids):
    seq = engine.new_sequence(encoder_input_ids=ENCODER_IDS)
    try:
        logits = engine.forward([SeqInput(seq, list(decoder_ids), [len(decoder_ids) - 1])])[0]
    finally:
        engine.free(seq)
    return processed_probs(logits, PARAMS)[0].double()


def _target_joint(engine, prefix):
    """{(t1, t2): probability} after `prefix` (the decoder prompt and t0) under the target alone."""
    joint = {}
    p1 = _next_probs(engine, prefix)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = _next_probs(engine, [*prefix, t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def _speculative_pairs(target, draft, seeds):
    verifier = TargetVerifier(target.bind(ENCODER_IDS))  # opens on the encoder input; rounds as any verifier's
    drafter = ModelDrafter(draft.bind(ENCODER_IDS))
    parent = verifier.open(target.decoder_prompt_ids, PARAMS, make_generator(0)[0])
    prefix = list(parent.token_ids)  # the decoder prompt and t0 (pending)
    children = verifier.fork(parent, [PARAMS] * len(seeds), [make_generator(s)[0] for s in seeds])
    verifier.close(parent)
    pairs = []
    try:
        for child, seed in zip(children, seeds):
            state, generator = drafter.open(prefix), make_generator(draft_seed(seed))[0]
            out: list[int] = []
            accepted: list[int] = []
            while len(out) < 2:
                proposal = drafter.propose(state, accepted, K, PARAMS, generator)
                outcome = verifier.verify(child, proposal)
                out.extend(outcome.token_ids)
                accepted = outcome.token_ids
            drafter.close(state)
            pairs.append(tuple(out[:2]))
    finally:
        for child in children:
            verifier.close(child)
    return prefix, pairs


@pytest.mark.parametrize("family,init_std,noise_std", [("t5", 0.12, 0.2), ("bart", 0.05, 0.5)])
def test_joint_of_two_tokens_matches_target(tmp_path, family, init_std, noise_std):
    """Per family, weights where a draft token is accepted with probability ~0.6 and the draft's own
    joint is far from the target's (total variation ~0.7): acceptance, recovery and bonus all run,
    and a wrong acceptance rule would show."""
    target_dir = make_tiny_encdec(family, tmp_path / "target", init_std=init_std)
    target = load_engine(target_dir, dtype="float64", max_kv_tokens=32 * NUM_TRIALS)  # every child at once
    draft = load_engine(perturbed_copy(target_dir, tmp_path / "draft", noise_std=noise_std), dtype="float64")
    prefix, samples = _speculative_pairs(target, draft, range(NUM_TRIALS))
    expected = _target_joint(target, prefix)
    counts = dict.fromkeys(expected, 0)
    for sample in samples:
        assert sample in counts, f"{sample} is outside the target's top-k support"
        counts[sample] += 1
    cells = sorted(expected)
    observed = [counts[c] for c in cells]
    total = sum(expected.values())  # 1 up to rounding; chisquare wants the sums equal
    wanted = [expected[c] / total * NUM_TRIALS for c in cells]
    assert min(wanted) > 5, wanted  # a fair test: every cell expects a few samples
    assert chisquare(observed, wanted).pvalue > 1e-3, (observed, wanted)
