"""The adaptive (lossy, opt-in) cascade at run time, in-process, on tiny random models.

- lambda = inf reproduces the lossless pipeline token for token (greedy, and seeded sampling);
- lambda = 0 stops at the first stage on every chunk (stats and `lossy` say so): greedy output is then
  that stage's own greedy decoding, since its chunk is its argmax chain;
- a hand-checked middle case (the stopping.py worked example with a rigged predictor): lambda 2 stops
  at stage 0, 4 at stage 1, 10 goes to the target;
- the target's verdict on the last stage's chunk feeds the stopper (observe) and the stats;
- the decoding layer's part: `record_unverified`, `append_unverified`, refusal to verify such a chunk.
"""

from __future__ import annotations

import math

import pytest
import torch

from specmesh.cascade.chunk_stopping import target_agreed
from specmesh.cascade.costs import chunk_stage_costs, measure_forward_ms
from specmesh.cascade.features import FeatureSchema
from specmesh.cascade.identity import StageIdentity
from specmesh.cascade.pipeline import CascadeDrafter
from specmesh.cascade.plan import StageSpec
from specmesh.cascade.policy import AdaptiveStopper
from specmesh.cascade.predictor import AgreementPredictor
from specmesh.cascade.shrinkage import StageShrinkage
from specmesh.cascade.stage_model import StageModel
from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import generate
from specmesh.decoding.state import SpeculationState
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models.load import load_engine

PROMPT = [5, 17, 33, 5, 17, 33, 5, 17]
GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
INF = math.inf


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    def load(std):
        return load_engine(tiny_model_dir("llama", seed=1, init_std=std), dtype="float64")
    return {"target": load(0.2), "stage": load(0.15), "stage_low": load(0.12)}


class ByStagePredictor(AgreementPredictor):
    """P(agree) fixed per decision stage (read from the features' stage one-hot)."""

    def __init__(self, num_stages: int, probs: list[float]):
        super().__init__(FeatureSchema(num_stages), [StageIdentity(f"s{i}", str(i) * 64) for i in range(num_stages)])
        self.probs = probs

    def predict_one(self, features):
        one_hot = list(features)[-(self.schema.num_stages - 1):]
        return self.probs[one_hot.index(1.0)]


def stopper_for(num_stages: int, lam: float, probs=None, costs=None, rates=None) -> AdaptiveStopper:
    """A stopper whose P(agree) is exactly `probs` per stage and whose later stages' outlook is frozen at
    `rates` (huge prior strength, negligible shrinkage), so decisions are hand-checkable."""
    probs = probs or [0.9] * (num_stages - 1)
    shrinkage = StageShrinkage(num_stages - 1, rates or probs, prior_strength=1e12, shrink_strength=1e-12,
                               predictor_weight=1.0)
    return AdaptiveStopper(ByStagePredictor(num_stages, probs), costs or [0.1] * (num_stages - 1) + [1.0], lam, shrinkage)


class Recording(CascadeDrafter):
    def open(self, prompt_ids):
        self.state = super().open(prompt_ids)
        return self.state


def run(engines, stages, lam, params=GREEDY, base="ngram", specs=None, stopper=None, pass_agreed=True):
    stage_models = [StageModel(engines[name]) for name in stages]
    if stopper is None and lam is not None:
        stopper = stopper_for(len(stages) + 1, lam)
    drafter = Recording(PromptLookupDrafter() if base == "ngram" else None, stage_models, specs, stopper=stopper, lam=lam,
                        pass_agreed=pass_agreed)
    result = generate(TargetVerifier(engines["target"]), drafter, PROMPT, params, k_policy=FixedK(4))
    return result, drafter.state


def alone(engine, params=GREEDY):
    return generate(TargetVerifier(engine), None, PROMPT, params).token_ids


# --- lambda = inf is the lossless pipeline ---

@pytest.mark.parametrize("base", ["ngram", "none"])
@pytest.mark.parametrize("stages, specs", [
    (["stage"], None),
    (["stage_low", "stage"], [StageSpec(), StageSpec(num_extend_tokens=2)]),
])
def test_lambda_inf_is_the_lossless_pipeline_greedy(engines, base, stages, specs):
    # (a stopper judges every stage's chunk: no stage sits out a round, `CascadeBook.pass_agreed`)
    lossless, lossless_state = run(engines, stages, None, base=base, specs=specs, pass_agreed=False)
    adaptive, state = run(engines, stages, INF, base=base, specs=specs)
    assert adaptive.token_ids == lossless.token_ids == alone(engines["target"])
    assert not adaptive.lossy and not state.lossy and not any(e.unverified for e in adaptive.events)
    assert adaptive.stats.num_target_forwards == lossless.stats.num_target_forwards
    assert [s.num_accepted_tokens for s in state.stage_stats] == [s.num_accepted_tokens for s in lossless_state.stage_stats]
    assert state.stage_stats[-1].num_chunks_judged > 0  # the target's verdicts fed the stopper


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_lambda_inf_is_the_lossless_pipeline_seeded_sampling(engines, seed):
    params = SamplingParams(temperature=1.0, top_k=5, max_new_tokens=30, ignore_eos=True, seed=seed)
    lossless, _ = run(engines, ["stage_low", "stage"], None, params)
    adaptive, state = run(engines, ["stage_low", "stage"], INF, params)
    assert adaptive.token_ids == lossless.token_ids
    assert not state.lossy


# --- lambda = 0: the first stage, every chunk ---

@pytest.mark.parametrize("base", ["ngram", "none"])
def test_lambda_zero_stops_at_the_first_stage_every_chunk(engines, base):
    result, state = run(engines, ["stage_low", "stage"], 0.0, base=base)
    chunks, last = result.events[1:-1], result.events[-1]
    # the last token under max_new_tokens has k = 0 (no stage runs): the target decodes it plainly
    assert all(e.unverified for e in chunks) and not last.unverified and last.num_draft_tokens == 0
    assert state.lossy and result.lossy
    stats = state.stage_stats
    assert stats[0].num_chunks_stopped == len(chunks) and stats[1].num_chunks_stopped == 0
    assert stats[1].num_rounds == 0 and state.num_chunks_to_target == 0
    assert result.stats.num_target_forwards == 2  # the prefill and the last plain step: nothing was verified
    # greedy: stage 0's chunk is its argmax chain, so the output is stage 0 decoding alone (but the last token)
    assert result.token_ids[:-1] == alone(engines["stage_low"])[:-1]
    assert result.token_ids[:-1] != alone(engines["target"])[:-1]  # the test can tell lossy from lossless


# --- a hand-checked middle case (stopping.py's worked example) ---

@pytest.mark.parametrize("lam, stop_stage", [(2.0, 0), (4.0, 1), (10.0, 2)])
def test_worked_example_lambda_picks_the_stage(engines, lam, stop_stage):
    # c = [0.1, 0.3, 1.0], a_0 = 0.9, a_1 = 0.8 (stage 1's outlook frozen at 0.8):
    # lambda 2 stops at 0, 4 at 1, 10 goes to the target
    stopper = stopper_for(3, lam, probs=[0.9, 0.8], costs=[0.1, 0.3, 1.0])
    result, state = run(engines, ["stage_low", "stage"], lam, base="none", stopper=stopper)
    stats = state.stage_stats
    num_rounds = len(result.events) - 2  # the last token is a k = 0 step of the target's
    expected_output = alone(engines[["stage_low", "stage", "target"][stop_stage]])
    assert result.token_ids[:-1] == expected_output[:-1]
    assert result.lossy == (stop_stage < 2) == state.lossy
    stopped = [s.num_chunks_stopped for s in stats] + [state.num_chunks_to_target]
    assert stopped == [num_rounds if j == stop_stage else 0 for j in range(3)]
    if stop_stage >= 1:  # stage 1 judged every chunk of stage 0
        assert stats[0].num_chunks_judged == num_rounds
        assert stats[0].num_chunks_agreed == stopper.shrinkage.posteriors[0].alpha - 1e12 * 0.9


def test_the_targets_verdict_is_observed(engines):
    result, state = run(engines, ["stage"], INF, base="none")
    rounds = [e for e in result.events[1:] if e.num_draft_tokens]
    stats = state.stage_stats[0]
    # the last round is the target's k = 0 step, whose propose call brings the verdict on the last chunk
    assert result.events[-1].num_draft_tokens == 0
    assert stats.num_chunks_judged == len(rounds)
    assert stats.num_chunks_agreed == sum(e.num_accepted_tokens == e.num_draft_tokens for e in rounds)
    assert 0 < stats.num_chunks_agreed < stats.num_chunks_judged
    assert state.num_chunks_to_target == len(rounds)


def test_the_stopper_must_match_the_cascade(engines):
    with pytest.raises(ValueError, match="levels"):
        CascadeDrafter(None, [StageModel(engines["stage"])], stopper=stopper_for(3, 1.0))


def test_target_agreed_worked_example():
    assert target_agreed([5, 6, 7], [5, 6, 7, 8])
    assert not target_agreed([5, 6, 7], [5, 9])
    assert not target_agreed([5, 6, 7], [5, 6, 7])  # the target always adds a token when it agrees


# --- costs ---

def test_chunk_stage_costs_worked_example(engines):
    assert [round(c, 2) for c in chunk_stage_costs([24.0, 33.0], [21.0], [4])] == [2.64, 1.0]
    with pytest.raises(ValueError):
        chunk_stage_costs([24.0], [], [])
    assert measure_forward_ms(engines["stage"], 5, 8, repeats=2) > 0


# --- the decoding layer: committing an unverified chunk ---

def test_state_records_an_unverified_chunk():
    state = SpeculationState(SamplingParams(temperature=0, max_new_tokens=8), num_prompt_tokens=3, max_context=64,
                             eos_token_ids=[2], k_policy=FixedK(4))
    state.start(7)
    assert state.next_k() == 4
    event = state.record_unverified([8, 9, 10])
    assert event.unverified and event.token_ids == [8, 9, 10] and state.lossy
    assert state.stats.num_target_forwards == 1 and state.stats.num_drafts == 0
    assert state.take_draft_input() == [7, 8, 9, 10]
    with pytest.raises(ValueError, match="1..3"):  # 4 generated, max 8: a chunk of at most 8 - 4 - 1 tokens
        state.record_unverified([1, 1, 1, 1])
    event = state.record_unverified([11, 2, 12])
    assert event.token_ids == [11, 2] and state.finished  # EOS inside the chunk ends it, as in a verified round


def test_verifier_appends_unverified_tokens_and_refuses_to_verify_them(engines):
    verifier = TargetVerifier(engines["target"])
    generator, _ = make_generator(0)
    session = verifier.open(PROMPT, GREEDY, generator)
    first = session.pending_token_id
    verifier.append_unverified(session, [3, 4])
    assert session.token_ids == [*PROMPT, first, 3, 4] and session.num_cached == len(PROMPT)
    with pytest.raises(ValueError, match="unverified"):
        verifier.verify(session, DraftProposal([1], unverified=True))
    with pytest.raises(ValueError, match="lie in"):
        verifier.append_unverified(session, [10**9])
    outcome = verifier.verify(session, DraftProposal([]))  # feeds [first, 3, 4]: the next token after 4
    reference = verifier.open([*PROMPT, first, 3, 4], GREEDY, generator)
    assert outcome.token_ids == [reference.pending_token_id]
    assert torch.equal(torch.tensor(session.token_ids[:-1]), torch.tensor(reference.token_ids[:-1]))
    verifier.close(session)
    verifier.close(reference)


def test_a_feature_constant_in_training_is_ignored():
    """At run time a feature may take values training never saw (a stage that had no lower draft in
    training gets one): it must not swing the prediction."""
    schema = FeatureSchema(2)
    predictor = AgreementPredictor(schema, [StageIdentity("a", "0" * 64), StageIdentity("b", "1" * 64)])
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(200, schema.num_features, generator=gen, dtype=torch.float64)
    fraction = schema.names().index("draft_accepted_fraction")
    x[:, fraction] = 0.0
    predictor.fit(x.numpy(), (x[:, 0] > 0.5).double().numpy())
    row = x[0].clone()
    changed = row.clone()
    changed[fraction] = 0.75
    assert predictor.predict_one(changed.tolist()) == pytest.approx(predictor.predict_one(row.tolist()), abs=1e-12)


# --- the Coordinator's helpers (coordinator/cascade.py) ---

def test_coordinator_lambda_rules():
    from coordinator.cascade import CascadeStages, check_cascade_lambda, parse_cascade_stages

    configured = parse_cascade_stages("a:1 extend=4")
    lossless_only = CascadeStages(configured, open_channel=lambda address: object())
    assert lossless_only.request_lambda(None, configured) == INF
    with pytest.raises(ValueError, match="no adaptive predictor"):
        lossless_only.request_lambda(2.0, configured)
    with pytest.raises(ValueError, match="no adaptive predictor"):
        lossless_only.set_default_lambda(2.0)
    adaptive = CascadeStages(configured, open_channel=lambda address: object(), stopper=stopper_for(2, INF))
    assert adaptive.request_lambda(None, configured) == INF and adaptive.request_lambda(3.0, configured) == 3.0
    adaptive.set_default_lambda(1.5)
    assert adaptive.request_lambda(None, configured) == 1.5 and adaptive.request_lambda(INF, configured) == INF
    with pytest.raises(ValueError, match="configured stages only"):
        adaptive.request_lambda(1.0, parse_cascade_stages("a:1 extend=2"))
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match=">= 0"):
            check_cascade_lambda(bad)
    with pytest.raises(ValueError, match="for 1 stages"):
        CascadeStages(parse_cascade_stages("a:1, b:2"), open_channel=lambda address: object(), stopper=stopper_for(2, INF))
