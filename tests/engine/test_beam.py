"""Beam search on the engine: beams are KV forks; result equals transformers' beam search."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specmesh.decoding.beam import beam_search
from specmesh.models.load import load_engine


@pytest.mark.parametrize("num_beams", [1, 3])
def test_beam_search_matches_transformers(tiny_model_dir, num_beams):
    folder = tiny_model_dir("llama", init_std=0.1)
    engine = load_engine(folder, dtype="float64")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    prompt = [5, 90, 31, 7, 250]
    free_before = engine.num_free_blocks
    ours = beam_search(engine, prompt, num_beams=num_beams, max_new_tokens=12, eos_token_ids=[])
    out = hf.generate(torch.tensor([prompt]), num_beams=num_beams, do_sample=False, max_new_tokens=12,
                      min_new_tokens=12, eos_token_id=None, pad_token_id=0, length_penalty=1.0)
    assert ours.token_ids == out[0, len(prompt):].tolist()
    assert len(ours.hypotheses) == num_beams
    assert engine.num_free_blocks == free_before  # every beam's fork was freed


def test_beam_search_finishes_on_eos(tiny_model_dir):
    folder = tiny_model_dir("llama", init_std=0.1)
    engine = load_engine(folder, dtype="float64")
    prompt = [5, 90, 31, 7, 250]
    free_run = beam_search(engine, prompt, num_beams=2, max_new_tokens=10, eos_token_ids=[])
    eos = free_run.token_ids[3]  # make a token the best beam emits into the EOS
    result = beam_search(engine, prompt, num_beams=2, max_new_tokens=10, eos_token_ids=[eos])
    assert any(h.token_ids[-1] == eos for h in result.hypotheses)
    for hypothesis in result.hypotheses:
        assert eos not in hypothesis.token_ids[:-1]
        assert hypothesis.score == pytest.approx(hypothesis.logprob / len(hypothesis.token_ids))
    with pytest.raises(ValueError):
        beam_search(engine, prompt, num_beams=0, max_new_tokens=4)
