"""Adaptive cascade: optimal stopping vs brute force, shrinkage worked examples, the predictor on a
known rule, save / load with the stages it was trained for, features and metrics worked examples."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from specmesh.cascade.features import FeatureSchema, SessionFeatures
from specmesh.cascade.identity import StageIdentity, StageSpec, parse_stage_spec
from specmesh.cascade.metrics import auc, brier, calibration_report, ece
from specmesh.cascade.policy import AdaptiveStopper
from specmesh.cascade.predictor import AgreementPredictor, FitConfig, PredictorMismatchError
from specmesh.cascade.shrinkage import StageShrinkage
from specmesh.cascade.stage_model import TokenFeatures
from specmesh.cascade.stopping import Outlook, continuation_values, decide, plan_stop_stage, stop_value

INF = math.inf
COSTS = [0.1, 0.3, 1.0]  # the stopping.py worked example
AGREE = [0.9, 0.8]

# --- optimal stopping -------------------------------------------------------------------------------


def brute_force(start: int, a_start: float, costs: list[float], outlooks: list[Outlook], lam: float) -> float:
    """min over every stopping policy of E[cost + lam * P(final disagrees)], by enumeration.

    A policy decides at each stage i in start..N-2 from the whole history of agreement values seen so
    far (a_start, a_{start+1}, ..., a_i); the final stage always stops. Each path of realised values has
    probability prod of outlook weights; the loss on a path uses the realised a's of every stage from
    the stopping stage up (also those never observed), not their means.
    """
    num_stages = len(costs)
    supports = [[(a_start, 1.0)]] + [list(zip(o.values, o.weights)) for o in outlooks]  # stages start..N-2
    paths = list(itertools.product(*[range(len(s)) for s in supports]))
    # every history prefix (stage i: indices of stages start..i) is a decision point
    points = sorted({path[:k + 1] for path in paths for k in range(len(supports))})
    best = INF
    for choice in itertools.product((False, True), repeat=len(points)):
        stops = dict(zip(points, choice))
        total = 0.0
        for path in paths:
            values = [supports[k][index][0] for k, index in enumerate(path)]
            weight = math.prod(supports[k][index][1] for k, index in enumerate(path))
            stage, cost = num_stages - 1, 0.0
            for k in range(len(supports)):
                if stops[path[:k + 1]]:
                    stage = start + k
                    break
                cost += costs[start + k + 1]
            loss = 1.0 - math.prod(values[stage - start:])  # the chunk survives iff every stage above agrees
            total += weight * (cost + (0.0 if stage == num_stages - 1 else stop_value(lam, loss)))
        best = min(best, total)
    return best


def dp_value(start: int, a_start: float, costs: list[float], outlooks: list[Outlook], lam: float) -> float:
    d = decide(start, a_start, costs, outlooks, lam)
    return min(d.stop_value, d.continue_value)


def random_outlook(rng: random.Random) -> Outlook:
    n = rng.randint(1, 3)
    raw = [rng.random() + 0.05 for _ in range(n)]
    return Outlook(tuple(rng.random() for _ in range(n)), tuple(w / sum(raw) for w in raw))


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_dp_equals_brute_force_over_all_policies(num_stages):
    rng = random.Random(num_stages)
    for _ in range(25):
        costs = [rng.uniform(0.0, 1.0) for _ in range(num_stages - 1)] + [1.0]
        lam = rng.choice([0.0, 0.5, 2.0, 5.0, 20.0, INF])
        start = rng.randrange(num_stages - 1)
        outlooks = [random_outlook(rng) for _ in range(num_stages - 2 - start)]
        a_start = rng.random()
        assert dp_value(start, a_start, costs, outlooks, lam) == pytest.approx(brute_force(start, a_start, costs, outlooks, lam), abs=1e-12)


def test_dp_point_outlooks_equal_the_best_fixed_stop_stage():
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(2, 4)
        costs = [rng.uniform(0.05, 1.0) for _ in range(n - 1)] + [1.0]
        agree = [rng.random() for _ in range(n - 1)]
        lam = rng.uniform(0.0, 10.0)
        objective = [sum(costs[1:s + 1]) + lam * (1.0 - math.prod(agree[s:])) for s in range(n)]  # stop at s
        assert objective[plan_stop_stage(agree, costs, lam)] == pytest.approx(min(objective), abs=1e-12)


def test_worked_example_stops_at_0_middle_and_final():
    assert [plan_stop_stage(AGREE, COSTS, lam) for lam in (2.0, 4.0, 10.0)] == [0, 1, 2]
    d = decide(0, 0.9, COSTS, [Outlook.point(0.8)], 4.0)
    assert not d.stop
    assert d.stop_value == pytest.approx(1.12) and d.continue_value == pytest.approx(1.1)
    assert d.expected_loss == pytest.approx(0.28)
    assert decide(1, 0.8, COSTS, [], 4.0).stop


def test_lambda_infinity_always_goes_to_the_final_stage():
    rng = random.Random(1)
    for _ in range(50):
        n = rng.randint(2, 5)
        costs = [rng.uniform(0.0, 5.0) for _ in range(n)]
        agree = [rng.choice([1.0, rng.random()]) for _ in range(n - 1)]  # even when a stage is certain
        assert plan_stop_stage(agree, costs, INF) == n - 1
    assert plan_stop_stage([1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], INF) == 3


def test_lambda_zero_always_stops_at_stage_0():
    rng = random.Random(2)
    for _ in range(50):
        n = rng.randint(2, 5)
        costs = [rng.uniform(0.0, 5.0) for _ in range(n)]
        assert plan_stop_stage([rng.random() for _ in range(n - 1)], costs, 0.0) == 0


def test_a_bad_cheap_stage_is_not_chosen_the_product_runs_upward():
    # stage 0 is usually wrong; a product taken from stage 0 upward (empty at stage 0) would say loss 0
    # and stop there. The loss of stopping at 0 is 1 - 0.1 * 0.99 * 0.99.
    costs, agree = [0.05, 0.1, 0.2, 1.0], [0.1, 0.99, 0.99]
    assert plan_stop_stage(agree, costs, 5.0) == 1
    assert decide(0, 0.1, costs, [Outlook.point(0.99)] * 2, 5.0).expected_loss == pytest.approx(1 - 0.1 * 0.99 * 0.99)
    _, tail = continuation_values(0, costs, [Outlook.point(0.99), Outlook.point(0.5)], 5.0)
    assert tail == pytest.approx(0.99 * 0.5)


def test_uncertain_future_has_option_value():
    # stage 1's agreement is 0 or 1 with equal odds (mean 0.5). Knowing it before deciding is worth more
    # than its mean: stop at 1 when a_1 = 1, go on to the final stage when a_1 = 0.
    costs, lam = [0.0, 0.2, 1.0], 3.0
    spread, point = Outlook((0.0, 1.0), (0.5, 0.5)), Outlook.point(0.5)
    go_on_spread, _ = continuation_values(0, costs, [spread], lam)
    go_on_point, _ = continuation_values(0, costs, [point], lam)
    assert go_on_spread == pytest.approx(0.2 + 0.5 * 1.0 + 0.5 * 0.0)
    assert go_on_point == pytest.approx(0.2 + min(3.0 * 0.5, 1.0))
    assert go_on_spread < go_on_point


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="lambda"):
        decide(0, 0.5, COSTS, [Outlook.point(0.5)], -1.0)
    with pytest.raises(ValueError, match="outlooks"):
        decide(0, 0.5, COSTS, [], 1.0)
    with pytest.raises(ValueError, match="costs"):
        decide(0, 0.5, [0.1, -1.0, 1.0], [Outlook.point(0.5)], 1.0)
    with pytest.raises(ValueError, match="sum"):
        Outlook((0.2, 0.4), (0.5, 0.6))


# --- shrinkage ---------------------------------------------------------------------------------------


def test_shrinkage_worked_example():
    s = StageShrinkage(2)  # prior Beta(1, 1) per stage
    for agreed in [True] * 8 + [False] * 2:
        s.observe(0, agreed)
    assert (s.posteriors[0].alpha, s.posteriors[0].beta) == (9.0, 3.0)
    assert s.rate(0) == pytest.approx(0.75)
    assert s.shrink(0, 0.9) == pytest.approx(14.52 / 16.8)  # 0.864286
    assert s.shrink(0, 0.6) == pytest.approx(4.92 / 7.2)  # 0.683333
    assert s.shrink(0, 0.5) == pytest.approx(0.75)
    assert s.rate(1) == 0.5 and s.shrink(1, 0.5) == 0.5  # stage 1 untouched


def test_shrinkage_prior_from_training_rates_and_limits():
    s = StageShrinkage(1, prior_rates=[0.8], prior_strength=10.0)
    assert (s.posteriors[0].alpha, s.posteriors[0].beta) == pytest.approx((8.0, 2.0))
    s.observe(0, False)
    assert s.rate(0) == pytest.approx(8.0 / 11.0)
    assert s.shrink(0, 1.0) == pytest.approx((4.0 * 8.0 / 11.0 + 16.0) / 20.0)  # a confident p keeps 80% weight
    assert s.shrink(0, 0.0) == pytest.approx(4.0 * 8.0 / 11.0 / 20.0)
    with pytest.raises(ValueError):
        StageShrinkage(1, prior_rates=[1.0])
    with pytest.raises(ValueError):
        s.shrink(0, 1.5)


# --- features and metrics ----------------------------------------------------------------------------


def test_features_worked_example():
    features = SessionFeatures(FeatureSchema(3), num_prompt_tokens=20)
    chunk = [TokenFeatures(0.5, 0.9, -0.1), TokenFeatures(1.5, 0.5, -0.7)]
    x = features.chunk(1, chunk, num_draft_tokens=4, num_accepted=3, num_generated_tokens=7)
    assert x == pytest.approx([1.0, 1.5, 0.7, 0.5, -0.4, -0.7, 1.0, 1.5, -0.4, math.log(21 / 8), 0.75, 2.0, 0.0, 1.0])
    assert len(x) == FeatureSchema(3).num_features == len(FeatureSchema(3).names())


def test_feature_window_keeps_the_last_32_tokens_and_clips_minus_inf():
    features = SessionFeatures(FeatureSchema(2), num_prompt_tokens=5)
    features.chunk(0, [TokenFeatures(9.0, 0.1, -2.0)] * 8, 0, 0, 0)
    x = features.chunk(0, [TokenFeatures(1.0, 0.5, -math.inf)] * 32, 0, 0, 8)
    assert x[6] == 1.0 and x[7] == 1.0  # the 8 high-entropy tokens left the window
    assert x[5] == -30.0 and x[8] == -30.0
    with pytest.raises(ValueError):
        features.chunk(1, [TokenFeatures(1.0, 0.5, -1.0)], 0, 0, 0)  # the final stage takes no decision


def test_metrics_worked_example():
    p, y = [0.9, 0.8, 0.3, 0.2], [1, 0, 1, 0]
    assert auc(p, y) == pytest.approx(0.75)
    assert brier(p, y) == pytest.approx(0.295)
    assert ece(p, y, num_bins=2) == pytest.approx(0.3)
    assert auc([0.5, 0.5, 0.5], [1, 0, 1]) == pytest.approx(0.5)  # ties count one half
    assert math.isnan(auc([0.1, 0.2], [1, 1]))


def test_auc_matches_pairwise_counting():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=60).astype(float)  # many ties
    labels = rng.integers(0, 2, size=60)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = np.mean([(a > b) + 0.5 * (a == b) for a in pos for b in neg])
    assert auc(scores, labels) == pytest.approx(pairwise)


# --- predictor ---------------------------------------------------------------------------------------

STAGES = [StageIdentity("m@int8", "a" * 64), StageIdentity("m@bf16", "b" * 64), StageIdentity("m@fp32", "c" * 64)]
THRESHOLD = 1.2  # agree iff mean chunk entropy < THRESHOLD


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random feature rows of the 3-stage schema; label = chunk_entropy_mean < THRESHOLD."""
    rng = np.random.default_rng(seed)
    schema = FeatureSchema(3)
    x = rng.normal(size=(n, schema.num_features))
    x[:, 0] = rng.uniform(0.0, 3.0, size=n)
    stage = rng.integers(0, 2, size=n)
    x[:, -2:] = 0.0
    x[np.arange(n), schema.num_features - 2 + stage] = 1.0
    return x, (x[:, 0] < THRESHOLD).astype(float)


@pytest.fixture(scope="module")
def trained() -> AgreementPredictor:
    x, y = synthetic(1500, seed=0)
    predictor = AgreementPredictor(FeatureSchema(3), STAGES)
    losses = predictor.fit(x, y, FitConfig(epochs=400, seed=0))
    assert losses[-1] < 0.3 * losses[0]
    return predictor


def test_predictor_recovers_a_known_rule(trained):
    x, y = synthetic(1000, seed=1)  # fresh rows
    p = trained.predict(x)
    assert auc(p, y) > 0.95
    assert calibration_report(p, y).brier < 0.08
    # the decision boundary along chunk_entropy_mean, other features at their typical values
    grid = np.linspace(0.0, 3.0, 301)
    probe = np.zeros((grid.size, FeatureSchema(3).num_features))
    probe[:, 0] = grid
    probe[:, -2] = 1.0
    crossing = grid[np.argmax(trained.predict(probe) < 0.5)]
    assert abs(crossing - THRESHOLD) < 0.15


def test_predictor_fit_is_seeded():
    x, y = synthetic(300, seed=3)
    a, b = AgreementPredictor(FeatureSchema(3), STAGES), AgreementPredictor(FeatureSchema(3), STAGES)
    a.fit(x, y, FitConfig(epochs=50, seed=5))
    b.fit(x, y, FitConfig(epochs=50, seed=5))
    assert np.array_equal(a.predict(x), b.predict(x))


def test_save_load_round_trip(trained, tmp_path):
    trained.info.stage_agreement_rates = [0.7, 0.9]
    path = tmp_path / "predictor.json"
    trained.save(path)
    loaded = AgreementPredictor.load(path, expected_stages=STAGES)
    x, _ = synthetic(50, seed=4)
    assert np.array_equal(loaded.predict(x), trained.predict(x))
    assert loaded.stages == STAGES and loaded.info.stage_agreement_rates == [0.7, 0.9]
    assert AgreementPredictor.load(path).schema == FeatureSchema(3)  # no expectation: no check


def test_load_refuses_another_model_pair(trained, tmp_path):
    path = tmp_path / "predictor.json"
    trained.save(path)
    other = [STAGES[0], StageIdentity("m@q4_0", "d" * 64), STAGES[2]]
    with pytest.raises(PredictorMismatchError, match="trained for the stages m@int8 .* but the cascade runs .*m@q4_0"):
        AgreementPredictor.load(path, expected_stages=other)
    with pytest.raises(PredictorMismatchError):
        AgreementPredictor.load(path, expected_stages=STAGES[1:])
    renamed = [StageIdentity("renamed", s.fingerprint) for s in STAGES]  # same weights, other name: fine
    AgreementPredictor.load(path, expected_stages=renamed)


def test_load_refuses_another_schema_version(trained, tmp_path):
    data = trained.to_dict()
    data["schema"]["version"] = 99
    with pytest.raises(PredictorMismatchError, match="schema version 99"):
        AgreementPredictor.from_dict(data)


def test_stage_spec_parsing():
    assert parse_stage_spec("default@int8") == StageSpec("default", "float32", "int8")
    assert parse_stage_spec("default@bf16") == StageSpec("default", "bfloat16")
    assert parse_stage_spec("/models/x") == StageSpec("/models/x")
    assert parse_stage_spec("default@bf16").name == "default@bf16"
    with pytest.raises(ValueError, match="unknown variant"):
        parse_stage_spec("default@int3")


# --- the runtime policy ------------------------------------------------------------------------------


class FixedPredictor(AgreementPredictor):
    def __init__(self, p: float):
        super().__init__(FeatureSchema(3), STAGES)
        self.p = p

    def predict_one(self, features):
        return self.p


def test_stopper_follows_the_worked_example_and_learns_from_observations():
    stopper = AdaptiveStopper(FixedPredictor(0.9), COSTS, lam=4.0, shrinkage=StageShrinkage(2, predictor_weight=1e9))
    x = [0.0] * FeatureSchema(3).num_features
    stopper.shrinkage.posteriors[1].alpha, stopper.shrinkage.posteriors[1].beta = 8.0, 2.0  # stage 1 rate 0.8
    assert stopper.agree_prob(0, x) == pytest.approx(0.9, abs=1e-6)
    assert not stopper.decide(0, x).stop  # the worked example, lambda 4: go on
    assert stopper.decide(0, x, lam=2.0).stop
    assert not stopper.decide(0, x, lam=INF).stop and not stopper.decide(1, x, lam=INF).stop
    assert stopper.decide(2, x, lam=INF).stop  # the final stage always stops
    assert stopper.decide(0, x, lam=0.0).stop
    for _ in range(30):  # stage 1 turns out to be always right: then stopping at 0 loses less than before
        stopper.observe(1, True)
    assert stopper.shrinkage.rate(1) == pytest.approx(38 / 40)
    assert stopper.decide(0, x).expected_loss == pytest.approx(1 - 0.9 * 38 / 40, abs=1e-6)


def test_stopper_lambda_infinity_never_stops_early_whatever_the_predictor_says():
    stopper = AdaptiveStopper(FixedPredictor(1.0), [0.0, 0.0, 1.0], lam=INF, shrinkage=StageShrinkage(2, prior_rates=[0.999, 0.999]))
    x = [0.0] * FeatureSchema(3).num_features
    assert [stopper.decide(j, x).stop for j in range(3)] == [False, False, True]


def test_stopper_refuses_wrong_costs():
    with pytest.raises(ValueError, match="stage costs"):
        AdaptiveStopper(FixedPredictor(0.5), [0.1, 1.0], lam=1.0)


# --- collection on real (tiny) stages ----------------------------------------------------------------


def test_collect_rows_on_tiny_stages_then_train_and_evaluate(tiny_model_dir, tmp_path):
    from specmesh.cascade.stage_model import StageModel
    from specmesh.cascade.training import Dataset, collect_prompt, evaluate, read_dataset, train_predictor, write_dataset
    from specmesh.decoding.sampling import SamplingParams
    from specmesh.models.load import load_engine

    other, same = str(tiny_model_dir("llama", init_std=0.2, seed=1)), str(tiny_model_dir("llama", init_std=0.2))
    stages = [StageModel(load_engine(other)), StageModel(load_engine(same)), StageModel(load_engine(same, dtype="float64"))]
    schema = FeatureSchema(3)
    params = SamplingParams(temperature=0)
    rows = []
    for index, prompt in enumerate([[5, 17, 33, 5, 17, 33], [7, 8, 9, 10], [40, 41, 40, 41, 40], [3, 3, 3]]):
        rows += list(collect_prompt(stages, prompt, index, schema, params, chunk_tokens=3, max_new_tokens=12, eos_token_ids=[]))
    assert len(rows) == 4 * (12 // 3) * 2
    by_chunk = [rows[i:i + 2] for i in range(0, len(rows), 2)]
    assert all([r.stage for r in pair] == [0, 1] for pair in by_chunk)
    for low, high in by_chunk:
        assert high.agreed == high.final_agreed  # greedy: the final stage agrees with C_1 iff it accepted all of it
        if low.agreed and high.agreed:
            assert low.final_agreed  # the chain: every stage above agreed, so the final stage did
    assert all(r.agreed for r in rows if r.stage == 1)  # fp32 vs fp64 of one model
    assert not all(r.agreed for r in rows if r.stage == 0)  # another model's weights
    assert all(len(r.x) == schema.num_features and r.x[-2:] == ([1.0, 0.0] if r.stage == 0 else [0.0, 1.0]) for r in rows)

    identities = STAGES
    path = tmp_path / "rows.jsonl"
    write_dataset(path, Dataset(schema, identities, rows, [0.5, 0.7, 1.0], {"chunk_tokens": 3}))
    dataset = read_dataset(path)
    assert dataset.rows == rows and dataset.stages == identities and dataset.header["chunk_tokens"] == 3
    train_rows, held = dataset.split(4)
    assert {r.prompt for r in held} == {3} and {r.prompt for r in train_rows} == {0, 1, 2}
    predictor, _ = train_predictor(dataset, eval_every=4)
    assert predictor.info.stage_agreement_rates[1] == 1.0 and predictor.info.stage_forward_costs == [0.5, 0.7, 1.0]
    result = evaluate(predictor, dataset)
    assert result.overall.num_rows == len(rows)
    observed, product = result.final_agreement[1]
    assert observed == product == 1.0
