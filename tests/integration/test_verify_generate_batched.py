"""Verify.Generate takes Run's path: its rounds go through the cross-session batcher (several Generate
streams share forwards), and it streams exactly what OpenSession + Run stream, greedy and seeded sampling,
and what the in-process plain loop makes. A lone stream's rounds (Generate's, or one session's target-only
Run) run back to back on the engine thread (`_back_to_back`) with the same tokens, and Run keeps its
per-round messages and round log. A float32 target, so the engine's fast path serves the rounds."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from service_helpers import wait_for

from servicekit.background import BackgroundServices
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine
from specmesh.proto.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

PROMPTS = [[5, 17, 33, 5, 17, 33, 5, 17], [100, 7, 250, 31, 9, 60, 12, 200, 4, 4, 99, 1, 3], [42, 43, 44]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def service(tiny_model_dir):
    model = str(tiny_model_dir("smollm2", init_std=0.2))
    with BackgroundServices() as services:
        handle = services.start(create_verify(VerifyOptions(model=model, dtype="float32", port=0, batch_window_ms=50.0)))
        yield model, handle, f"127.0.0.1:{handle.port}"


def _sampling(**kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


def _generate(stub, prompt, sampling) -> list[int]:
    responses = list(stub.Generate(verify_pb2.VerifyGenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=60))
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids]


def _open_and_run(stub, prompt, sampling) -> list[int]:
    opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=prompt, sampling=sampling))
    rounds = list(stub.Run(verify_pb2.RunRequest(session_id=opened.session_id), timeout=60))
    stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))
    return [opened.first_token_id] + [t for r in rounds for t in r.result.accepted_token_ids]


def _run_beside_an_idle_session(stub, prompt, sampling) -> list[int]:
    """OpenSession + Run while another session is open: Run's rounds go through the batcher."""
    idle = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPTS[2], sampling=sampling))
    try:
        return _open_and_run(stub, prompt, sampling)
    finally:
        stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=idle.session_id))


def test_concurrent_generate_streams_share_forwards_and_match_run(service):
    model, handle, address = service
    engine = handle.servicer.engine
    assert engine.model.fast is not None
    plain = [generate(TargetVerifier(load_engine(model, dtype="float32")), None, p,
                      SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)).token_ids for p in PROMPTS]
    free_before = engine.num_free_blocks
    with grpc.insecure_channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        forwards_before = engine.stats.num_forwards
        sequences_before = engine.stats.num_sequences_forwarded
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            streamed = list(pool.map(lambda p: _generate(stub, p, _sampling(temperature=0.0)), PROMPTS))
        forwards = engine.stats.num_forwards - forwards_before
        sequences = engine.stats.num_sequences_forwarded - sequences_before
        assert streamed == plain
        assert sequences == len(PROMPTS) * NEW_TOKENS  # one prefill and NEW_TOKENS - 1 rounds per stream
        assert forwards < sequences  # the streams' rounds rode in shared forwards
        # a lone Generate stream runs back to back; Run beside an idle second session takes the batcher
        for prompt in PROMPTS[:2]:
            for sampling in (_sampling(temperature=0.0), _sampling(temperature=1.0, seed=7)):
                solo_before = handle.servicer.num_solo_rounds
                alone = _generate(stub, prompt, sampling)
                assert handle.servicer.num_solo_rounds - solo_before == NEW_TOKENS - 1
                assert alone == _run_beside_an_idle_session(stub, prompt, sampling)
                assert handle.servicer.num_solo_rounds - solo_before == NEW_TOKENS - 1  # Run was not alone
        # a long lone stream, ended by the caller partway: its job stops and its sequence is freed
        stream = stub.Generate(verify_pb2.VerifyGenerateRequest(prompt_token_ids=PROMPTS[0], sampling=common_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=400, ignore_eos=True)), timeout=60)
        assert len(next(stream).token_ids) >= 1
        stream.cancel()
    assert wait_for(lambda: engine.num_free_blocks == free_before, 10)


def test_a_lone_run_steps_back_to_back_and_keeps_its_round_log(service):
    """One session's target-only Run, nobody else on the service: every round back to back on the engine
    thread, each still its own message with its round index; max_rounds and a later Run go on from there."""
    model, handle, address = service
    sampling = _sampling(temperature=1.0, seed=11)
    with grpc.insecure_channel(address) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        batched = _run_beside_an_idle_session(stub, PROMPTS[1], sampling)
        opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPTS[1], sampling=sampling))
        solo_before = handle.servicer.num_solo_rounds
        first = list(stub.Run(verify_pb2.RunRequest(session_id=opened.session_id, max_rounds=5), timeout=60))
        assert [r.result.round_index for r in first] == [0, 1, 2, 3, 4]
        assert handle.servicer.num_solo_rounds - solo_before == 5
        rest = list(stub.Run(verify_pb2.RunRequest(session_id=opened.session_id, round_index=5), timeout=60))
        assert [r.result.round_index for r in rest] == list(range(5, NEW_TOKENS - 1))
        assert rest[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert handle.servicer.num_solo_rounds - solo_before == NEW_TOKENS - 1
        stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))
    tokens = [opened.first_token_id] + [t for r in first + rest for t in r.result.accepted_token_ids]
    assert tokens == batched


def test_lone_streams_with_steps_launched_ahead(service):
    """The service's verifier launching each lone stream's next target-only step ahead (the default on
    CUDA, `TargetVerifier.plain_ahead`; forced on here): the same tokens as the batched path, Run in two
    parts included, and a stream cancelled partway frees every block, the step launched ahead's too."""
    model, handle, address = service
    verifier, engine = handle.servicer.verifier, handle.servicer.engine
    free_before = engine.num_free_blocks
    verifier.plain_ahead = True
    try:
        with grpc.insecure_channel(address) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            for sampling in (_sampling(temperature=0.0), _sampling(temperature=1.0, seed=7)):
                taken_before = verifier.num_ahead_taken
                alone = _generate(stub, PROMPTS[1], sampling)
                assert verifier.num_ahead_taken - taken_before == NEW_TOKENS - 2  # every round but the first
                assert alone == _run_beside_an_idle_session(stub, PROMPTS[1], sampling)
                opened = stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPTS[1], sampling=sampling))
                first = list(stub.Run(verify_pb2.RunRequest(session_id=opened.session_id, max_rounds=5), timeout=60))
                rest = list(stub.Run(verify_pb2.RunRequest(session_id=opened.session_id, round_index=5), timeout=60))
                stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=opened.session_id))
                assert [opened.first_token_id] + [t for r in first + rest for t in r.result.accepted_token_ids] == alone
            stream = stub.Generate(verify_pb2.VerifyGenerateRequest(prompt_token_ids=PROMPTS[0], sampling=common_pb2.SamplingParams(
                temperature=0.0, max_new_tokens=400, ignore_eos=True)), timeout=60)
            assert len(next(stream).token_ids) >= 1
            stream.cancel()
        assert wait_for(lambda: engine.num_free_blocks == free_before, 10)
    finally:
        verifier.plain_ahead = False
