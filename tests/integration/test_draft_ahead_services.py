"""A Draft service that drafts ahead (`draft_ahead`) behind the Coordinator (in-process services on
loopback, tiny random models): greedy output equals target-only decoding, seeded sampling (both
acceptance rules) gives the tokens a Draft service that never drafts ahead gives, drafts ahead are
served, and closing sessions leaves no KV behind."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from service_helpers import speculative_via_coordinator, target_only_greedy, wait_for

from coordinator.options import CoordinatorOptions
from coordinator.server import create_server as create_coordinator
from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.auth import ANONYMOUS
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from specmesh.proto.v1 import common_pb2, coordinator_pb2
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

TIMEOUT_S = 60
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
SPEC = coordinator_pb2.GENERATION_MODE_SPECULATIVE


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def services(target):
    """Two coordinators over one Verify service: one drafts with a Draft service that drafts ahead, the
    other with one that does not. Both drafts are the target in float32 (a self-draft)."""
    running = BackgroundServices()
    try:
        verify = running.start(create_verify(VerifyOptions(model=target, dtype="float64", port=0)))
        addresses = {}
        for ahead in (True, False):
            draft = running.start(create_draft(DraftOptions(model=target, dtype="float32", port=0, draft_ahead=ahead)))
            coordinator = running.start(create_coordinator(CoordinatorOptions(
                model=target, port=0, draft_addresses=f"127.0.0.1:{draft.port}", verify_addresses=f"127.0.0.1:{verify.port}")))
            addresses[ahead] = (f"127.0.0.1:{coordinator.port}", draft.servicer, draft.port)
        yield addresses
    finally:
        running.close()


async def _generate(address: str, k: int, **sampling) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    return await speculative_via_coordinator(address, PROMPT, k, TIMEOUT_S, **sampling)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def _served(servicer) -> int:
    return sum(drafter.ahead_served for drafter in servicer._drafters.values())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_drafts_ahead_equals_target_only(services, target, k):
    address, servicer, _ = services[True]
    before = _served(servicer)
    tokens, last = _run(_generate(address, k))
    assert tokens == target_only_greedy(target, PROMPT, 48)
    assert last.stats.num_draft_tokens > 0 and last.stats.num_failovers == 0
    assert _served(servicer) > before  # some rounds were answered from drafts made ahead


@pytest.mark.parametrize("rule", [common_pb2.ACCEPTANCE_RULE_STANDARD, common_pb2.ACCEPTANCE_RULE_COUPLED])
@pytest.mark.parametrize("seed", [0, 5])
def test_seeded_sampling_does_not_depend_on_drafting_ahead(services, rule, seed):
    sampling = dict(temperature=0.9, seed=seed, acceptance_rule=rule)
    ahead, _ = _run(_generate(services[True][0], 3, **sampling))
    plain, _ = _run(_generate(services[False][0], 3, **sampling))
    assert ahead == plain


def test_concurrent_streams_with_drafts_ahead_free_their_kv(services, target):
    address, servicer, _ = services[True]

    async def many():
        return await asyncio.gather(*(_generate(address, 3) for _ in range(6)))

    reference = target_only_greedy(target, PROMPT, 48)
    assert all(tokens == reference for tokens, _ in _run(many()))
    kv = servicer.engine.kv_usage
    assert wait_for(lambda: servicer.num_sessions == 0 and kv().free_blocks == kv().total_blocks, 10)


def test_a_forward_ahead_that_would_delay_the_next_call_starts_only_where_guesses_hold(services):
    """A forward ahead is started if it ends before the session's next Propose is expected; one that
    would not, only where the session's measured hit rate says the part done before the call (saved on
    a hit) outweighs the rest (lost on a miss)."""
    from draft_service.servicer import DraftSession
    from specmesh.decoding.ahead import AheadClock

    _, servicer, _ = services[True]
    session = DraftSession(state=None, params=None, generator=None, seed=0, num_tokens=0, clock=AheadClock(answered_at=100.0))
    saved = servicer._ahead_forward_ms
    try:
        servicer._ahead_forward_ms = 30.0
        assert not servicer._due(session, 100.010)  # nothing measured of this session yet: draft ahead
        session.clock.gap_ms = 50.0
        assert not servicer._due(session, 100.010)  # 10 ms in, a 30 ms forward ends before the call at 50 ms
        assert servicer._due(session, 100.025)  # 25 ms in it would not
        session.clock.hit_rate = 0.9
        assert servicer._due(session, 100.025)  # the guess forward (no guess yet): only if it ends in time
        session.state = SimpleNamespace(ahead=object())  # a guess made: the next forward drafts ahead
        assert not servicer._due(session, 100.025)  # 25 ms saved 9 times in 10, 5 ms lost once
        session.clock.hit_rate = 0.8
        assert servicer._due(session, 100.045)  # 5 ms saved 8 times in 10, 25 lost twice
        session.clock.hit_rate = None
        servicer._ahead_forward_ms = 80.0
        assert servicer._due(session, 100.0)  # a forward longer than the target's round: not before a guess held
    finally:
        servicer._ahead_forward_ms = saved


def test_the_draft_service_says_it_drafts_ahead_and_what_a_forward_costs(services):
    """A Draft service with `draft_ahead` says so when a session opens, and with each proposal what one
    of its forwards costs now (the caller's k policy prices rounds by what drafting ahead hides); one
    without says neither."""
    from specmesh.proto.v1 import draft_pb2, draft_pb2_grpc

    async def open_and_propose(port: int):
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            opened = await stub.OpenSession(draft_pb2.DraftOpenSessionRequest(
                prompt_token_ids=[1, 2, 3, 4], sampling=common_pb2.SamplingParams(temperature=0.0)), timeout=TIMEOUT_S)
            proposed = await stub.Propose(draft_pb2.ProposeRequest(session_id=opened.session_id, num_draft_tokens=3),
                                          timeout=TIMEOUT_S)
            await stub.CloseSession(draft_pb2.DraftCloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT_S)
            return opened, proposed

    for ahead in (True, False):
        opened, proposed = _run(open_and_propose(services[ahead][2]))
        assert opened.drafts_ahead is ahead
        assert proposed.HasField("ahead_forward_ms") is ahead and len(proposed.draft_token_ids) == 3
        if ahead:
            assert proposed.ahead_forward_ms > 0


def test_a_drafting_ahead_service_prefills_the_prompt_at_open(services):
    """A Draft service that drafts ahead takes a session's prompt in at OpenSession (beside the Verify
    service's prefill: the Coordinator opens both at once), but its last token, which the first Propose
    feeds with the target's first token; one that does not leaves it for the first Propose."""
    from specmesh.proto.v1 import draft_pb2, draft_pb2_grpc

    prompt = [1 + i % 50 for i in range(40)]

    async def open_and_look(port: int, servicer):
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            opened = await stub.OpenSession(draft_pb2.DraftOpenSessionRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0.0)), timeout=TIMEOUT_S)
            state = servicer.sessions.get(opened.session_id, ANONYMOUS).value.state
            in_kv = servicer.engine.seq_len(state.seq_id)
            pending = list(state.pending)
            proposed = await stub.Propose(draft_pb2.ProposeRequest(session_id=opened.session_id, num_draft_tokens=3,
                                                                   accepted_token_ids=[7]), timeout=TIMEOUT_S)
            await stub.CloseSession(draft_pb2.DraftCloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT_S)
            return in_kv, pending, list(proposed.draft_token_ids)

    results = {}
    for ahead in (True, False):
        _, servicer, port = services[ahead]
        assert wait_for(lambda s=servicer: s.num_sessions == 0, 10)
        results[ahead] = _run(open_and_look(port, servicer))
    assert results[True][:2] == (len(prompt) - 1, prompt[-1:])
    assert results[False][:2] == (0, prompt)
    assert results[True][2] == results[False][2]  # the same drafts either way


def test_prompts_are_prefilled_at_open_only_while_sessions_draft(services):
    """Sessions closed without a draft asked of them (a load where no draft pays) stop the prefill at
    open, which would be work for nothing; sessions that draft again bring it back."""
    from specmesh.proto.v1 import draft_pb2, draft_pb2_grpc

    _, servicer, port = services[True]
    prompt = [1 + i % 50 for i in range(40)]

    async def session(k: int) -> int:
        """One session, a Propose of k drafts if k: the tokens its open put in the KV."""
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            opened = await stub.OpenSession(draft_pb2.DraftOpenSessionRequest(
                prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0.0)), timeout=TIMEOUT_S)
            in_kv = servicer.engine.seq_len(servicer.sessions.get(opened.session_id, ANONYMOUS).value.state.seq_id)
            if k:
                await stub.Propose(draft_pb2.ProposeRequest(session_id=opened.session_id, num_draft_tokens=k,
                                                            accepted_token_ids=[7]), timeout=TIMEOUT_S)
            await stub.CloseSession(draft_pb2.DraftCloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT_S)
            return in_kv

    assert wait_for(lambda: servicer.num_sessions == 0, 10)
    prefilled = [_run(session(0)) for _ in range(4)]  # none drafts
    assert prefilled[0] == len(prompt) - 1 and prefilled[-1] == 0
    prefilled = [_run(session(3)) for _ in range(4)]  # every one drafts
    assert prefilled[0] == 0 and prefilled[-1] == len(prompt) - 1
