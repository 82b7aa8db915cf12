"""On a CUDA device: an engine forward, greedy speculative == plain, seeded sampling, beam search.

Every other engine test runs on the CPU; these catch a tensor left on the CPU (mixing devices fails
only on a real device). The CPU engine of the same folder is the reference.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_ids, run_alone

from specmesh.decoding.beam import beam_search
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models.load import load_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
PROMPTS = [
    [5, 17, 33, 5, 17, 33, 5, 17],  # repetitive: n-gram drafts get accepted
    [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3],
]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama", init_std=0.2)  # peaked logits: no greedy near-ties


def test_engine_forward_matches_the_cpu_engine(folder):
    cpu = load_engine(folder, dtype="float32")
    gpu = load_engine(folder, dtype="float32", device=DEVICE)
    ids = random_ids(cpu.vocab_size, 20, seed=0)
    chunks = [12, 1, 1, 6]  # a prefill, two decode steps, a verify-sized forward
    got = run_alone(gpu, ids, chunks)
    torch.testing.assert_close(got.cpu(), run_alone(cpu, ids, chunks), atol=1e-3, rtol=1e-3)
    assert gpu.num_free_blocks == gpu.cache.blocks.num_blocks


def test_greedy_speculative_equals_plain(folder):
    verifier = TargetVerifier(load_engine(folder, dtype="float64", device=DEVICE))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=32)
    for prompt in PROMPTS:
        plain = generate(verifier, None, prompt, params)
        spec = generate(verifier, PromptLookupDrafter(min_n=1, max_n=3), prompt, params)
        assert len(plain.token_ids) == 32
        assert spec.token_ids == plain.token_ids


def test_seeded_speculative_sampling_is_reproducible(folder):
    verifier = TargetVerifier(load_engine(folder, dtype="float32", device=DEVICE))

    def run(seed):
        params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=seed, ignore_eos=True, max_new_tokens=24)
        return generate(verifier, PromptLookupDrafter(min_n=1, max_n=3), PROMPTS[1], params).token_ids

    first = run(1)
    assert len(first) == 24
    assert run(1) == first


def test_beam_search_matches_the_cpu_engine(folder):
    cpu = load_engine(folder, dtype="float64")
    gpu = load_engine(folder, dtype="float64", device=DEVICE)
    free_before = gpu.num_free_blocks
    for num_beams in (1, 3):
        expected = beam_search(cpu, PROMPTS[1], num_beams=num_beams, max_new_tokens=10, eos_token_ids=[])
        got = beam_search(gpu, PROMPTS[1], num_beams=num_beams, max_new_tokens=10, eos_token_ids=[])
        assert got.token_ids == expected.token_ids
        assert [h.token_ids for h in got.hypotheses] == [h.token_ids for h in expected.hypotheses]
    assert gpu.num_free_blocks == free_before
