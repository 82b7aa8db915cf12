"""Chunked prefill (`TargetVerifier.begin` + `prefill_chunk` + a round with no draft) is exactly `open`:
the same first token and the same tokens after it, greedy and seeded sampling, on both backends, for
chunk sizes that do and do not divide the prompt. Float64 tiny model, peaked logits (no near-ties)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_ids

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.verifier import TargetSession, TargetVerifier
from specmesh.kv.errors import OutOfBlocksError

NUM_DECODED = 12
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=0)
EMPTY = DraftProposal(token_ids=[])


@pytest.fixture(scope="module", params=["native", "hf"])
def verifier(request, tiny_model_dir):
    from specmesh.models.load import load_engine

    return TargetVerifier(load_engine(tiny_model_dir("llama", init_std=0.2), backend=request.param, dtype="float64"))


def chunked_open(verifier: TargetVerifier, prompt: list[int], params: SamplingParams, seed: int,
                 chunk_tokens: int) -> TargetSession:
    """As the Verify service opens a session: chunks while more than one chunk is uncached, then the
    round with no draft feeds the rest and samples the first token."""
    session = verifier.begin(prompt, params, make_generator(seed)[0])
    while chunk_tokens < session.num_uncached:
        verifier.prefill_chunk(session, chunk_tokens)
    verifier.verify(session, EMPTY)
    return session


def decode(verifier: TargetVerifier, session: TargetSession) -> tuple[list[int], list[torch.Tensor]]:
    """The session's tokens after NUM_DECODED plain rounds, and the logits that judged each."""
    logits = []
    for _ in range(NUM_DECODED):
        logits.append(verifier.verify(session, EMPTY, keep_logits=True).logits)
    verifier.close(session)
    return session.token_ids, logits


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("prompt_len", [1, 2, 10, 37])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 16, 64])
def test_chunked_open_equals_open(verifier, params, prompt_len, chunk_tokens):
    prompt = random_ids(verifier.engine.vocab_size, prompt_len, seed=prompt_len)
    seed = 1000 + prompt_len
    expected_tokens, expected_logits = decode(verifier, verifier.open(prompt, params, make_generator(seed)[0]))
    session = chunked_open(verifier, prompt, params, seed, chunk_tokens)
    assert session.num_cached == prompt_len and session.num_forwards == -(-prompt_len // chunk_tokens)
    tokens, logits = decode(verifier, session)
    assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_chunks_then_a_draft_round(verifier):
    """A speculative round right after a chunked prefill accepts what greedy decoding would emit."""
    prompt = random_ids(verifier.engine.vocab_size, 29, seed=7)
    reference, _ = decode(verifier, verifier.open(prompt, GREEDY, make_generator(0)[0]))
    session = chunked_open(verifier, prompt, GREEDY, 0, chunk_tokens=8)
    draft = reference[30:34]
    outcome = verifier.verify(session, DraftProposal(token_ids=draft))
    verifier.close(session)
    assert outcome.num_accepted == len(draft)
    assert session.token_ids == reference[:35]


def test_prefill_chunk_never_caches_the_last_token(verifier):
    """The module docstring's example: 10 tokens, chunks of 4."""
    session = verifier.begin(list(range(3, 13)), GREEDY, make_generator(0)[0])
    engine = verifier.engine
    assert (session.num_cached, session.num_uncached, engine.seq_len(session.seq_id)) == (0, 10, 0)
    assert verifier.prefill_chunk(session, 4) == 6
    assert verifier.prefill_chunk(session, 4) == 2
    assert verifier.prefill_chunk(session, 4) == 1
    assert verifier.prefill_chunk(session, 4) == 1  # nothing left to feed: no forward
    assert (session.num_cached, engine.seq_len(session.seq_id), session.num_forwards) == (9, 9, 3)
    with pytest.raises(ValueError):
        verifier.prefill_chunk(session, 0)
    verifier.verify(session, EMPTY)
    assert (session.num_cached, session.num_tokens) == (10, 11)
    verifier.close(session)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_failed_chunk_leaves_the_session_as_it_was(tiny_model_dir, backend):
    """A chunk past the KV pool fails, the session keeps what it had cached, and close frees it all."""
    from specmesh.models.load import load_engine

    engine = load_engine(tiny_model_dir("llama", init_std=0.2), backend=backend, dtype="float64", max_kv_tokens=32)
    verifier = TargetVerifier(engine)
    free_before = engine.kv_usage().free_blocks
    session = verifier.begin(random_ids(engine.vocab_size, 45, seed=3), GREEDY, make_generator(0)[0])
    verifier.prefill_chunk(session, 16)
    verifier.prefill_chunk(session, 16)
    with pytest.raises(OutOfBlocksError):
        verifier.prefill_chunk(session, 16)
    assert session.num_cached == engine.seq_len(session.seq_id) == 32
    verifier.close(session)
    assert engine.kv_usage().free_blocks == free_before
