"""Native engine == transformers on tiny random models of each family: prefill and decode logits."""

import pytest
import torch
from engine_helpers import hf_logits, random_ids, run_alone, with_sliding_window
from transformers import AutoModelForCausalLM

from specmesh.models.load import load_engine
from specmesh.models.tiny import NATIVE_FAMILIES


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_prefill_and_decode_match_transformers_float64(family, tiny_model_dir):
    path = tiny_model_dir(family)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    engine = load_engine(path, backend="native", dtype="float64")
    assert engine.model.kernel == "plain"
    for prompt_length, seed in ((1, 0), (7, 1), (33, 2)):
        ids = random_ids(engine.vocab_size, prompt_length + 6, seed)
        expected = hf_logits(reference, ids)
        # prefill the prompt in one forward, then decode one token at a time
        got = run_alone(engine, ids, [prompt_length] + [1] * 6)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert engine.num_free_blocks == engine.cache.blocks.num_blocks


@pytest.mark.parametrize("family", ("llama3", "qwen2", "qwen3"))
def test_float32_fast_kernels_match_transformers(family, tiny_model_dir):
    path = tiny_model_dir(family)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = load_engine(path, dtype="float32")
    ids = random_ids(engine.vocab_size, 24, seed=3)
    expected = hf_logits(reference, ids)
    got = run_alone(engine, ids, [10, 5, 1, 1, 1, 6])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)


def test_bfloat16_close_to_transformers(tiny_model_dir):
    path = tiny_model_dir("smollm2")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    engine = load_engine(path, dtype="bfloat16")
    ids = random_ids(engine.vocab_size, 16, seed=4)
    expected = hf_logits(reference, ids)
    got = run_alone(engine, ids, [12, 1, 1, 1, 1])
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


def test_int8_quantized_engine_stays_close(tiny_model_dir):
    path = tiny_model_dir("llama")
    exact = load_engine(path, dtype="float32")
    quantized = load_engine(path, dtype="float32", quantize="int8")
    ids = random_ids(exact.vocab_size, 12, seed=5)
    got = run_alone(quantized, ids, [8, 1, 1, 1, 1])
    expected = run_alone(exact, ids, [8, 1, 1, 1, 1])
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_engine_metadata(tiny_model_dir):
    engine = load_engine(tiny_model_dir("llama"), dtype="float32")
    assert engine.eos_token_ids == (2,)
    assert engine.max_context == 512 and engine.vocab_size == 384
    assert engine.dtype == torch.float32 and engine.device == torch.device("cpu")


def test_mistral_sliding_window_matches_transformers(tiny_model_dir, tmp_path):
    path = with_sliding_window(tiny_model_dir("mistral"), tmp_path / "mistral-window", 6)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    engine = load_engine(path, dtype="float64")
    assert set(engine.model.config.sliding_windows) == {6}
    ids = random_ids(engine.vocab_size, 20, seed=6)
    got = run_alone(engine, ids, [11, 1, 1, 4, 3])
    torch.testing.assert_close(got, hf_logits(reference, ids), atol=1e-4, rtol=0)
