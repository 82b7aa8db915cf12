"""A Draft service on the Verify service's host takes its context's KV from the Verify service's shared
cache (`specmesh.kv.shared`, `share_kv`), through the Coordinator (in-process services on loopback, tiny
random models): greedy output equals target-only decoding, the coupled seeded output equals that of a
Verify service that shares nothing, the draft copies the prompt instead of feeding it, and a draft of
another model refuses the cache."""

from __future__ import annotations

import asyncio

import pytest
from service_helpers import speculative_via_coordinator, target_only_greedy

from coordinator.options import CoordinatorOptions
from coordinator.server import create_server as create_coordinator
from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from specmesh.proto.v1 import common_pb2
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

TIMEOUT_S = 60
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
COUPLED = dict(temperature=0.9, top_k=0, seed=11, acceptance_rule=common_pb2.ACCEPTANCE_RULE_COUPLED)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def services(target, tiny_model_dir):
    """Coordinators named by what they pair: a sharing Verify service with a bf16 self-draft ("shared"), the same
    draft with a Verify service that shares nothing ("private"), and the sharing one with a draft of another
    model of the same shapes ("other")."""
    other_model = str(tiny_model_dir("llama", init_std=0.3))
    running = BackgroundServices()
    try:
        verifies = {share: running.start(create_verify(VerifyOptions(model=target, dtype="float64", port=0, share_kv=share)))
                    for share in (True, False)}
        pairs = {"shared": (target, True), "private": (target, False), "other": (other_model, True)}
        out = {}
        for name, (draft_model, share) in pairs.items():
            draft = running.start(create_draft(DraftOptions(model=draft_model, dtype="bfloat16", port=0)))
            coordinator = running.start(create_coordinator(CoordinatorOptions(
                model=target, port=0, draft_addresses=f"127.0.0.1:{draft.port}",
                verify_addresses=f"127.0.0.1:{verifies[share].port}")))
            out[name] = (f"127.0.0.1:{coordinator.port}", draft.servicer)
            out[f"{name} ports"] = (draft.port, verifies[share].port)
        yield out
    finally:
        running.close()


def _run(address: str, **sampling):
    run = speculative_via_coordinator(address, PROMPT, 4, TIMEOUT_S, **{"max_new_tokens": 40, **sampling})
    return asyncio.run(asyncio.wait_for(run, TIMEOUT_S))


def _prompt_ids(target: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target).encode(PROMPT, add_special_tokens=False)


def _taken(servicer) -> int:
    return sum(drafter.kv_taken for drafter in servicer._drafters.values())


@pytest.mark.parametrize("name", ["shared", "private", "other"])
def test_greedy_equals_target_only_and_only_the_same_model_on_a_sharing_target_takes_kv(services, target, name):
    address, servicer = services[name]
    before = _taken(servicer)
    tokens, last = _run(address)
    assert tokens == target_only_greedy(target, PROMPT, 40)
    assert last.stats.num_draft_tokens > 0 and last.stats.num_failovers == 0
    taken = _taken(servicer) - before
    if name == "shared":  # at least the prompt (but its last token) came from the target's cache
        assert taken >= len(_prompt_ids(target)) - 1
    else:
        assert taken == 0
    assert servicer.engine.kv_usage().free_blocks == servicer.engine.kv_usage().total_blocks  # sessions closed, KV freed


def test_coupled_seeded_output_is_the_same_with_the_kv_shared_or_not(services):
    shared, _ = _run(services["shared"][0], **COUPLED)
    private, _ = _run(services["private"][0], **COUPLED)
    assert shared == private and len(shared) == 40


def test_the_draft_proposes_what_the_in_process_self_draft_does(services, target):
    """The shared draft's proposals are those of a self-draft in one process taking the same KV (`self_draft`):
    the same rounds, so the same number of target forwards and accepted tokens."""
    from specmesh.decoding.adaptive import FixedK
    from specmesh.decoding.sampling import SamplingParams
    from specmesh.decoding.speculative import generate
    from specmesh.decoding.verifier import TargetVerifier
    from specmesh.drafters.model import self_draft
    from specmesh.models.load import load_engine

    _, last = _run(services["shared"][0])
    ids = _prompt_ids(target)
    engine = load_engine(target, dtype="float64")
    result = generate(TargetVerifier(engine), self_draft(load_engine(target, dtype="bfloat16"), engine), ids,
                      SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=40), k_policy=FixedK(4))
    assert last.stats.num_target_forwards == result.stats.num_target_forwards
    assert last.stats.num_accepted_tokens == result.stats.num_accepted_tokens


def test_a_block_table_its_verify_service_did_not_tag_or_has_released_is_ignored(services, target):
    """A Propose whose target_kv names the right blocks but carries another tag (a caller pointing a draft at
    rows it was not given) copies nothing, nor does one of a session the Verify service closed, whose blocks
    another session holds now (its tag was genuine); the genuine, live one is copied from."""
    from servicekit.channels import open_channel
    from specmesh.proto.v1 import draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

    _, servicer = services["shared"]
    draft_port, verify_port = services["shared ports"]
    prompt = _prompt_ids(target)
    greedy = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8)

    async def propose(how: str) -> int:
        async with open_channel(f"127.0.0.1:{verify_port}") as v, open_channel(f"127.0.0.1:{draft_port}") as d:
            verify, draft = verify_pb2_grpc.VerifyServiceStub(v), draft_pb2_grpc.DraftServiceStub(d)

            async def open_target(prompt_ids):
                return await verify.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt_ids, sampling=greedy))

            async def close_target(opened):
                await verify.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))

            opened = await open_target(prompt)
            target_kv = opened.target_kv
            assert target_kv.length == len(prompt) and len(target_kv.tag) == 16
            if how == "forged":
                target_kv.tag = bytes(16)
            if how == "stale":  # closed, and its blocks taken by the next session (freed blocks are reused first)
                await close_target(opened)
                opened = await open_target(prompt[::-1])
                assert set(opened.target_kv.blocks) & set(target_kv.blocks)
            session = await draft.OpenSession(draft_pb2.DraftOpenSessionRequest(prompt_token_ids=prompt, sampling=greedy))
            before = _taken(servicer)
            await draft.Propose(draft_pb2.ProposeRequest(session_id=session.session_id, num_draft_tokens=3,
                                                         accepted_token_ids=[opened.first_token_id], target_kv=target_kv))
            await draft.CloseSession(draft_pb2.DraftCloseSessionRequest(session_id=session.session_id))
            await close_target(opened)
            return _taken(servicer) - before

    assert asyncio.run(asyncio.wait_for(propose("forged"), TIMEOUT_S)) == 0
    assert asyncio.run(asyncio.wait_for(propose("stale"), TIMEOUT_S)) == 0
    assert asyncio.run(asyncio.wait_for(propose("genuine"), TIMEOUT_S)) == len(prompt)


def test_mappings_of_verify_services_that_exited_are_dropped(services, target):
    """When a Propose names a region it has not mapped (a Verify replica started or restarted), the Draft
    service unmaps the caches of writers that are gone: each holds a whole cache's memory."""
    import dataclasses

    address, servicer = services["shared"]
    _run(address)  # the live Verify service's cache is mapped
    (key, live), = [(k, m) for k, m in servicer._kv_sources.items() if m is not None]
    gone = dataclasses.replace(live.region, pid=2**22 + 12345)
    ghost = type(live)(gone, live.k, live.v, live.key, live.epochs)
    servicer._kv_sources.clear()
    servicer._kv_sources[gone.key] = ghost
    _run(address)
    assert gone.key not in servicer._kv_sources and servicer._kv_sources.get(key) is not None
