"""`measure_step`: a freshly loaded engine learns what a one-token forward costs before any generation
(the prior a k policy needs to skip a drafter that cannot pay from its first round), without a trace
in its KV pool or in the counters a generation's stats read."""

from __future__ import annotations

import dataclasses

import torch

from specmesh.decoding.adaptive import AdaptiveK, LinearCostFit
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.engine import PREFILL_STAT_TOKENS, ROUND_STAT_TOKENS, SeqInput, measure_step
from specmesh.models.load import load_engine


def test_a_fresh_engine_knows_its_step_and_keeps_no_trace(tiny_model_dir):
    engine = load_engine(tiny_model_dir("llama"), dtype="float64")
    before, free = dataclasses.replace(engine.stats), engine.kv_usage().free_blocks
    assert before.step_ms is None
    step_ms = measure_step(engine)
    assert step_ms is not None and step_ms > 0 and engine.stats.step_ms == step_ms
    assert engine.stats.prefill_ms_per_token is not None and engine.stats.prefill_ms_per_token > 0
    timings = engine.stats.round_timings
    assert [tokens for tokens, _ in timings] == [1, *ROUND_STAT_TOKENS] and all(ms > 0 for _, ms in timings)
    fit = LinearCostFit()
    fit.seed(timings, weight=1.0)
    fixed_ms, ms_per_token = fit.estimate()
    assert fixed_ms >= 0 and ms_per_token >= 0 and fixed_ms + ms_per_token > 0
    assert dataclasses.replace(engine.stats, step_ms=None, prefill_ms_per_token=None, round_timings=None) == before  # no forward counted
    assert engine.kv_usage().free_blocks == free


def test_an_hf_engine_is_left_as_it_is(tiny_model_dir):
    engine = load_engine(tiny_model_dir("llama"), backend="hf", dtype="float64")
    assert measure_step(engine) is None and engine.stats.step_ms is None and engine.stats.prefill_ms_per_token is None


def test_with_measured_steps_a_drafter_slower_than_the_target_is_not_run_in_the_first_round(tiny_model_dir):
    folder = tiny_model_dir("llama")
    target, draft = load_engine(folder, dtype="float64"), load_engine(folder, dtype="float64")
    measure_step(target)
    measure_step(draft)
    draft.stats.step_ms = 10 * target.stats.step_ms  # as a bf16 self-draft through the torch path on a CPU
    result = generate(TargetVerifier(target), ModelDrafter(draft), [1, 2, 3],
                      SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True), k_policy=AdaptiveK())
    assert len(result.token_ids) == 12 and not any(event.num_draft_tokens for event in result.events)


def test_a_one_sequence_prefill_records_what_a_token_of_it_costs(tiny_model_dir):
    """What a model drafter's catch-up on tokens it was not told costs (`ModelDrafter.catch_up_ms_per_token`):
    one-sequence forwards of PREFILL_STAT_TOKENS or more; not decode steps, not a batch of sequences."""
    engine = load_engine(tiny_model_dir("llama"), dtype="float64")
    drafter = ModelDrafter(engine)
    first, second = engine.new_sequence(), engine.new_sequence()
    short = list(range(1, PREFILL_STAT_TOKENS))
    engine.forward([SeqInput(first, short, logits_at=[len(short) - 1])])
    engine.forward([SeqInput(first, [5], logits_at=[0]), SeqInput(second, list(range(1, 20)), logits_at=[18])])
    assert engine.stats.prefill_ms_per_token is None and drafter.catch_up_ms_per_token is None
    engine.forward([SeqInput(first, list(range(1, 20)), logits_at=[18])])
    assert engine.stats.prefill_ms_per_token is not None and engine.stats.prefill_ms_per_token > 0
    assert drafter.catch_up_ms_per_token == engine.stats.prefill_ms_per_token


def test_a_verifier_prices_draft_tokens_from_the_measured_round_cost_before_any_round(tiny_model_dir):
    """The fit starts from `round_timings` (seeded when first asked, even if measured after the verifier was made),
    so a first draft is priced by what chains cost here, and one slow probe moves it only part of the way."""
    engine = load_engine(tiny_model_dir("llama"), dtype="float64")
    verifier = TargetVerifier(engine)
    assert verifier.forward_cost() is None  # nothing measured, no rounds
    measure_step(engine)
    engine.stats.round_timings = ((1, 21.0), (5, 25.0), (9, 29.0))  # 20 ms + 1 a token (stand-ins for this machine's)
    cost = verifier.forward_cost()
    assert cost is not None and abs(cost.fixed_ms - 20.0) < 1e-9 and abs(cost.ms_per_token - 1.0) < 1e-9
    for tokens, ms in [(1, 21.0), (2, 27.0), (1, 21.0)]:  # a probe's two-token forward read 6 ms a token
        verifier._round_costs.observe(tokens, ms)
    cost = verifier.forward_cost()
    assert 0.5 < cost.ms_per_token < 2.0, cost  # without the seed: 6.0


def test_one_slow_forward_barely_moves_the_step_a_lasting_slowdown_does():
    """A forward slowed by another process (twice the usual) moves the average by 5%, not 20%: such a
    timing is taken in capped; faster ones (at weight FAST_TIMING_WEIGHT: a figure that read high comes down
    in two forwards), and a slowdown that lasts, come through."""
    from specmesh.models.engine import FAST_TIMING_WEIGHT, SLOW_TIMING_CAP, EngineStats

    stats = EngineStats(step_ms=10.0)
    stats.record_step(20.0)
    assert abs(stats.step_ms - (0.8 * 10.0 + 0.2 * SLOW_TIMING_CAP * 10.0)) < 1e-9 and stats.step_ms < 10.6
    stats.record_step(5.0)
    assert abs(stats.step_ms - ((1 - FAST_TIMING_WEIGHT) * 10.5 + FAST_TIMING_WEIGHT * 5.0)) < 1e-9
    for _ in range(40):
        stats.record_step(20.0)
    assert stats.step_ms > 19.0
    stats.record_prefill(300.0, 10)
    stats.record_prefill(600.0, 10)
    assert abs(stats.prefill_ms_per_token - (0.8 * 30.0 + 0.2 * SLOW_TIMING_CAP * 30.0)) < 1e-9


def test_verify_chains_keep_the_step_current_where_no_one_token_forward_runs(tiny_model_dir):
    """Rounds that all draft run no one-token forward; each lone chain's forward, scaled by the fitted
    costs to the step it implies, moves the engine's step, so a step measured on a quieter machine
    (here: a quarter of the real one) does not stay to price the next request's drafts."""
    engine = load_engine(tiny_model_dir("llama"), dtype="float64")
    measured = measure_step(engine)
    verifier = TargetVerifier(engine)
    session = verifier.open(list(range(3, 23)), SamplingParams(temperature=0.0, max_new_tokens=400), torch.Generator())
    stale = engine.stats.step_ms = measured / 4
    for _ in range(40):
        verifier.verify(session, DraftProposal(token_ids=[5, 6, 7, 8]))
    assert engine.stats.step_ms > 2 * stale
    verifier.close(session)


def test_a_stopped_timing_gives_way_and_leaves_the_stats_and_the_pool_as_they_were(tiny_model_dir):
    """`stop` is asked before each forward: the timing a service runs on borrowed cores ends when their
    owner (or a job queued behind it) wants them, with nothing half-measured left behind."""
    import pytest

    from specmesh.models.engine import TimingStopped

    engine = load_engine(tiny_model_dir("llama"), dtype="float64")
    measure_step(engine)
    before, free = dataclasses.replace(engine.stats), engine.kv_usage().free_blocks
    for allowed in (0, 2, 6):  # stopped before the first forward, among the steps, among the round timings
        asked: list[int] = []

        def stop(asked=asked, allowed=allowed) -> bool:
            asked.append(1)
            return len(asked) > allowed

        with pytest.raises(TimingStopped):
            measure_step(engine, stop=stop)
        assert len(asked) == allowed + 1
        assert engine.stats == before and engine.kv_usage().free_blocks == free
    assert measure_step(engine, stop=lambda: False) is not None  # never told to stop: timed as before
