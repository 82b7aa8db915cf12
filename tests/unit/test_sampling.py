import math

import pytest
import torch
from scipy.stats import chisquare

from specmesh.decoding.sampling import (
    SamplingParams,
    make_generator,
    processed_probs,
    sample,
    sample_with_uniforms,
    to_dense,
    to_sparse,
    top_p_filter,
)
from specmesh.decoding.types import SparseProbs

# ---- SamplingParams.validate -------------------------------------------------------------------


def test_defaults_are_valid_and_sampling():
    params = SamplingParams()
    params.validate(vocab_size=10)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": "END"}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, 10]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_validate_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate(vocab_size=10)


# ---- processors --------------------------------------------------------------------------------


def test_greedy_is_one_hot_at_argmax_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 0.0, 4.9]])
    probs = processed_probs(logits, SamplingParams(temperature=0, top_k=1, top_p=0.1))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_scales_logits(temperature):
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    probs = processed_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_higher_temperature_flattens():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    cold = processed_probs(logits, SamplingParams(temperature=0.5))
    hot = processed_probs(logits, SamplingParams(temperature=2.0))
    assert cold.max() > hot.max() and cold.min() < hot.min()


def test_top_k_keeps_k_best_and_renormalises():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    probs = processed_probs(logits, SamplingParams(top_k=2))
    expected = torch.softmax(torch.tensor([[-math.inf, 4.0, 3.0, -math.inf]]), dim=-1)
    torch.testing.assert_close(probs, expected)


def test_top_k_keeps_every_tie_at_the_boundary():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    probs = processed_probs(logits, SamplingParams(top_k=2))
    assert (probs[0] > 0).tolist() == [True, True, True, False]


@pytest.mark.parametrize("top_k", [4, 5, 1000])
def test_top_k_at_or_above_vocab_is_a_no_op(top_k):
    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(processed_probs(logits, SamplingParams(top_k=top_k)), torch.softmax(logits, -1))


def test_top_p_worked_example():
    probs = top_p_filter(torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1]]), 0.5)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]]))


def test_top_p_stops_once_mass_is_reached_exactly():
    # mass before token 1 is exactly 0.5 == top_p, so the nucleus is token 0 alone
    probs = top_p_filter(torch.tensor([[0.5, 0.25, 0.25]]), 0.5)
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0]]))


def test_top_p_keeps_ties_of_the_least_likely_member():
    probs = top_p_filter(torch.tensor([[0.4, 0.2, 0.2, 0.2]]), 0.5)
    torch.testing.assert_close(probs, torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    probs = top_p_filter(torch.tensor([[0.4, 0.2, 0.2, 0.2]]), 0.3)
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_p_one_is_a_no_op_and_tiny_top_p_keeps_the_mode():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(processed_probs(logits, SamplingParams(top_p=1.0)), torch.softmax(logits, -1))
    tiny = processed_probs(logits, SamplingParams(top_p=1e-6))
    assert torch.equal(tiny, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_top_k_then_top_p_on_the_renormalised_top_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top-k 3 -> [4/9, 3/9, 2/9, 0]; mass before token 1 is 4/9 < 0.7, before token 2 is 7/9 >= 0.7
    probs = processed_probs(logits, SamplingParams(top_k=3, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_rows_are_distributions():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2)) * 5
    for params in [SamplingParams(), SamplingParams(temperature=0.3, top_k=7, top_p=0.8), SamplingParams(temperature=0)]:
        probs = processed_probs(logits, params)
        assert probs.dtype == torch.float32 and probs.min() >= 0
        torch.testing.assert_close(probs.sum(-1), torch.ones(8))


def test_processed_probs_rejects_bad_shape():
    with pytest.raises(ValueError, match="vocab"):
        processed_probs(torch.zeros(5), SamplingParams())


# ---- sampling ----------------------------------------------------------------------------------


def test_same_seed_same_samples_different_seed_different_samples():
    probs = torch.full((64, 10), 0.1)
    first = sample(probs, make_generator(123)[0])
    again = sample(probs, make_generator(123)[0])
    other = sample(probs, make_generator(124)[0])
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_make_generator_reports_a_drawn_seed():
    generator, seed = make_generator(None)
    assert isinstance(seed, int) and seed >= 0
    replay, _ = make_generator(seed)
    probs = torch.full((16, 10), 0.1)
    assert torch.equal(sample(probs, generator), sample(probs, replay))


def test_rigged_uniforms_pick_by_inverse_cdf_and_skip_zero_probabilities():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.49, 0.5, 1 - 1e-16], dtype=torch.float64)
    assert sample_with_uniforms(probs, uniforms).tolist() == [1, 1, 3, 3]


def test_unnormalised_rows_sample_their_normalisation():
    probs = torch.tensor([[0.0, 2.0, 6.0]] * 2)
    assert sample_with_uniforms(probs, torch.tensor([0.24, 0.26], dtype=torch.float64)).tolist() == [1, 2]


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.4, 0.3, 0.2])
    ids = sample(probs.expand(20_000, 5), torch.Generator().manual_seed(5))
    counts = torch.bincount(ids, minlength=5)
    assert counts[1] == 0
    support = probs > 0
    assert chisquare(counts[support].numpy(), (probs[support] * 20_000).numpy()).pvalue > 0.001


# ---- sparse distributions ----------------------------------------------------------------------


def test_sparse_round_trip_is_bit_exact():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))
    probs = processed_probs(logits, SamplingParams(temperature=0.7, top_k=20, top_p=0.9))
    for row in probs:
        sparse = to_sparse(row)
        assert sparse.support_size <= 20
        assert torch.equal(to_dense(sparse, 1000), row)


def test_to_dense_rejects_malformed_input():
    with pytest.raises(ValueError, match="lie in"):
        to_dense(SparseProbs(torch.tensor([0, 7]), torch.tensor([0.5, 0.5])), vocab_size=5)
    with pytest.raises(ValueError, match="equal length"):
        to_dense(SparseProbs(torch.tensor([0, 1]), torch.tensor([1.0])), vocab_size=5)
    with pytest.raises(ValueError, match=">= 0"):
        to_dense(SparseProbs(torch.tensor([0, 1]), torch.tensor([1.5, -0.5])), vocab_size=5)
