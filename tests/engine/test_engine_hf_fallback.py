"""The HF fallback engine (any AutoModelForCausalLM) serves the same contract: tiny GPT-2."""

import pytest
import torch
from engine_helpers import hf_logits, random_ids, run_alone
from transformers import AutoModelForCausalLM

from specmesh.kv.errors import OutOfBlocksError
from specmesh.models.engine import NO_PARENT, SeqInput
from specmesh.models.hf_engine import HFEngine
from specmesh.models.load import load_engine


@pytest.fixture(scope="module")
def gpt2(tiny_model_dir):
    path = tiny_model_dir("gpt2")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def test_auto_backend_picks_hf_for_gpt2_and_matches_transformers(gpt2):
    path, reference = gpt2
    engine = load_engine(path, dtype="float64")
    assert isinstance(engine, HFEngine)
    for prompt_length, seed in ((1, 0), (9, 1)):
        ids = random_ids(engine.vocab_size, prompt_length + 5, seed)
        got = run_alone(engine, ids, [prompt_length, 1, 1, 3])
        torch.testing.assert_close(got, hf_logits(reference, ids), atol=1e-4, rtol=0)


def test_batch_truncate_fork_free(gpt2):
    path, reference = gpt2
    engine = load_engine(path, dtype="float64", max_kv_tokens=64)
    ids = random_ids(engine.vocab_size, 16, seed=2)
    a, b = engine.new_sequence(), engine.new_sequence()
    out = engine.forward([SeqInput(a, ids[:8], [7]), SeqInput(b, ids[:3], [0, 2])])
    expected = hf_logits(reference, ids)
    torch.testing.assert_close(out[0], expected[[7]], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(reference, ids[:3])[[0, 2]], atol=1e-4, rtol=0)
    engine.forward([SeqInput(a, [4, 5, 6], [0])])  # rejected
    engine.truncate(a, 8)
    child = engine.fork(a)
    child_out = engine.forward([SeqInput(child, ids[8:12], list(range(4)))])[0]
    torch.testing.assert_close(child_out, expected[8:12], atol=1e-4, rtol=0)
    parent_out = engine.forward([SeqInput(a, ids[8:10], [0, 1])])[0]
    torch.testing.assert_close(parent_out, expected[8:10], atol=1e-4, rtol=0)
    with pytest.raises(OutOfBlocksError):
        engine.forward([SeqInput(b, [1] * 60, [0])])
    with pytest.raises(NotImplementedError):
        engine.forward([SeqInput(b, [1, 2], [0], parents=[NO_PARENT, NO_PARENT])])
    for seq in (a, b, child):
        engine.free(seq)
    assert engine.num_cached_tokens == 0


def test_hf_backend_on_a_llama_matches_native(tiny_model_dir):
    path = tiny_model_dir("llama")
    ids = random_ids(384, 10, seed=3)
    hf = run_alone(load_engine(path, backend="hf", dtype="float64"), ids, [6, 1, 3])
    native = run_alone(load_engine(path, backend="native", dtype="float64"), ids, [6, 1, 3])
    torch.testing.assert_close(hf, native, atol=1e-4, rtol=0)
