"""Plain steps launched ahead (`TargetVerifier(plain_ahead=True)`, specmesh/decoding/verifier.py).

On CUDA a forward returns with its kernels queued, so the verifier launches a session's next plain
forward before it returns the round. On the CPU the forward computes when it is called, which is
slower, not wrong: the bookkeeping (the launched forward taken, or dropped and its KV truncated) is
the same, and these tests check it there against a verifier that launches nothing.
"""

from __future__ import annotations

import pytest

from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine

PROMPT = [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return load_engine(tiny_model_dir("llama", init_std=0.2), dtype="float32", max_kv_tokens=2048, block_size=4)


def test_the_cpu_engine_launches_nothing_ahead_by_default(engine):
    assert not engine.launches_ahead
    assert not TargetVerifier(engine).plain_ahead


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=50, seed=11, max_new_tokens=40, ignore_eos=True),
], ids=["greedy", "seeded-sampling"])
def test_plain_decoding_is_the_same_with_steps_ahead(engine, params):
    free = engine.num_free_blocks
    want = generate(TargetVerifier(engine, plain_ahead=False), None, PROMPT, params).token_ids
    ahead = TargetVerifier(engine, plain_ahead=True)
    got = generate(ahead, None, PROMPT, params).token_ids
    assert got == want and len(got) == 40
    # 39 plain rounds after the prefill's: all but the first took a launched forward; none launched past the budget
    assert ahead.num_ahead_launched == ahead.num_ahead_taken == 38
    assert engine.num_free_blocks == free


def test_a_stop_token_drops_the_step_launched_ahead(engine):
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    tokens = generate(TargetVerifier(engine, plain_ahead=False), None, PROMPT, greedy).token_ids
    stop = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=[tokens[10]], ignore_eos=True)
    free = engine.num_free_blocks
    want = generate(TargetVerifier(engine, plain_ahead=False), None, PROMPT, stop).token_ids
    ahead = TargetVerifier(engine, plain_ahead=True)
    got = generate(ahead, None, PROMPT, stop).token_ids
    assert got == want and got[-1] == tokens[10] and len(got) <= 11
    assert ahead.num_ahead_launched == ahead.num_ahead_taken + 1  # the one after the stop token, dropped
    assert engine.num_free_blocks == free


def _open(verifier):
    generator, _ = make_generator(3, verifier.engine.device)
    return verifier.open(PROMPT, SamplingParams(temperature=0, max_new_tokens=64), generator)


@pytest.mark.parametrize("then", ["draft", "rewind", "unverified", "fork"])
def test_whatever_comes_next_sees_the_session_as_if_nothing_was_launched(engine, then):
    """A plain round that says the next is plain, then something else: the launched forward is dropped
    and the session goes on exactly as on a verifier that launched nothing."""
    results = []
    for plain_ahead in (False, True):
        verifier = TargetVerifier(engine, plain_ahead=plain_ahead)
        session = _open(verifier)
        for _ in range(3):
            verifier.verify(session, DraftProposal(token_ids=[]), plain_next=True)
        assert engine.seq_len(session.seq_id) == session.num_cached + plain_ahead  # the launched forward's slot
        sessions = [session]
        if then == "draft":
            verifier.verify(session, DraftProposal(token_ids=[session.token_ids[-1], 5, 9]))
        elif then == "rewind":
            verifier.rewind(session, session.token_ids[:-2])
        elif then == "unverified":
            verifier.append_unverified(session, [5, 9])
        else:
            sessions = verifier.fork(session, [SamplingParams(temperature=0)] * 2,
                                     [make_generator(s, engine.device)[0] for s in (1, 2)], append_token_ids=[5])
        assert engine.seq_len(session.seq_id) == session.num_cached
        for _ in range(3):
            for s in sessions:
                verifier.verify(s, DraftProposal(token_ids=[]), plain_next=True)
        results.append([list(s.token_ids) for s in sessions])
        # two taken before; after, each session's first round launches again and its next two take
        assert verifier.num_ahead_taken == (2 + 2 * len(sessions) if plain_ahead else 0)
        for s in {id(x): x for x in [session, *sessions]}.values():
            verifier.close(s)
    assert results[0] == results[1]


def test_a_batch_with_others_drops_it(engine):
    verifier = TargetVerifier(engine, plain_ahead=True)
    first, second = _open(verifier), _open(verifier)
    verifier.verify(first, DraftProposal(token_ids=[]), plain_next=True)
    assert verifier.num_ahead_launched == 1
    verifier.verify_many([first, second], [DraftProposal(token_ids=[])] * 2)
    assert verifier.num_ahead_taken == 0
    assert engine.seq_len(first.seq_id) == first.num_cached
    assert first.token_ids[len(PROMPT):] == second.token_ids[len(PROMPT):] + [first.token_ids[-1]]  # greedy, one round more
    verifier.close(first)
    verifier.close(second)
