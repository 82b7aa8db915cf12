"""The speculation loop on the real engine: greedy exactness per drafter and k, seeds, stopping."""

from __future__ import annotations

import pytest

from specmesh.decoding.adaptive import AdaptiveK, FixedK
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import FinishReason, generate, speculative_stream
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramStoreDrafter, PromptLookupDrafter
from specmesh.models.load import load_engine

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 17, 33, 5, 17, 33, 5, 17],  # repetitive: n-gram drafts get accepted
    [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3],
    [42],
]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    target_dir = tiny_model_dir("llama", init_std=0.2)
    other_dir = tiny_model_dir("qwen2", init_std=0.2)  # an unrelated drafter: low acceptance
    return {
        "target": load_engine(target_dir, dtype="float64"),
        "self": load_engine(target_dir, dtype="float32"),  # self-draft at lower precision
        "other": load_engine(other_dir, dtype="float64"),
    }


def _drafter(kind, engines):
    if kind == "ngram":
        return PromptLookupDrafter(min_n=1, max_n=3)
    if kind == "ngram-store":
        return NgramStoreDrafter(min_n=1, max_n=3)
    return ModelDrafter(engines[kind])


@pytest.mark.parametrize("drafter_kind", ["self", "other", "ngram", "ngram-store"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculative_equals_target_only(engines, drafter_kind, k):
    verifier = TargetVerifier(engines["target"])
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=40, **GREEDY)
        plain = generate(verifier, None, prompt, params)
        spec = generate(verifier, _drafter(drafter_kind, engines), prompt, params, k_policy=FixedK(k))
        assert spec.token_ids == plain.token_ids
        assert len(spec.token_ids) == 40 and spec.finish_reason is FinishReason.LENGTH
        assert spec.stats.num_target_forwards <= plain.stats.num_target_forwards
    if drafter_kind == "self" and k >= 4:  # the self-draft agrees almost always: far fewer forwards
        assert spec.stats.num_target_forwards < plain.stats.num_target_forwards / 2


def test_adaptive_k_is_exact_and_frees_everything(engines):
    verifier = TargetVerifier(engines["target"])
    blocks_before = engines["target"].num_free_blocks, engines["self"].num_free_blocks
    params = SamplingParams(max_new_tokens=60, **GREEDY)
    plain = generate(verifier, None, PROMPTS[1], params)
    spec = generate(verifier, ModelDrafter(engines["self"]), PROMPTS[1], params, k_policy=AdaptiveK())
    assert spec.token_ids == plain.token_ids
    assert spec.stats.mean_accepted_length > 2
    assert (engines["target"].num_free_blocks, engines["self"].num_free_blocks) == blocks_before


@pytest.mark.parametrize("drafter_kind", ["other", "ngram"])
def test_seeded_sampling_reproducible(engines, drafter_kind):
    verifier = TargetVerifier(engines["target"])

    def run(seed):
        params = SamplingParams(temperature=1.0, top_k=20, seed=seed, max_new_tokens=30, ignore_eos=True)
        return generate(verifier, _drafter(drafter_kind, engines), PROMPTS[1], params, k_policy=FixedK(4)).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_stream_events_add_up(engines):
    verifier = TargetVerifier(engines["target"])
    params = SamplingParams(max_new_tokens=25, **GREEDY)
    events = list(speculative_stream(verifier, ModelDrafter(engines["self"]), PROMPTS[0], params, k_policy=FixedK(4)))
    assert all(e.finish_reason is None for e in events[:-1]) and events[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(e.token_ids) for e in events) == 25
    stats = events[-1].stats
    assert stats.num_generated_tokens == 25
    assert stats.num_target_forwards == len(events)  # prefill + one forward per round
    assert all(len(e.token_ids) == e.num_accepted_tokens + 1 for e in events[1:-1])


def test_eos_and_stop_strings(engines):
    verifier = TargetVerifier(engines["target"])
    params = SamplingParams(max_new_tokens=30, **GREEDY)
    plain = generate(verifier, None, PROMPTS[1], params).token_ids
    eos_token = plain[7]
    with_eos = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[eos_token])
    result = generate(verifier, ModelDrafter(engines["self"]), PROMPTS[1], with_eos, k_policy=FixedK(8))
    assert result.finish_reason is FinishReason.EOS
    assert result.token_ids == plain[: plain.index(eos_token) + 1]

    def decode(ids):
        return " ".join(f"<{t}>" for t in ids)

    stop = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True, stop=[f"<{plain[4]}> <{plain[5]}>"])
    result = generate(verifier, ModelDrafter(engines["self"]), PROMPTS[1], stop, k_policy=FixedK(8), decode=decode)
    assert result.finish_reason is FinishReason.STOP
    assert result.token_ids == plain[:6]


def test_context_window_ends_generation(engines):
    verifier = TargetVerifier(engines["target"])
    max_context = engines["target"].max_context
    prompt = [7] * (max_context - 10)
    params = SamplingParams(max_new_tokens=100, **GREEDY)
    spec = generate(verifier, ModelDrafter(engines["self"]), prompt, params, k_policy=FixedK(8))
    plain = generate(verifier, None, prompt, params)
    assert spec.finish_reason is FinishReason.CONTEXT and spec.token_ids == plain.token_ids
    assert len(prompt) + len(spec.token_ids) == max_context


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("seed", [0, 11])
def test_seeded_sampling_with_a_deterministic_drafter_equals_plain_sampling(engines, k, seed):
    """One-hot drafts are judged position by position with the uniforms plain decoding reads, so the
    tokens are those of plain decoding with the same seed, whatever is accepted (rejection.py)."""
    verifier = TargetVerifier(engines["target"])
    params = SamplingParams(temperature=1.5, top_k=0, seed=seed, ignore_eos=True, max_new_tokens=40)
    for prompt in PROMPTS[:2]:
        plain = generate(verifier, None, prompt, params)
        speculative = generate(verifier, PromptLookupDrafter(min_n=1, max_n=3), prompt, params, k_policy=FixedK(k))
        assert speculative.token_ids == plain.token_ids
        assert speculative.stats.num_draft_tokens > 0  # drafts were judged, not skipped
